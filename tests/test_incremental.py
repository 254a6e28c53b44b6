"""A growing lake costs what it grows by: the diff against the table runs in Spark and brings only what changed to
the driver, and a run over a listing the tables already hold starts no Spark job at all."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pyarrow.parquet as pq

from infra.delta import Table
from tests.lake import Lake, copy_digits


def spark_jobs(spark, run) -> tuple[object, int]:
    """RUN's result and how many Spark jobs it started."""
    context = spark.sparkContext
    group = f"probe-{uuid.uuid4().hex}"
    context.setJobGroup(group, "counted by a test")
    try:
        result = run()
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)
    return result, len(context.statusTracker().getJobIdsForGroup(group))


def test_a_rerun_over_a_listing_the_table_holds_starts_no_spark_job(lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, per_label=6)
    (source / "0" / "broken.png").write_bytes(b"not an image")
    _, _, first = lake.run(source)
    assert first.rows == 24 and first.quarantined == 1

    # Nothing changed since the write: no join, no decode, no row of either table read into the driver.
    (ingested, resized, written), jobs = spark_jobs(lake.spark, lambda: lake.run(source))
    assert jobs == 0
    assert (ingested.candidates, ingested.unchanged, resized.decoded, written.rows, written.version) == (0, 25, 0, 0, first.version)

    # Two new files: the join finds them, and the diff staged for the executors holds just those two.
    shutil.copy(next((digits_dir / "5").glob("*.png")), source / "1" / "new-a.png")
    shutil.copy(next((digits_dir / "6").glob("*.png")), source / "2" / "new-b.png")
    (ingested, resized, written), jobs = spark_jobs(lake.spark, lambda: lake.run(source))
    assert jobs > 0
    assert pq.read_table(ingested.manifest_uri.removeprefix("file://")).column("path").to_pylist() == sorted(
        f"file://{source}/{label}/{name}" for label, name in (("1", "new-a.png"), ("2", "new-b.png"))
    )
    assert (ingested.candidates, ingested.unchanged, resized.decoded, written.rows) == (2, 25, 2, 2)
    (_, _, again), jobs = spark_jobs(lake.spark, lambda: lake.run(source))
    assert jobs == 0 and again.version == written.version


def test_a_version_made_by_another_writer_is_diffed_again(lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, per_label=6)
    lake.run(source)
    compacted = Table(lake.table, lake.spark, lake.engine)
    compacted.compact()  # a new version, with the same rows, that no run of ours made

    (ingested, resized, written), jobs = spark_jobs(lake.spark, lambda: lake.run(source))
    assert jobs > 0, "a version the marker does not name must be diffed"
    assert (ingested.candidates, resized.decoded, written.rows) == (0, 0, 0)
    (_, _, _), jobs = spark_jobs(lake.spark, lambda: lake.run(source))
    assert jobs == 0, "the diff that found nothing marks the version it read"


def test_a_file_touched_but_not_changed_is_hashed_once_not_every_run(lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, per_label=6)
    lake.run(source)
    next((source / "3").glob("*.png")).touch()
    ingested, resized, written = lake.run(source)
    assert (ingested.candidates, resized.known, resized.decoded, written.rows) == (1, 1, 0, 0)
    ingested, resized, _ = lake.run(source)
    assert (ingested.candidates, resized.known) == (0, 0)

