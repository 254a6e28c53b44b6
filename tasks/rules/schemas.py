"""The Arrow schemas of what the pipeline writes: the source listing, the resize stage's staged rows, the images
table."""

from __future__ import annotations

import pyarrow as pa

LISTING_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("label", pa.string()),
        ("date", pa.date32()),
        ("size", pa.int64()),
        ("mtime", pa.float64()),
        ("stamp", pa.string()),  # the store's change token (tasks/rules/listed_files.py:change_stamp)
        ("issue", pa.string()),
        ("action", pa.string()),
    ]
)


# A listed entry the diff kept, with the content hash the table holds for its path (None: a new path).
CHANGES_SCHEMA = pa.schema(list(LISTING_SCHEMA) + [("known_sha256", pa.string())])


# The listing's columns, then what reading and decoding found.
STAGED_ARROW_SCHEMA = pa.schema(
    list(LISTING_SCHEMA)
    + [
        ("sha256", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("data_file", pa.string()),
    ]
)


# The Delta table of images, one row per (path, image size).
IMAGE_TABLE_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("label", pa.string()),
        ("date", pa.date32()),
        ("size", pa.int64()),
        ("mtime", pa.float64()),
        ("stamp", pa.string()),
        ("sha256", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("image_size", pa.int32()),
        ("image", pa.binary()),
        ("ingested_at", pa.timestamp("us", tz="UTC")),
    ]
)


STAGED_IMAGE_COLUMNS = [name for name in IMAGE_TABLE_SCHEMA.names if name not in ("image_size", "image", "ingested_at")]


HISTORY_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("alias", pa.string()),
        ("from_version", pa.string()),
        ("to_version", pa.string()),
        ("action", pa.string()),
        ("reason", pa.string()),
        ("who", pa.string()),
        ("at", pa.timestamp("us", tz="UTC")),
        ("flow_run_id", pa.string()),
        ("move_id", pa.string()),  # one per alias move: its rows (champion and previous-champion) share it
    ]
)


# The Delta table of a registered model's answers, one row per (sha256, model name, model version).
ANSWER_SCHEMA = pa.struct([("label", pa.string()), ("probability", pa.float64())])
PREDICTIONS_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("sha256", pa.string()),
        ("label", pa.string()),
        ("probability", pa.float64()),
        ("top_k", pa.list_(ANSWER_SCHEMA)),
        ("error", pa.string()),
        ("model_name", pa.string()),
        ("model_version", pa.int64()),
        # The version's MLflow run: an identity no later model takes again (a deleted and re-created model issues
        # version 1 anew); what a version answered before is read by it. Name and version stay, for reading.
        ("model_run_id", pa.string()),
        ("source", pa.string()),
        ("source_version", pa.int64()),  # the Delta table version scored; null for a folder or object-store prefix
        ("scored_at", pa.timestamp("us", tz="UTC")),
    ]
)
# What the executors give back for each image; the driver adds the run's model, source and time.
ANSWERED_SCHEMA = pa.schema(list(PREDICTIONS_SCHEMA)[:6])
