"""The images' way into the lake and out to training: a source's listing and its diff against the table, the decoding
that Spark's executors run, the images table, the split records and the cached splits' layout."""
