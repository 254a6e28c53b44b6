"""A growing lake costs what it grows by: the diff against the table runs in Spark and brings only what changed to
the driver, or, when the tables are in step with an earlier listing, compares the two listings without Spark; a run
over a listing the tables already hold starts no Spark job at all; the cache of a new version adds only its new rows
(a compaction keeps it as it was)."""

from __future__ import annotations

import os
import random
import shutil
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from imagelake.infra.delta import Table
from imagelake.tasks.data.cache_files import clean_cache, mark_read, split_files
from imagelake.tasks.data.changes import (
    NotInPathOrder,
    changes_between,
    ingest_listing,
    listing_changes,
    merged_listing_changes,
    read_listing,
)
from imagelake.tasks.data.listing import source_uri, write_manifest
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.rules.splits import split_of
from imagelake.tasks.stages.cache import cache_splits
from imagelake.tasks.stages.split import plan_splits
from imagelake.tasks.worker.loader import shard_rows
from tests.lake import SCOPE, Lake, copy_digits


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


@pytest.mark.both_engines
def test_a_rerun_over_a_listing_the_table_holds_starts_no_spark_job(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, per_label=6)
    (source / "0" / "broken.png").write_bytes(b"not an image")
    _, _, first = lake.run(source)
    assert first.rows == 24 and first.quarantined == 1

    # Nothing changed since the write: no join, no decode, no row of either table read into the driver.
    (ingested, resized, written), jobs = spark_jobs(lake.spark, lambda: lake.run(source))
    assert jobs == 0
    assert (ingested.candidates, ingested.unchanged, resized.decoded, written.rows, written.version) == (
        0,
        25,
        0,
        0,
        first.version,
    )

    # Two new files: the diff staged for decoding holds just those two, which the driver decodes, and the write's
    # semi-join against the table (the driver's at this size) finds nothing: no Spark job.
    shutil.copy(next((digits_dir / "5").glob("*.png")), source / "1" / "new-a.png")
    shutil.copy(next((digits_dir / "6").glob("*.png")), source / "2" / "new-b.png")
    (ingested, resized, written), jobs = spark_jobs(lake.spark, lambda: lake.run(source, in_driver_up_to=10))
    assert jobs == 0
    assert pq.read_table(ingested.manifest_uri.removeprefix("file://")).column("path").to_pylist() == sorted(
        f"file://{source}/{label}/{name}" for label, name in (("1", "new-a.png"), ("2", "new-b.png"))
    )
    assert (ingested.candidates, ingested.unchanged, resized.decoded, written.rows) == (2, 25, 2, 2)
    # A copy of an image the table holds, under a new path: that semi-join drops it.
    shutil.copy(sorted((source / "0").glob("*.png"))[0], source / "3" / "copy-c.png")
    (_, resized, written) = lake.run(source, in_driver_up_to=10)
    assert (resized.decoded, written.rows) == (1, 0) and f"file://{source}/3/copy-c.png" not in lake.rows(
        written.version
    )
    (_, _, again), jobs = spark_jobs(lake.spark, lambda: lake.run(source))
    assert jobs == 0 and again.version == written.version


@pytest.mark.both_engines
def test_after_a_write_the_diff_compares_two_listings_and_finds_what_the_spark_join_finds(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    source, staging = tmp_path / "src", f"{lake.root}/staging"
    copy_digits(digits_dir, source, per_label=6)
    lake.run(source, retire=True)
    table = ImageTable.at(lake.spark, lake.table, 24, lake.engine, lake.quarantine)

    def diffed() -> tuple[list[dict], int]:
        ingested, jobs = spark_jobs(
            lake.spark, lambda: ingest_listing(table, source_uri(str(source)), SCOPE, True, staging)
        )
        return sorted(
            pq.read_table(ingested.manifest_uri.removeprefix("file://")).to_pylist(), key=lambda row: row["path"]
        ), jobs

    def by_the_join() -> list[dict]:
        for state in Path(staging.removeprefix("file://"), "in-sync").glob("last-*.json"):
            state.unlink()  # no listing in step with the tables: the diff joins the listing with the table
        rows, jobs = diffed()
        assert jobs > 0
        return rows

    # A new file and a deleted one: found from the two listings alone, without a Spark job.
    shutil.copy(next((digits_dir / "5").glob("*.png")), source / "1" / "new-a.png")
    sorted((source / "2").glob("*.png"))[0].unlink()
    by_listings, jobs = diffed()
    assert jobs == 0
    assert [(Path(row["path"]).name, row["action"]) for row in by_listings] == [
        ("new-a.png", "upsert"),
        (sorted((digits_dir / "2").glob("*.png"))[0].name, "delete"),
    ]
    assert by_listings == by_the_join()

    # A file rewritten with the same bytes: only its path is looked up in the table, for the hash it holds there (a
    # semi-join: the driver's scan where this pyarrow opens the table's files, Spark's where a delta-rs merge wrote
    # them).
    lake.run(source, retire=True)
    rewritten = sorted((source / "3").glob("*.png"))[0]
    rewritten.write_bytes(rewritten.read_bytes())
    by_listings, _ = diffed()
    assert [row["known_sha256"] for row in by_listings] == [lake.rows()[f"file://{rewritten}"]]
    assert by_listings == by_the_join()


@pytest.mark.both_engines
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


def test_a_file_touched_but_not_changed_is_hashed_once_not_every_run(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, per_label=6)
    lake.run(source)
    next((source / "3").glob("*.png")).touch()
    ingested, resized, written = lake.run(source)
    assert (ingested.candidates, resized.known, resized.decoded, written.rows) == (1, 1, 0, 0)
    ingested, resized, _ = lake.run(source)
    assert (ingested.candidates, resized.known) == (0, 0)


def cached_version(lake: Lake, written, settings, root: Path):
    plan = plan_splits(
        lake.spark, written, settings.model_copy(update={"image_size": 24, "val_fraction": 0.2, "test_fraction": 0.2})
    )
    return plan, cache_splits(lake.spark, plan, 24, str(root))


def split_keys(cached) -> dict[str, list[str]]:
    return {
        split: sorted(pq.read_table(split_files(uri)[1], columns=["sha256"]).column("sha256").to_pylist())
        for split, uri in cached.splits.items()
    }


@pytest.mark.both_engines
def test_the_cache_of_a_new_version_adds_only_its_new_rows_and_drops_retired_ones(
    lake: Lake, digits_dir: Path, tmp_path: Path, settings
) -> None:
    source, root = tmp_path / "src", tmp_path / "cache"
    copy_digits(digits_dir, source, per_label=10)
    _, _, v0 = lake.run(source)
    _, first = cached_version(lake, v0, settings, root)
    first_files = {split: split_files(uri)[1] for split, uri in first.splits.items()}

    copy_digits(digits_dir, source, per_label=2, skip=10)  # 8 new images
    _, _, v1 = lake.run(source)
    (plan, grown), jobs = spark_jobs(lake.spark, lambda: cached_version(lake, v1, settings, root))
    # Counts carried forward from v0's and the new rows cached, both from the data files the commit added alone.
    assert jobs == 0, f"planning and caching a version that only added rows started {jobs} Spark job(s)"
    assert not grown.reused and grown.table_version == v1.version and grown.cache_dir == first.cache_dir
    for split, uri in grown.splits.items():
        files = split_files(uri)[1]
        assert set(first_files[split]) <= set(files), "the first version's files are shared, not copied"
        new = [f for f in files if f not in first_files[split]]
        assert all("/g000001/" in f for f in new)
        assert sum(pq.read_metadata(f).num_rows for f in new) == plan.counts[split] - first.counts[split]
    table = {split: sorted(keys) for split, keys in by_split(lake, v1.version).items()}
    assert split_keys(grown) == table
    assert split_keys(first) == {split: sorted(keys) for split, keys in by_split(lake, v0.version).items()}, (
        "the first version reads as before"
    )

    # Retired files leave the cache of the next version; the files that held them are rewritten, the rest shared.
    gone = sorted((source / "2").glob("*.png"))[:3]
    for png in gone:
        png.unlink()
    _, _, v2 = lake.run(source, retire=True)
    _, shrunk = cached_version(lake, v2, settings, root)
    assert split_keys(shrunk) == {split: sorted(keys) for split, keys in by_split(lake, v2.version).items()}
    assert sum(shrunk.counts.values()) == sum(grown.counts.values()) - 3

    # New and retired rows in one version: both land, and the rewritten files sit beside the new ones.
    for png in sorted((source / "3").glob("*.png"))[:2]:
        png.unlink()
    copy_digits(digits_dir, source, labels=("1",), per_label=2, skip=12)
    _, _, v3 = lake.run(source, retire=True)
    _, mixed = cached_version(lake, v3, settings, root)
    assert split_keys(mixed) == {split: sorted(keys) for split, keys in by_split(lake, v3.version).items()}
    assert sum(mixed.counts.values()) == sum(shrunk.counts.values())

    # Rows read through the loader: every row of a version's split once.
    per_shard = shard_rows(mixed.splits["train"], 2)
    assert sum(per_shard) == mixed.counts["train"]


def counted(lake: Lake, version: int) -> dict[str, dict[str, int]]:
    """Images per split and label of a version, counted by Spark over the whole version."""
    frame = ImageTable.at(lake.spark, lake.table, 24, lake.engine).with_split(version, 0.2, 0.2)
    counts: dict[str, dict[str, int]] = {"train": {}, "val": {}, "test": {}}
    for row in frame.groupBy("split", "label").count().collect():
        counts[row["split"]][row["label"]] = row["count"]
    return {split: dict(sorted(by_label.items())) for split, by_label in counts.items()}


@pytest.mark.both_engines
def test_split_counts_carried_forward_are_those_counted_over_the_version(
    lake: Lake, digits_dir: Path, tmp_path: Path, settings
) -> None:
    source = tmp_path / "src"
    planning = settings.model_copy(update={"image_size": 24, "val_fraction": 0.2, "test_fraction": 0.2})
    copy_digits(digits_dir, source, per_label=10)
    _, _, v0 = lake.run(source)
    assert plan_splits(lake.spark, v0, planning).label_counts == counted(lake, v0.version)
    # Added rows: v0's counts plus the rows of the files the commit added, no Spark job.
    copy_digits(digits_dir, source, per_label=3, skip=10)
    _, _, v1 = lake.run(source)
    plan, jobs = spark_jobs(lake.spark, lambda: plan_splits(lake.spark, v1, planning))
    assert jobs == 0 and plan.label_counts == counted(lake, v1.version) != counted(lake, v0.version)
    # Retired rows (a merge: files rewritten, their kept rows on both sides) and a compaction (every file rewritten).
    for png in sorted((source / "2").glob("*.png"))[:4]:
        png.unlink()
    _, _, v2 = lake.run(source, retire=True)
    assert plan_splits(lake.spark, v2, planning).label_counts == counted(lake, v2.version)
    Table(lake.table, lake.spark, lake.engine).compact()
    v3 = v2.model_copy(update={"version": Table(lake.table).version()})
    assert v3.version > v2.version and plan_splits(lake.spark, v3, planning).label_counts == counted(lake, v3.version)
    # A table made anew at the same place starts from its own rows, not the old table's counts.
    shutil.rmtree(lake.table.removeprefix("file://"))
    shutil.rmtree(source / "0")
    _, _, anew = lake.run(source)
    assert anew.version == 0 and plan_splits(lake.spark, anew, planning).label_counts == counted(lake, 0)


def by_split(lake: Lake, version: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for sha in lake.rows(version).values():
        out[split_of(sha, 0.2, 0.2)].append(sha)
    return out


@pytest.mark.both_engines
def test_a_compaction_keeps_the_cache_and_so_the_model(lake: Lake, digits_dir: Path, tmp_path: Path, settings) -> None:
    source, root = tmp_path / "src", tmp_path / "cache"
    copy_digits(digits_dir, source, per_label=10)
    for part in range(3):  # three commits, so compaction has files to merge
        copy_digits(digits_dir, source, per_label=3, skip=10 + 3 * part)
        _, _, written = lake.run(source)
    _, before = cached_version(lake, written, settings, root)
    Table(lake.table, lake.spark, lake.engine).compact()
    _, _, after_write = lake.run(source)
    assert after_write.version > written.version, "the compaction made a version"
    _, after = cached_version(lake, after_write, settings, root)
    # The same cache (key, version, files): the train stage's key, made of it, is a hit, and the model stays.
    assert after.model_dump() == before.model_dump() and after.reused
    # `maintain` keeps the manifests that cache hands out, though their version is no longer the newest.
    clean_cache(str(root), {}, retention_hours=0)
    assert split_keys(after) == {s: sorted(k) for s, k in by_split(lake, after_write.version).items()}


@pytest.mark.both_engines
def test_maintain_removes_cache_files_no_kept_version_needs(
    lake: Lake, digits_dir: Path, tmp_path: Path, settings
) -> None:
    source, root = tmp_path / "src", tmp_path / "cache"
    copy_digits(digits_dir, source, per_label=10)
    _, _, v0 = lake.run(source)
    _, c0 = cached_version(lake, v0, settings, root)
    for png in sorted((source / "1").glob("*.png"))[:4]:
        png.unlink()
    _, _, v1 = lake.run(source, retire=True)
    _, c1 = cached_version(lake, v1, settings, root)
    copy_digits(digits_dir, source, per_label=2, skip=10)
    _, _, v2 = lake.run(source)
    _, c2 = cached_version(lake, v2, settings, root)
    files = {
        name: {f for uri in c.splits.values() for f in split_files(uri)[1]}
        for name, c in (("v0", c0), ("v1", c1), ("v2", c2))
    }
    only_v0 = files["v0"] - files["v2"]
    assert only_v0 and files["v1"] <= files["v2"], "v1 rewrote files of v0, and v2 grew from v1"

    # Nothing is old enough yet: the retention keeps everything.
    assert clean_cache(str(root), {v0.table_uri: [v0.version]}, retention_hours=1) == {
        "manifests": 0,
        "files": 0,
        "bytes": 0,
    }
    # v1's manifests three hours old: a run that reads v1 again (a retrain on a stored cache result) marks them read,
    # and `maintain` with an hour's retention keeps them while it trains.
    hours_ago = time.time() - 3 * 3600
    for uri in c1.splits.values():
        os.utime(uri.removeprefix("file://"), (hours_ago, hours_ago))
    mark_read(list(c1.splits.values()))
    assert clean_cache(str(root), {v0.table_uri: [v0.version]}, retention_hours=1)["manifests"] == 0
    # v0 is a registered model's and v2 the newest: v1's manifests go, and no file (v2 names all of v1's).
    removed = clean_cache(str(root), {v0.table_uri: [v0.version]}, retention_hours=0)
    assert (removed["manifests"], removed["files"]) == (3, 0)
    assert split_keys(c0) == {s: sorted(k) for s, k in by_split(lake, v0.version).items()}
    # Once no model needs v0, the files only it named go too.
    removed = clean_cache(str(root), {}, retention_hours=0)
    assert (removed["manifests"], removed["files"]) == (3, len(only_v0))
    assert not any(Path(f.removeprefix("file://")).exists() for f in only_v0)
    assert split_keys(c2) == {s: sorted(k) for s, k in by_split(lake, v2.version).items()}


@pytest.mark.parametrize("rows", [1, 7, 50_000])
def test_two_listings_merged_a_batch_at_a_time_give_what_the_whole_listings_give(tmp_path: Path, rows: int) -> None:
    def entry(i: int, mtime: float = 1.0) -> dict:
        return {
            "path": f"file:///src/{i % 7}/{i:05d}.png",
            "label": str(i % 7),
            "date": None,
            "size": 10 + i,
            "mtime": mtime,
            "stamp": None if i % 3 else f"s{i}",
            "issue": None,
            "action": "upsert",
        }

    before = sorted((entry(i) for i in range(300) if i % 11), key=lambda e: e["path"])
    now = sorted(
        (entry(i, 2.0 if i % 17 == 0 else 1.0) for i in range(330) if i % 13), key=lambda e: e["path"]
    )  # new, gone, rewritten
    earlier, later = (
        write_manifest(before, str(tmp_path / "before.parquet")),
        write_manifest(now, str(tmp_path / "now.parquet")),
    )
    whole = listing_changes(read_listing(earlier), read_listing(later), retire=True)
    in_order = lambda table: sorted(table.to_pylist(), key=lambda row: (row["path"], row["action"]))  # noqa: E731
    assert in_order(merged_listing_changes(earlier, later, retire=True, rows=rows)) == in_order(whole)
    kinds = {(row["action"], row["listed_before"]) for row in whole.to_pylist()}
    assert kinds == {("upsert", False), ("upsert", True), ("delete", True)}, (
        "new, rewritten and gone files are all there"
    )
    # Files gone past the new listing's last path.
    shorter = write_manifest(now[: len(now) // 2], str(tmp_path / "shorter.parquet"))
    assert in_order(merged_listing_changes(earlier, shorter, retire=True, rows=rows)) == in_order(
        listing_changes(read_listing(earlier), read_listing(shorter), retire=True)
    )

    # A manifest lists in its own order: no merge, the two listings are diffed whole.
    shuffled = write_manifest(random.Random(1).sample(now, len(now)), str(tmp_path / "shuffled.parquet"))
    with pytest.raises(NotInPathOrder):
        merged_listing_changes(earlier, shuffled, retire=True, rows=rows)
    assert in_order(changes_between(earlier, shuffled, retire=True)) == in_order(whole)


def test_new_rows_cached_by_the_driver_have_the_layout_spark_writes(spark, tmp_path: Path) -> None:
    import hashlib

    import fsspec
    import pyarrow as pa

    from imagelake.tasks.data.cache_files import GENERATION_BITS, row_groups
    from imagelake.tasks.stages.cache import write_split, write_split_arrow

    shas = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(300)]
    rows = pa.table(
        {
            "image": [random.Random(i).randbytes(64) for i in range(300)],
            "label": pa.array([i % 4 for i in range(300)], pa.int64()),
            "sha256": shas,
        }
    )
    fs = fsspec.filesystem("file")
    write_split_arrow(rows, fs, str(tmp_path / "driver"), partitions=3, seed=42, generation=5)
    write_split(spark.createDataFrame(rows.to_pandas()), str(tmp_path / "spark"), 3, 42, 5)
    by_driver, by_spark = split_files(str(tmp_path / "driver"))[1], split_files(str(tmp_path / "spark"))[1]
    assert pq.read_schema(by_driver[0]).remove_metadata() == pq.read_schema(by_spark[0]).remove_metadata(), (
        "the loader reads both alike"
    )
    firsts = []
    for name in by_driver:
        data = pq.read_table(name)
        positions = data.column("position").to_pylist()
        assert positions == sorted(positions) and all(p >> GENERATION_BITS == 5 for p in positions), (
            "positions rise through a file"
        )
        assert len({int(sha[:8], 16) % 3 for sha in data.column("sha256").to_pylist()}) == 1, (
            "a file holds the rows dealt to it by content hash"
        )
        assert data.column("label").to_pylist() != sorted(data.column("label").to_pylist()), (
            "rows in a seeded order, not by label"
        )
        firsts.append(positions[0])
    assert len(set(firsts)) == len(by_driver) == 3
    assert sorted(pq.read_table(by_driver, columns=["sha256"]).column("sha256").to_pylist()) == sorted(shas)
    assert sum(rows for rows, _ in row_groups(str(tmp_path / "driver"))) == 300


@pytest.mark.both_engines
def test_the_drivers_semi_join_finds_what_sparks_finds(lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    import pyarrow as pa

    from imagelake.tasks.data.table import matching

    source = tmp_path / "src"
    copy_digits(digits_dir, source, per_label=5)
    _, _, written = lake.run(source)
    table = ImageTable.at(lake.spark, lake.table, 24, lake.engine)
    rows = lake.rows(written.version)
    paths, hashes = sorted(rows)[:3], [rows[p] for p in sorted(rows)[5:7]]
    keys = {"path": pa.array([*paths, "file:///nowhere.png"]), "sha256": pa.array([*hashes, "0" * 64])}
    (scanned, jobs) = spark_jobs(lake.spark, lambda: table.rows_matching(keys, ["path", "sha256"], written.version))
    joined = matching(table.images, keys, ["path", "sha256"], table.this_size(), written.version)
    assert jobs == 0 and scanned.num_rows == 5
    assert sorted(scanned.to_pylist(), key=str) == sorted(joined.to_pylist(), key=str)
    other_size = ImageTable.at(lake.spark, lake.table, 16, lake.engine)
    assert other_size.rows_matching(keys, ["path"], written.version).num_rows == 0, (
        "rows of another image size are not matched"
    )


@pytest.mark.both_engines
def test_a_backfill_plan_is_counted_per_date_by_spark_and_sees_stale_dates(
    lake: Lake, digits_dir: Path, tmp_path: Path, settings
) -> None:
    from datetime import date

    from imagelake.flows.backfill import plan_dates

    source = tmp_path / "landing"
    copy_digits(digits_dir, source / "date=2024-03-01", per_label=3)
    copy_digits(digits_dir, source / "date=2024-03-02", per_label=3, skip=3)
    lake.run(source)
    table = ImageTable.at(lake.spark, lake.table, 24, lake.engine, lake.quarantine)
    planning = settings.model_copy(update={"image_size": 24})
    span = (date(2024, 3, 1), date(2024, 3, 4))
    assert [(p["date"], p["status"], p["files"]) for p in plan_dates(table, planning, str(source), *span)] == [
        ("2024-03-01", "done", 12),
        ("2024-03-02", "done", 12),
    ]
    sorted((source / "date=2024-03-01" / "1").glob("*.png"))[0].unlink()
    shutil.copy(next((digits_dir / "7").glob("*.png")), source / "date=2024-03-02" / "2" / "new.png")
    copy_digits(digits_dir, source / "date=2024-03-03", labels=("0", "1"), per_label=2, skip=6)
    plan = plan_dates(table, planning, str(source), *span)
    assert [(p["date"], p["status"], p["files"], p["new_or_changed"], p["gone"]) for p in plan] == [
        ("2024-03-01", "stale", 11, 0, 1),
        ("2024-03-02", "stale", 13, 1, 0),
        ("2024-03-03", "missing", 4, 4, 0),
    ]
    assert plan_dates(table, planning, str(source), date(2024, 3, 2), date(2024, 3, 2)) == [plan[1]], (
        "only the range's dates"
    )


def test_a_cached_split_missing_a_file_is_rebuilt_and_never_trained_on(
    lake: Lake, digits_dir: Path, tmp_path: Path, settings
) -> None:
    import pyarrow.parquet as pq

    from imagelake.tasks.data.cache_files import check_split
    from imagelake.tasks.stages.train import train_model

    source, root = tmp_path / "src", tmp_path / "cache"
    copy_digits(digits_dir, source, per_label=10)
    _, _, v0 = lake.run(source)
    plan, first = cached_version(lake, v0, settings, root)
    for split, uri in first.splits.items():
        check_split(uri, split, first.counts[split])
    lost = split_files(first.splits["train"])[1][0]
    Path(lost.removeprefix("file://")).unlink()
    with pytest.raises(FileNotFoundError, match=r"cached train split .* names .*, which is gone"):
        check_split(first.splits["train"], "train", first.counts["train"])
    with pytest.raises(FileNotFoundError, match=r"cached train split .* names .*, which is gone"):
        train_model(first, settings)  # the training stage checks before it starts Ray or an MLflow run
    # The cache stage does not hand out the damaged version: it writes it again, whole.
    again = cache_splits(lake.spark, plan, 24, str(root))
    assert not again.reused and split_keys(again) == {
        split: sorted(keys) for split, keys in by_split(lake, v0.version).items()
    }
    for split, uri in again.splits.items():
        check_split(uri, split, again.counts[split])
    # A part file cut short (every file there, a row missing): refused too, naming the counts.
    short = Path(split_files(again.splits["train"])[1][0].removeprefix("file://"))
    pq.write_table(pq.read_table(short).slice(1), short)
    with pytest.raises(
        ValueError,
        match=(
            rf"cached train split .* holds {again.counts['train'] - 1} rows where its table version has "
            rf"{again.counts['train']}"
        ),
    ):
        train_model(again, settings)
    assert cache_splits(lake.spark, plan, 24, str(root)).reused is False, "the cache stage writes it again"
