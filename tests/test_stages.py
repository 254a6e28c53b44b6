"""The data stages on real Spark and real Delta tables, on a few dozen images."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from deltalake import DeltaTable

from infra.delta import read_version
from tasks.cache import cache_splits
from tasks.ingest import SourceError, ingest_images, listing_fingerprint, source_uri
from tasks.loader import ShardBatches
from tasks.repartition import images_with_split, plan_splits, split_column, split_of
from tasks.resize import resize_images
from tasks.write import write_images

EXTENSIONS = [".png", ".jpg"]


@pytest.fixture
def small_source(digits_dir: Path, tmp_path: Path) -> Path:
    """40 digits of four labels plus one file that is not an image."""
    source = tmp_path / "source"
    for label in ("0", "1", "2", "3"):
        (source / label).mkdir(parents=True)
        for png in sorted((digits_dir / label).glob("*.png"))[:10]:
            shutil.copy(png, source / label / png.name)
    (source / "3" / "broken.png").write_bytes(b"this is not a png")
    return source


def test_ingest_resize_write_end_to_end_on_spark_and_delta(spark, small_source: Path, tmp_path: Path, settings) -> None:
    ingested = ingest_images(spark, source_uri(str(small_source)), EXTENSIONS, str(tmp_path / "raw"))
    assert ingested.rows == 41 and ingested.labels == ["0", "1", "2", "3"]
    staged = {Path(row["path"].removeprefix("file:")).name: row for row in spark.read.parquet(ingested.staging_uri).collect()}
    one = sorted((small_source / "2").glob("*.png"))[0]
    assert staged[one.name]["sha256"] == hashlib.sha256(one.read_bytes()).hexdigest()
    assert staged[one.name]["label"] == "2"

    resized = resize_images(spark, ingested, 24, "letterbox", str(tmp_path / "resized"))
    assert (resized.rows, resized.failed) == (40, 1)
    assert any("broken.png" in path for path in resized.failures)

    table = str(tmp_path / "table")
    written = write_images(spark, resized, table, "delta-rs")
    assert (written.version, written.rows) == (0, 40)
    assert DeltaTable(table).to_pyarrow_table().num_rows == 40

    again = write_images(spark, resized, table, "delta-rs")
    assert (again.version, again.rows) == (0, 0), "rewriting the same images must not add rows or versions"
    assert read_version(spark, table, 0, "delta-rs").count() == 40


def test_a_new_file_changes_the_listing_and_adds_only_itself(spark, small_source: Path, tmp_path: Path, digits_dir: Path) -> None:
    uri = source_uri(str(small_source))
    before = listing_fingerprint(uri, EXTENSIONS)
    table = str(tmp_path / "table")
    first = resize_images(spark, ingest_images(spark, uri, EXTENSIONS, str(tmp_path / "r1")), 24, "letterbox", str(tmp_path / "s1"))
    write_images(spark, first, table, "delta-rs")

    shutil.copy(sorted((digits_dir / "5").glob("*.png"))[0], small_source / "0" / "new.png")
    assert listing_fingerprint(uri, EXTENSIONS) != before
    second = resize_images(spark, ingest_images(spark, uri, EXTENSIONS, str(tmp_path / "r2")), 24, "letterbox", str(tmp_path / "s2"))
    written = write_images(spark, second, table, "delta-rs")
    assert (written.version, written.rows) == (1, 1)
    assert read_version(spark, table, 0, "delta-rs").count() == 40, "time travel to the first version"


@pytest.mark.parametrize("make_source", ["missing", "empty"])
def test_bad_sources_are_named(spark, tmp_path: Path, make_source: str) -> None:
    folder = tmp_path / "images"
    if make_source == "empty":
        folder.mkdir()
        with pytest.raises(SourceError, match="no image files"):
            ingest_images(spark, source_uri(str(folder)), EXTENSIONS, str(tmp_path / "raw"))
    else:
        with pytest.raises(SourceError, match="images"):
            source_uri(str(folder))


def test_spark_split_matches_the_pure_rule(spark) -> None:
    hashes = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(300)]
    frame = spark.createDataFrame([(h,) for h in hashes], "sha256 string").withColumn("split", split_column(0.1, 0.2))
    assert {row["sha256"]: row["split"] for row in frame.collect()} == {h: split_of(h, 0.1, 0.2) for h in hashes}


def test_cache_is_keyed_reused_and_readable_by_shard(spark, small_source: Path, tmp_path: Path, settings) -> None:
    uri = source_uri(str(small_source))
    resized = resize_images(spark, ingest_images(spark, uri, EXTENSIONS, str(tmp_path / "raw")), 32, "letterbox", str(tmp_path / "rs"))
    written = write_images(spark, resized, str(tmp_path / "table"), "delta-rs")
    plan = plan_splits(spark, written, settings.model_copy(update={"val_fraction": 0.2, "test_fraction": 0.2}))
    assert sum(plan.counts.values()) == 40 and plan.num_partitions == 4

    cached = cache_splits(spark, plan, 32, str(tmp_path / "cache"))
    assert not cached.reused and cached.cache_dir.endswith(cached.key)
    train_files = list(Path(cached.splits["train"].removeprefix("file://")).glob("*.parquet"))
    assert 1 <= len(train_files) <= plan.num_partitions
    assert cache_splits(spark, plan, 32, str(tmp_path / "cache")).reused

    seen = 0
    for shard in range(2):
        with ShardBatches(cached.splits["train"], shard=shard, shard_count=2, batch_size=4, steps=2, image_size=32, seed=1, shuffle=True, workers=1) as batches:
            for images, labels in batches:
                assert images.shape == (4, 32, 32, 3) and str(images.dtype) == "torch.uint8"
                assert str(labels.dtype) == "torch.int64" and int(labels.max()) < len(plan.labels)
                seen += len(labels)
            assert len(list(batches)) == 2, "a second epoch keeps reading the same open reader"
    assert seen == 16
    expected = images_with_split(spark, written.table_uri, written.version, "delta-rs", 32, 0.2, 0.2).where("split = 'train'").count()
    assert expected == plan.counts["train"]


def test_spark_delta_writer_has_the_same_semantics_where_its_jars_load(spark, small_source: Path, tmp_path: Path) -> None:
    from infra.spark import delta_jars_loaded

    if not delta_jars_loaded(spark):
        pytest.skip("Spark's Delta jars are not on this machine's classpath (add them with IMAGELAKE_SPARK_JARS)")
    resized = resize_images(spark, ingest_images(spark, source_uri(str(small_source)), EXTENSIONS, str(tmp_path / "raw")), 24, "letterbox", str(tmp_path / "rs"))
    table = str(tmp_path / "table")
    assert (write_images(spark, resized, table, "spark").rows, DeltaTable(table).version()) == (40, 0)
    assert write_images(spark, resized, table, "spark").rows == 0
    assert read_version(spark, table, 0, "spark").count() == 40
