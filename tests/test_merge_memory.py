"""A merge through Spark's Delta (a run that also retires, replaces or moves rows) keeps the new rows' pixels out of
the driver: its source is a DataFrame that Spark's executors read from the run's data files. (delta-rs is handed the
same rows as a stream, but gathers a merge's source in memory itself: docs/data.md has the figures.) So with
delta_writer=auto on an embedded Spark, where delta-rs is the engine, a merge of more new rows than
spark_merge_min_rows goes through Spark's Delta, into the table delta-rs wrote."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image

from imagelake.infra.compat import delta_log_commits
from imagelake.infra.delta import FileRows, Table, spark_merge_bound
from imagelake.infra.settings import Settings
from imagelake.tasks.data.changes import ingest_listing
from imagelake.tasks.data.listing import source_uri
from imagelake.tasks.data.resize_executor import DecodeRules
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.stages.resize import resize_images
from tests.conftest import REPO
from tests.lake import SCOPE, Lake, copy_digits

SIDE, NEW = 64, 480  # 480 new images of 64 x 64 x 3 bytes: 5.9 MB of pixels
RULES = DecodeRules(size=SIDE, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000)

# The write alone, in a fresh process, so that Arrow's peak (the default memory pool's, which no call resets) is the
# write's: every Arrow buffer the driver allocates to read or hand on the new rows is counted there.
WRITER = r"""
import json, os, sys
import pyarrow as pa
from imagelake.infra.settings import Settings
from imagelake.tasks.results import Resized
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.stages.write import write_images
args = json.loads(sys.argv[1])
resized = Resized.model_validate(args["resized"])
settings = Settings(spark_master="local[1]", image_size=resized.image_size, **args["settings"])
table = ImageTable.of(settings)
written = write_images(table, resized, 1.0)
peak = pa.default_memory_pool().max_memory()
print(json.dumps({"rows": written.rows, "retired": written.retired, "arrow_peak": peak}), flush=True)
sys.stderr.flush()
os._exit(0)  # no teardown: Arrow's thread pool can abort it, which says nothing about the write
"""


def noise_pngs(folder: Path, count: int) -> None:
    """COUNT PNGs of random pixels (each content its own), SIDE px square."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    for n in range(count):
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(folder / f"noise-{n:04d}.png")


def test_a_large_merge_goes_through_spark_whose_executors_read_the_new_rows_pixels_never_the_driver(
    spark, digits_dir: Path, tmp_path: Path
) -> None:
    # auto on an embedded Spark is delta-rs, which writes the table; a merge of more new rows than the bound goes
    # through Spark's Delta (the same merge as delta_writer=spark's), into the table delta-rs wrote.
    engine, merged_by = "delta-rs", "spark"
    writer = {"delta_writer": "auto", "spark_merge_min_rows": NEW - 1}
    lake = Lake(spark, tmp_path, engine)
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=3)
    lake.run(source, rules=RULES)  # an append: the table holds 6 rows
    gone = sorted((source / "0").glob("*.png"))[0]
    gone.unlink()
    noise_pngs(source / "noise", NEW)
    # The next run adds NEW images and retires one: a merge. Resize here, write in a process of its own.
    table = ImageTable.at(lake.spark, lake.table, RULES.size, engine, lake.quarantine)
    ingested = ingest_listing(table, source_uri(str(source)), SCOPE, True, f"{lake.root}/staging")
    resized = resize_images(table, ingested, RULES, f"{lake.root}/staging/merge")
    assert (resized.decoded, resized.retired) == (NEW, 1)
    settings = {"workspace": str(tmp_path / "ws"), "table_root": f"{lake.root}/tables", **writer}
    args = {"resized": resized.model_dump(), "settings": settings}
    done = subprocess.run(
        [sys.executable, "-c", WRITER, json.dumps(args)], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert done.returncode == 0, f"the writer exited {done.returncode}:\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["rows"], result["retired"]) == (NEW, 1)

    # Every new image landed once, with its pixels; the retired row is gone.
    data = lake.read(lake.table, ["path", "sha256", "image"])
    assert len(data["path"]) == len(set(data["path"])) == 6 - 1 + NEW
    assert "file://" + str(gone) not in data["path"]
    held = dict(zip(data["path"], data["sha256"], strict=True))
    for png in sorted((source / "noise").glob("*.png")):
        assert held["file://" + str(png)] == hashlib.sha256(png.read_bytes()).hexdigest()
    assert {len(image) for image in data["image"]} == {SIDE * SIDE * 3}

    # The merge is the table's latest commit, made by the engine expected ("Apache-Spark/... Delta-Lake/..." or
    # "delta-rs:...").
    engine_info = next(delta_log_commits(lake.table))[1].get("engineInfo", "")
    assert engine_info.split("/")[0].split(":")[0] == {"spark": "Apache-Spark", "delta-rs": "delta-rs"}[merged_by], (
        f"the merge was expected from {merged_by}, but its commit names {engine_info!r}"
    )
    # The driver's Arrow memory stayed far below the new pixels: it never read them (a read of the run's data files
    # into one table, and its copy for Spark, took twice their size).
    pixels = NEW * SIDE * SIDE * 3
    assert result["arrow_peak"] < pixels / 3, (
        f"the {merged_by} merge's driver held {result['arrow_peak'] / 1e6:.1f} MB of Arrow memory at its peak, for "
        f"{pixels / 1e6:.1f} MB of new pixels: it gathered the new rows in the driver"
    )


def test_a_merge_at_or_under_the_bound_or_with_a_named_engine_stays_on_that_engine() -> None:
    """Where the bound leaves a merge to delta-rs, or the settings name the engine, no Spark is asked."""
    rows = pa.table({"path": [f"p{n}" for n in range(NEW)], "data_file": ["f.parquet"] * NEW})
    changes = FileRows(pa.schema([("path", pa.string())]), rows, [], SIDE)
    assert Table("t", None, "delta-rs", NEW)._merge_engine(changes) == "delta-rs"
    assert Table("t", None, "delta-rs", None)._merge_engine(changes) == "delta-rs"
    assert Table("t", None, "spark", None)._merge_engine(changes) == "spark"
    assert spark_merge_bound(Settings(delta_writer="auto")) == 2000
    assert spark_merge_bound(Settings(delta_writer="delta-rs")) is None
    assert spark_merge_bound(Settings(delta_writer="auto", spark_master="spark://h:7077")) is None
