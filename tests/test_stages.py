"""The data stages on real Spark and real Delta tables: incremental, idempotent, dated, bad-input-proof."""

from __future__ import annotations

import hashlib
import io
import shutil
from datetime import date
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps

from imagelake.infra.delta import Table, read_version
from imagelake.infra.settings import load_settings
from imagelake.tasks.data.cache_files import split_files
from imagelake.tasks.data.changes import ingest_listing
from imagelake.tasks.data.listing import source_uri
from imagelake.tasks.data.resize_executor import DecodeRules, files_done
from imagelake.tasks.data.table import ImageTable, split_column
from imagelake.tasks.rules.bad_files import TooManyBadFiles
from imagelake.tasks.rules.listed_files import Scope, SourceError
from imagelake.tasks.rules.splits import split_of
from imagelake.tasks.stages.cache import cache_splits
from imagelake.tasks.stages.resize import resize_images
from imagelake.tasks.stages.split import plan_splits
from imagelake.tasks.worker.loader import ShardBatches, shard_rows
from tests.lake import RULES, SCOPE, Lake, copy_digits


def jpeg(size=(40, 30), colour=(200, 30, 30), mode="RGB", **params) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, "JPEG", **params)
    return out.getvalue()


@pytest.mark.both_engines
def test_second_run_adds_nothing_and_five_percent_new_files_decode_only_those(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source)
    ingested, resized, written = lake.run(source)
    assert (ingested.listed, ingested.candidates, resized.decoded, written.rows, written.version) == (40, 40, 40, 40, 0)
    one = sorted((source / "2").glob("*.png"))[0]
    assert lake.rows()["file://" + str(one)] == hashlib.sha256(one.read_bytes()).hexdigest()

    ingested, resized, written = lake.run(source)
    assert (ingested.unchanged, ingested.candidates, resized.decoded, written.rows, written.version) == (40, 0, 0, 0, 0)

    for png in sorted((digits_dir / "5").glob("*.png"))[:2]:  # 5% new
        shutil.copy(png, source / "3" / ("new-" + png.name))
    ingested, resized, written = lake.run(source)
    assert (ingested.candidates, resized.decoded, written.rows, written.version) == (2, 2, 2, 1)
    assert len(lake.rows()) == 42


@pytest.mark.both_engines
def test_a_changed_file_replaces_its_row_and_deleted_files_retire_on_request(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source)
    lake.run(source)
    changed = sorted((source / "1").glob("*.png"))[0]
    old_hash = lake.rows()["file://" + str(changed)]
    Image.open(changed).rotate(90).save(changed)
    gone = sorted((source / "0").glob("*.png"))[0]
    gone.unlink()

    _, _, written = lake.run(source)  # deletions are kept unless asked
    rows = lake.rows()
    assert (written.rows, written.retired, len(rows)) == (1, 0, 40)
    assert rows["file://" + str(changed)] != old_hash
    assert lake.rows(version=0)["file://" + str(changed)] == old_hash, "time travel still sees the old bytes"

    _, _, written = lake.run(source, retire=True)
    assert (written.retired, len(lake.rows())) == (1, 39)
    assert "file://" + str(gone) not in lake.rows()


@pytest.mark.both_engines
def test_date_partitions_limit_a_run_and_rerunning_a_date_replaces_exactly_it(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source / "date=2024-01-01", labels=("0", "1"), per_label=5)
    copy_digits(digits_dir, source / "date=2024-01-02", labels=("2", "3"), per_label=5)
    first = Scope(SCOPE.extensions, start=date(2024, 1, 1), end=date(2024, 1, 1))
    second = Scope(SCOPE.extensions, start=date(2024, 1, 2), end=date(2024, 1, 2))
    lake.run(source, scope=first)
    assert len(lake.rows()) == 10
    lake.run(source, scope=second)
    dates = lake.read(lake.table, ["date", "label"])
    assert sorted(set(zip(dates["date"], dates["label"], strict=True))) == [
        (date(2024, 1, 1), "0"),
        (date(2024, 1, 1), "1"),
        (date(2024, 1, 2), "2"),
        (date(2024, 1, 2), "3"),
    ]
    # Re-running 2024-01-02 after a file of that date went away replaces that date only.
    sorted((source / "date=2024-01-02" / "2").glob("*.png"))[0].unlink()
    _, _, written = lake.run(source, scope=second)
    assert written.retired == 1 and len(lake.rows()) == 19
    dates = lake.read(lake.table, ["date"])["date"]
    assert dates.count(date(2024, 1, 1)) == 10 and dates.count(date(2024, 1, 2)) == 9


def test_a_manifest_csv_lists_files_labels_and_dates(lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    copy_digits(digits_dir, tmp_path / "files", labels=("7", "8"), per_label=3)
    files = sorted((tmp_path / "files").rglob("*.png"))
    # Paths relative to the manifest, absolute ones and file:// URIs, all under the manifest's folder.
    spelled = [(f.relative_to(tmp_path), f, f"file://{f}")[i % 3] for i, f in enumerate(files)]
    lines = ["path,label,date"] + [
        f"{s},{f.parent.name},2024-02-0{i % 2 + 1}" for i, (s, f) in enumerate(zip(spelled, files, strict=True))
    ]
    (tmp_path / "list.csv").write_text("\n".join(lines) + "\n")
    lake.run(tmp_path / "list.csv")
    data = lake.read(lake.table, ["label", "date"])
    assert sorted(data["label"]) == ["7", "7", "7", "8", "8", "8"]
    assert set(data["date"]) == {date(2024, 2, 1), date(2024, 2, 2)}


def test_a_manifest_row_that_leaves_its_folder_by_a_link_is_quarantined_as_a_folder_source_s_would_be(
    tmp_path: Path,
) -> None:
    """A manifest's rows are checked on their real paths too: a file, or a folder on the way, that links outside the
    manifest's folder and manifest_roots is quarantined (symlink_outside_source), never read; a link into a root is
    fine."""
    from imagelake.tasks.data.listing import list_manifest
    from imagelake.tasks.rules.listed_files import Scope

    base, outside, extra = tmp_path / "base", tmp_path / "outside", tmp_path / "extra"
    for folder in (base, outside / "more", extra):
        folder.mkdir(parents=True)
    for target in (base / "inside.png", outside / "secret.png", outside / "more" / "x.png", extra / "ok.png"):
        target.write_bytes(b"png")
    (base / "link.png").symlink_to(outside / "secret.png")
    (base / "linked").symlink_to(outside / "more")
    (base / "allowed.png").symlink_to(extra / "ok.png")
    (base / "m.csv").write_text("path,label\ninside.png,a\nlink.png,a\nlinked/x.png,b\nallowed.png,b\n")
    entries = list_manifest(f"file://{base / 'm.csv'}", Scope(extensions=(".png",), manifest_roots=(str(extra),)))
    assert {entry["path"].rsplit("/", 1)[-1]: entry["issue"] for entry in entries} == {
        "inside.png": None,
        "link.png": "symlink_outside_source",
        "x.png": "symlink_outside_source",
        "allowed.png": None,
    }


@pytest.mark.parametrize("spelling", ["absolute", "dotdot", "url"])
def test_a_manifest_row_outside_its_folder_is_refused_naming_the_line(
    lake: Lake, digits_dir: Path, tmp_path: Path, spelling: str
) -> None:
    from imagelake.tasks.data.listing import list_source
    from imagelake.tasks.rules.listed_files import Scope, SourceError

    inside, outside = tmp_path / "landing", tmp_path / "elsewhere"
    copy_digits(digits_dir, inside, labels=("1",), per_label=2)
    copy_digits(digits_dir, outside, labels=("2",), per_label=1)
    stray = next((outside / "2").glob("*.png"))
    named = {"absolute": str(stray), "dotdot": f"../elsewhere/2/{stray.name}", "url": f"file://{stray}"}[spelling]
    ok = sorted((inside / "1").glob("*.png"))
    (inside / "list.csv").write_text(f"path,label\n1/{ok[0].name},1\n{named},2\n1/{ok[1].name},1\n")
    with pytest.raises(
        SourceError, match=r"list.csv line 3: .* is outside the manifest's folder .*landing; .*manifest_roots"
    ):
        list_source(f"file://{inside / 'list.csv'}", Scope((".png",)))
    with pytest.raises(SourceError, match="line 3"):  # a run stops before it reads anything
        lake.run(inside / "list.csv")
    assert not Path(lake.table).exists()
    # A folder named in manifest_roots may be pointed at.
    listed = list_source(f"file://{inside / 'list.csv'}", Scope((".png",), manifest_roots=(str(outside),)))
    assert [Path(e["path"]).name for e in listed] == [ok[0].name, stray.name, ok[1].name]


def test_bad_files_are_quarantined_by_reason_and_odd_names_still_land(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=20)
    good = sorted((digits_dir / "4").glob("*.png"))
    for folder, name, png in [
        ("_under", "a.png", good[0]),
        ("with=equals", "b.png", good[1]),
        ("space é #1 %20", "c #%.png", good[2]),
    ]:
        (source / folder).mkdir()
        shutil.copy(png, source / folder / name)
    bad = source / "bad"
    bad.mkdir()
    (bad / "zero.jpg").write_bytes(b"")
    (bad / "text.png").write_text("not an image")
    (bad / "truncated.jpg").write_bytes(jpeg((300, 200))[:700])
    (bad / "bomb.jpg").write_bytes(jpeg((400, 400)))
    (bad / "huge.jpg").write_bytes(jpeg((30, 30)) + b"\0" * 5000)
    (bad / "dangling.jpg").symlink_to(bad / "missing.jpg")
    outside = tmp_path / "outside.png"
    shutil.copy(good[3], outside)
    (bad / "escape.png").symlink_to(outside)
    (source / ".hidden").mkdir()
    shutil.copy(good[4], source / ".hidden" / "h.png")

    rules = DecodeRules(size=24, mode="letterbox", max_file_bytes=4000, max_pixels=100_000)
    _, resized, written = lake.run(source, rules=rules, max_bad=0.5)
    assert lake.quarantined() == {
        "zero.jpg": "empty_file",
        "text.png": "not_an_image",
        "truncated.jpg": "truncated",
        "bomb.jpg": "decompression_bomb",
        "huge.jpg": "file_too_large",
        "dangling.jpg": "unreadable",
        "escape.png": "symlink_outside_source",
        "h.png": "hidden_path",
    }
    assert sum(resized.quarantined.values()) == written.quarantined == 8
    labels = lake.read(lake.table, ["label"])["label"]
    assert labels.count("_under") == labels.count("with=equals") == labels.count("space é #1 %20") == 1
    assert len(labels) == 43

    _, resized, written = lake.run(source, rules=rules, max_bad=0.5)
    assert (resized.decoded, written.quarantined, written.rows) == (0, 0, 0), "unchanged bad files are not read again"


def test_too_many_bad_files_fail_the_run_and_write_nothing(lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0",), per_label=4)
    for i in range(2):
        (source / "0" / f"junk{i}.png").write_text("junk")
    with pytest.raises(TooManyBadFiles, match=r"2 of 6 files are bad .*not_an_image: 2.*max_bad_fraction=0.2"):
        lake.run(source, max_bad=0.2)
    assert not Path(lake.table).exists() and not Path(lake.quarantine).exists()


@pytest.mark.parametrize("make_source", ["missing", "empty"])
def test_bad_sources_are_named(lake: Lake, tmp_path: Path, make_source: str) -> None:
    folder = tmp_path / "images"
    if make_source == "empty":
        folder.mkdir()
        with pytest.raises(SourceError, match="no image files"):
            lake.run(folder)
    else:
        with pytest.raises(SourceError, match="images"):
            source_uri(str(folder))


def test_spark_split_matches_the_pure_rule(spark) -> None:
    hashes = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(300)]
    frame = spark.createDataFrame([(h,) for h in hashes], "sha256 string").withColumn("split", split_column(0.1, 0.2))
    assert {row["sha256"]: row["split"] for row in frame.collect()} == {h: split_of(h, 0.1, 0.2) for h in hashes}


@pytest.mark.both_engines
def test_cache_is_keyed_reused_and_readable_by_shard(
    spark, lake: Lake, digits_dir: Path, tmp_path: Path, settings
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source)
    rules = DecodeRules(size=32, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000)
    _, _, written = lake.run(source, rules=rules)
    plan = plan_splits(spark, written, settings.model_copy(update={"val_fraction": 0.2, "test_fraction": 0.2}))
    assert sum(plan.counts.values()) == 40 and plan.num_partitions == 4

    cached = cache_splits(spark, plan, 32, str(tmp_path / "cache"))
    assert not cached.reused and cached.key.startswith(cached.cache_dir.rsplit("/", 1)[-1])
    assert cache_splits(spark, plan, 32, str(tmp_path / "cache")).reused
    keys = pq.read_table(split_files(cached.splits["train"])[1], columns=["sha256"]).column("sha256").to_pylist()
    per_shard = shard_rows(cached.splits["train"], 2)
    assert sum(per_shard) == len(keys) == plan.counts["train"]
    orders = []
    for epoch in range(2):
        seen: list[str] = []
        steps = []
        for shard in range(2):
            loader = ShardBatches(
                cached.splits["train"],
                shard=shard,
                shard_count=2,
                batch_size=4,
                image_size=32,
                seed=1,
                shuffle=True,
                workers=1,
                key_field="sha256",
            )
            loader.epoch = epoch
            with loader:
                batches = list(loader)
            steps.append(len(batches))
            for images, labels, batch_keys in batches:
                assert images.shape[1:] == (32, 32, 3) and str(images.dtype) == "torch.uint8" and len(labels) <= 4
                assert str(labels.dtype) == "torch.int64" and int(labels.max()) < len(plan.labels)
                seen.extend(batch_keys)
        # Every worker takes the same steps, and together they see every sample exactly once per epoch.
        assert steps[0] == steps[1] == len(loader)
        assert sorted(seen) == sorted(keys)
        orders.append(seen)
    assert orders[0] != orders[1], "each epoch shuffles anew"
    with ShardBatches(
        cached.splits["train"], shard=0, shard_count=2, batch_size=4, image_size=32, seed=1, shuffle=True, workers=1
    ) as loader:
        first = [len(labels) for _, labels in loader]
        assert [len(labels) for _, labels in loader] == first, "a second epoch reads again, from a fresh reader"
    expected = (
        ImageTable.at(spark, written.table_uri, 32, lake.engine)
        .with_split(written.version, 0.2, 0.2)
        .where("split = 'train'")
        .count()
    )
    assert expected == plan.counts["train"]
    assert read_version(spark, written.table_uri, written.version, lake.engine).count() == 40


def test_the_driver_decodes_a_short_list_as_the_executors_do(
    spark, lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    copy_digits(digits_dir, tmp_path / "src", labels=("0", "1"), per_label=6)
    (tmp_path / "src" / "1" / "broken.png").write_bytes(b"not an image")
    table = ImageTable.at(spark, lake.table, RULES.size, lake.engine, lake.quarantine)
    ingested = ingest_listing(table, source_uri(str(tmp_path / "src")), SCOPE, False, str(tmp_path / "staging"))
    context, group = spark.sparkContext, "decoded-by-the-driver"
    context.setJobGroup(group, "counted by a test")
    try:
        by_driver = resize_images(table, ingested, RULES, str(tmp_path / "driver"), in_driver_up_to=100)
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)
    assert context.statusTracker().getJobIdsForGroup(group) == [], "a short list starts no Spark job"
    by_executors = resize_images(table, ingested, RULES, str(tmp_path / "executors"))
    assert (
        (by_driver.decoded, by_driver.quarantined)
        == (by_executors.decoded, by_executors.quarantined)
        == (12, {"not_an_image": 1})
    )

    def staged_and_pixels(resized) -> tuple[list, list]:
        staged = pq.read_table(resized.staging_uri).drop_columns(["data_file"]).sort_by("path").to_pylist()
        files = sorted({f for f in pq.read_table(resized.staging_uri).column("data_file").to_pylist() if f})
        pixels = [
            row
            for f in files
            for row in pq.read_table(f"{lake.table}/{f}", columns=["path", "sha256", "image"]).to_pylist()
        ]
        return staged, sorted(pixels, key=lambda row: row["path"])

    assert staged_and_pixels(by_driver) == staged_and_pixels(by_executors)


def test_executors_report_their_progress_while_they_decode(spark, lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    # Every file reports (interval 0): the progress files the driver sums must be writable from the first one on.
    copy_digits(digits_dir, tmp_path / "src", labels=("0", "1"), per_label=10)
    table = ImageTable.at(spark, lake.table, RULES.size, lake.engine, lake.quarantine)
    ingested = ingest_listing(table, source_uri(str(tmp_path / "src")), SCOPE, False, str(tmp_path / "staging"))
    resized = resize_images(table, ingested, RULES, str(tmp_path / "rs"), progress_seconds=0.0)
    assert resized.decoded == 20 and files_done(str(tmp_path / "rs")) == 20


@pytest.mark.parametrize("in_driver_up_to", [0, 1000], ids=["executors", "driver"])
def test_the_table_records_each_jpegs_own_size_on_either_decode_path(
    lake: Lake, tmp_path: Path, in_driver_up_to: int
) -> None:
    source = tmp_path / "src"
    for label in ("a", "b"):
        (source / label).mkdir(parents=True)
    # Pillow's draft() decodes these at an eighth of their size for a 24-pixel square.
    (source / "a" / "wide.jpg").write_bytes(jpeg((198, 188)))
    (source / "b" / "tall.jpg").write_bytes(jpeg((188, 198), colour=(10, 200, 10)))
    _, resized, _ = lake.run(source, in_driver_up_to=in_driver_up_to)
    assert resized.decoded == 2
    data = lake.read(lake.table, ["path", "width", "height"])
    assert {Path(p).name: (w, h) for p, w, h in zip(data["path"], data["width"], data["height"], strict=True)} == {
        "wide.jpg": (198, 188),
        "tall.jpg": (188, 198),
    }


@pytest.mark.both_engines
def test_one_table_holds_two_image_sizes_each_counted_changed_and_retired_on_its_own(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    small, large = RULES, DecodeRules(size=32, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000)

    def per_size() -> dict[int, int]:
        sizes = lake.read(lake.table, ["image_size"])["image_size"]
        return {size: sizes.count(size) for size in sorted(set(sizes))}

    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=5)
    lake.run(source, rules=small)
    _, resized, written = lake.run(source, rules=large)  # the same files at another size: rows of their own
    assert (resized.decoded, written.rows, per_size()) == (10, 10, {24: 10, 32: 10})
    data = lake.read(lake.table, ["image_size", "image"])
    assert {(size, len(image)) for size, image in zip(data["image_size"], data["image"], strict=True)} == {
        (24, 24 * 24 * 3),
        (32, 32 * 32 * 3),
    }

    copy_digits(digits_dir, source, labels=("2",), per_label=3)  # new files, run at one size only
    (sorted((source / "0").glob("*.png"))[0]).unlink()
    _, _, written = lake.run(source, rules=small, retire=True)
    assert (written.rows, written.retired, per_size()) == (3, 1, {24: 12, 32: 10}), (
        "the other size's rows are untouched"
    )
    _, _, written = lake.run(source, rules=large, retire=True)
    assert (written.rows, written.retired, per_size()) == (3, 1, {24: 12, 32: 12})
    for size in (24, 32):
        table = ImageTable.at(lake.spark, lake.table, size, lake.engine, lake.quarantine)
        assert table.with_split(Table(lake.table).version(), 0.2, 0.2).count() == 12, (
            f"the split stage's rows of size {size}"
        )


def test_a_folder_that_cannot_be_listed_stops_the_run_and_retires_nothing(
    lake: Lake, digits_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from imagelake.tasks.data.listing import ListingIncomplete, list_source
    from tests.lake import LostMount

    source = tmp_path / "src"
    copy_digits(digits_dir, source / "date=2024-03-01", labels=("1", "2"), per_label=4)
    copy_digits(digits_dir, source / "date=2024-03-02", labels=("1", "2"), per_label=4, skip=4)
    monkeypatch.setattr(LostMount, "lost", "date=2024-03-01/2")
    with pytest.raises(
        ListingIncomplete, match=r"could not list lostmount://.*date=2024-03-01/2 \(PermissionError.*retires anything"
    ):
        list(list_source(f"lostmount://{source}", Scope((".png",))))
    assert isinstance(ListingIncomplete("x"), OSError), "the stage retries it: a mount may come back"

    # A table that holds both dates; then label 2 of the first date cannot be listed. A dated run that retires what is
    # not listed, and a run over every date, both stop naming the folder: no version, no row retired.
    monkeypatch.setattr(LostMount, "lost", None)
    lake.run(f"lostmount://{source}", retire=True, in_driver_up_to=100)
    before, rows = Table(lake.table).version(), lake.rows()
    assert len(rows) == 16
    monkeypatch.setattr(LostMount, "lost", "date=2024-03-01/2")
    day = Scope((".png",), start=date(2024, 3, 1), end=date(2024, 3, 1))
    for scope in (day, Scope((".png",))):
        with pytest.raises(ListingIncomplete, match=r"date=2024-03-01/2 \(PermissionError"):
            lake.run(f"lostmount://{source}", scope=scope, retire=True, in_driver_up_to=100)
        assert Table(lake.table).version() == before and lake.rows() == rows
    monkeypatch.setattr(LostMount, "lost", None)  # the mount is back: nothing to do
    _, _, written = lake.run(f"lostmount://{source}", scope=day, retire=True, in_driver_up_to=100)
    assert (written.rows, written.retired) == (0, 0) and lake.rows() == rows


def test_a_run_that_would_retire_most_of_a_dates_rows_is_refused(lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    from imagelake.tasks.rules.bad_files import TooManyRetired
    from imagelake.tasks.rules.listed_files import Scope

    source = tmp_path / "src"
    copy_digits(digits_dir, source / "date=2024-03-01", labels=("1", "2"), per_label=5)
    copy_digits(digits_dir, source / "date=2024-03-02", labels=("1", "2"), per_label=5, skip=5)
    day = Scope((".png",), start=date(2024, 3, 1), end=date(2024, 3, 1))
    lake.run(source)
    before = Table(lake.table).version()
    shutil.rmtree(source / "date=2024-03-01" / "2")  # 5 of the date's 10 rows: allowed at 0.5
    for png in sorted((source / "date=2024-03-01" / "1").glob("*.png"))[:2]:
        png.unlink()  # and 2 more: 7 of 10
    with pytest.raises(
        TooManyRetired, match=r"retire 7 of 10 rows of 2024-03-01 .* over max_retire_fraction=0.5; nothing was written"
    ):
        lake.run(source, scope=day, max_retire=0.5)
    assert Table(lake.table).version() == before and len(lake.rows()) == 20
    _, _, written = lake.run(source, scope=day, max_retire=1.0)  # they are really gone: the setting lets it through
    assert written.retired == 7 and len(lake.rows()) == 13


def test_a_dated_or_retiring_run_retires_only_rows_under_its_own_folder(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    """Two folder sources land rows of the same date in one table. A dated run of one, and a run of it that retires
    deleted files, retire what that source lost and never the other's rows, which its listing cannot see. The folder
    `ab` begins with `a`'s name: a source owns the paths below its folder, not those that share its name's start.
    The retire limit is off, so that it is not what keeps the rows."""
    day = Scope((".png",), start=date(2024, 3, 1), end=date(2024, 3, 1))
    first, second = tmp_path / "a", tmp_path / "ab"
    copy_digits(digits_dir, first / "date=2024-03-01", labels=("1",), per_label=3)
    copy_digits(digits_dir, second / "date=2024-03-01", labels=("2",), per_label=3)
    lake.run(first, scope=day)
    lake.run(second, scope=day)
    theirs = {p for p in lake.rows() if p.startswith(f"file://{second}/")}
    assert len(theirs) == 3 and len(lake.rows()) == 6

    lost = sorted((first / "date=2024-03-01" / "1").glob("*.png"))
    lost[0].unlink()
    _, _, written = lake.run(first, scope=day, max_retire=1.0)
    assert written.retired == 1 and theirs < set(lake.rows()) and len(lake.rows()) == 5
    lost[1].unlink()
    _, _, written = lake.run(first, retire=True, max_retire=1.0)
    assert written.retired == 1 and theirs < set(lake.rows()) and len(lake.rows()) == 4


def test_a_manifest_retires_only_paths_that_its_own_listings_named(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    """Two manifests in one folder name files of the same date. A dated run of one retires the row of a line it
    dropped, never the other's rows, though they lie in its folder too. A manifest whose record of the paths it named
    is gone (another staging folder, say) cannot prove a row its own: it retires nothing."""
    day = Scope((".png",), start=date(2024, 3, 1), end=date(2024, 3, 1))
    landing = tmp_path / "landing"
    copy_digits(digits_dir, landing, labels=("1", "2"), per_label=2)

    def manifest(name: str, files: list[Path]) -> Path:
        (landing / name).write_text(
            "path,label,date\n" + "".join(f"{f.parent.name}/{f.name},{f.parent.name},2024-03-01\n" for f in files)
        )
        return landing / name

    ones, twos = sorted((landing / "1").glob("*.png")), sorted((landing / "2").glob("*.png"))
    lake.run(manifest("a.csv", ones), scope=day)
    lake.run(manifest("b.csv", twos), scope=day)
    assert len(lake.rows()) == 4
    _, _, written = lake.run(manifest("a.csv", ones[:1]), scope=day, retire=True, max_retire=1.0)
    assert written.retired == 1 and sorted(Path(p).name for p in lake.rows()) == sorted(
        f.name for f in [ones[0], *twos]
    )

    shutil.rmtree(tmp_path / "staging")
    _, _, written = lake.run(manifest("b.csv", twos[:1]), scope=day, retire=True, max_retire=1.0)
    assert written.retired == 0 and len(lake.rows()) == 3


def test_a_read_that_fails_is_retried_and_never_quarantined(lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class Hiccups(LocalFileSystem):
        """The local file system, but reads of chosen files time out a given number of times (an NFS hiccup, a store's
        timeout)."""

        protocol = ("hiccups",)
        root_marker = "/"
        failures: dict[str, int] = {}

        def _open(self, path, mode="rb", **kwargs):
            name = str(path).rsplit("/", 1)[-1]
            if "r" in mode and self.failures.get(name, 0) > 0:
                self.failures[name] -= 1
                raise TimeoutError(110, "Connection timed out", str(path))
            return super()._open(path, mode, **kwargs)

    fsspec.register_implementation("hiccups", Hiccups, clobber=True)
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=10)
    names = sorted(p.name for p in (source / "1").glob("*.png"))
    Hiccups.failures.update(
        {names[0]: 2, names[1]: 50, names[2]: 50}
    )  # one recovers on its third read, two never do in this run
    rules = DecodeRules(
        size=24, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000, read_attempts=3, read_backoff=0.01
    )
    _, resized, written = lake.run(f"hiccups://{source}", rules=rules, in_driver_up_to=1000)
    assert resized.quarantined == {} and written.quarantined == 0, (
        "a read error is not the file's content: nothing quarantined"
    )
    assert resized.unread == {"read_error": 2} and resized.read_retries == 2 + 3 + 3 and written.unread == 2
    assert len(lake.rows()) == 18 and not Table(lake.quarantine).exists()

    Hiccups.failures.clear()  # the store is back: the next run reads the two files, and only them
    _, resized, written = lake.run(f"hiccups://{source}", rules=rules, in_driver_up_to=1000)
    assert (resized.decoded, resized.unread, written.rows) == (2, {}, 2)
    assert sorted(Path(p).name for p in lake.rows()) == sorted(p.name for p in source.rglob("*.png")), (
        "every image once"
    )

    _, resized, written = lake.run(f"hiccups://{source}", rules=rules, in_driver_up_to=1000)
    assert (resized.decoded, written.rows) == (0, 0), "in step again: nothing read twice"


@pytest.mark.both_engines
def test_requeue_sends_quarantined_files_back_through(lake: Lake, digits_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from imagelake.flows.cli import app
    from imagelake.tasks.stages.write import requeue_by_setting

    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=5)
    (source / "1" / "large.jpg").write_bytes(jpeg((600, 400)))
    (source / "1" / "truncated.jpg").write_bytes(jpeg((300, 200))[:700])
    small, large = Scope((".png", ".jpg"), max_file_bytes=3000), Scope((".png", ".jpg"))
    lake.run(source, scope=small)
    assert lake.quarantined() == {"large.jpg": "file_too_large", "truncated.jpg": "truncated"}
    _, resized, _ = lake.run(source, scope=large)
    assert resized.decoded == 0, "a quarantined file that did not change is not read again, even under a larger limit"

    cli = ["--set", f"table_root={lake.root}/tables", "--set", "image_size=24", "--set", f"workspace={tmp_path / 'ws'}"]
    refused = CliRunner().invoke(app, ["requeue", "--reason", "unreadable", *cli])
    assert (
        refused.exit_code == 2
        and "no file in the quarantine table" in refused.output
        and "file_too_large (1), truncated (1)" in refused.output
    )
    done = CliRunner().invoke(app, ["requeue", "--reason", "file_too_large", *cli])
    assert done.exit_code == 0, done.output
    assert "requeued 1 file(s) (file_too_large: 1)" in done.output
    assert lake.quarantined() == {"truncated.jpg": "truncated"}

    _, resized, written = lake.run(source, scope=large)
    assert (resized.decoded, written.rows) == (1, 1) and "large.jpg" in {Path(p).name for p in lake.rows()}

    settings = load_settings(
        overrides={
            "table_root": f"{lake.root}/tables",
            "image_size": 24,
            "workspace": str(tmp_path / "ws"),
            "requeue_reasons": ["truncated"],
        }
    )
    assert requeue_by_setting.fn(settings) == {"truncated": 1}
    _, resized, _ = lake.run(source, scope=large)
    assert resized.quarantined == {"truncated": 1} and lake.quarantined() == {"truncated.jpg": "truncated"}, (
        "still bad: quarantined again"
    )
    assert len(lake.read(lake.quarantine, ["path"])["path"]) == 2, (
        "in place of its requeued row: the table does not grow each time"
    )
    assert CliRunner().invoke(app, ["requeue", *cli]).output.startswith("requeued 1 file(s) (truncated: 1)")


@pytest.mark.both_engines
@pytest.mark.parametrize("retire", [False, True])
def test_a_moved_file_and_a_renamed_label_folder_relabel_their_rows(
    lake: Lake, digits_dir: Path, tmp_path: Path, retire: bool
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("cat", "dog"), per_label=0)
    copy_digits(digits_dir, tmp_path / "digits", labels=("0", "1"), per_label=6)
    for label, digit in (("cat", "0"), ("dog", "1")):
        for png in (tmp_path / "digits" / digit).glob("*.png"):
            shutil.copy(png, source / label / png.name)
    lake.run(source, retire=retire)
    labels = lambda: {Path(p).name: Path(p).parent.name for p in lake.rows()}  # noqa: E731
    before, version = labels(), Table(lake.table).version()

    moved = sorted((source / "cat").glob("*.png"))[0]
    moved.rename(source / "dog" / moved.name)
    _, _, written = lake.run(source, retire=retire)
    assert labels() == {**before, moved.name: "dog"} and written.version == version + 1, (
        "the row follows the file, in one commit"
    )
    by_path = lake.read(lake.table, ["path", "label"])
    assert dict(zip(by_path["path"], by_path["label"], strict=True))[f"file://{source}/dog/{moved.name}"] == "dog"

    (source / "cat").rename(source / "feline")
    _, _, written = lake.run(source, retire=retire)
    assert written.version == version + 2 and (written.rows, written.retired) == (5, 5)
    assert labels() == {
        name: ("feline" if label == "cat" else label) for name, label in {**before, moved.name: "dog"}.items()
    }
    assert len(lake.rows()) == 12 and len(set(lake.rows().values())) == 12, "every image once"

    shutil.copy(
        source / "dog" / moved.name, source / "feline" / "copy.png"
    )  # a copy: the old path still holds the content
    _, _, written = lake.run(source, retire=retire)
    assert written.rows == 0 and len(lake.rows()) == 12

    # Renaming the folder of most of the rows moves them: nothing is retired, so the retire limit does not refuse it.
    (source / "dog").rename(source / "canine")
    _, _, written = lake.run(source, retire=retire, max_retire=0.5)
    assert (written.rows, written.retired) == (7, 7) and len(lake.rows()) == 12
    assert set(labels().values()) == {"feline", "canine"}


def test_two_identical_runs_at_once_keep_their_own_staging_and_a_short_one_writes_nothing(
    spark, digits_dir: Path, tmp_path: Path
) -> None:
    from deltalake import DeltaTable

    from imagelake.tasks.stages.ingest import ingest
    from imagelake.tasks.stages.resize import resize
    from imagelake.tasks.stages.write import StagingIncomplete, write

    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=4)
    settings = load_settings(
        overrides={"workspace": str(tmp_path / "ws"), "image_size": 16, "decode_in_driver_up_to": 100}
    )
    listed = ingest.fn(str(source), settings)
    first = resize.fn(listed, settings)
    second = resize.fn(listed, settings)  # the same files and settings, started before the first run writes
    assert first.staging_uri != second.staging_uri and first.decoded == second.decoded == 8
    assert write.fn(first, settings).rows == 8, "the second run's start left the first run's staged rows alone"
    assert (
        write.fn(second, settings).rows == 0 and DeltaTable(settings.table_uri).to_pyarrow_dataset().count_rows() == 8
    )

    # Staged rows that went missing (a cleanup while the run went on): the write refuses, commits nothing and does
    # not mark the tables in step with the listing, so the next run decodes the files again and lands them.
    (source / "2").mkdir()
    ImageOps.mirror(Image.open(next((source / "1").glob("*.png")))).save(source / "2" / "mirrored.png")  # new content
    listed = ingest.fn(str(source), settings)
    short = resize.fn(listed, settings)
    shutil.rmtree(short.staging_uri)
    version = Table(settings.table_uri).version()
    with pytest.raises(StagingIncomplete, match=r"holds 0 row\(s\) but resize accounted for 1 file"):
        write.fn(short, settings)
    assert Table(settings.table_uri).version() == version
    again = resize.fn(ingest.fn(str(source), settings), settings)
    assert again.decoded == 1 and write.fn(again, settings).rows == 1


def test_each_image_size_of_a_table_keeps_the_resize_mode_it_was_decoded_in(tmp_path: Path) -> None:
    """The first run at a size records its resize mode beside the table; a run at that size in another mode is refused
    naming both and what to do, while another size may take its own mode."""
    from imagelake.tasks.data.table import ResizeModeChanged, hold_resize_mode

    table = f"file://{tmp_path / 'images'}"
    hold_resize_mode(table, 64, "letterbox")
    hold_resize_mode(table, 64, "letterbox")
    with pytest.raises(ResizeModeChanged, match=r"64 px images cut by resize_mode=letterbox; resize_mode=center_crop"):
        hold_resize_mode(table, 64, "center_crop")
    hold_resize_mode(table, 128, "center_crop")
    with pytest.raises(ResizeModeChanged, match="resize_mode=center_crop; resize_mode=letterbox"):
        hold_resize_mode(table, 128, "letterbox")
