"""A merge through Spark's Delta (a run that also retires, replaces or moves rows) keeps the new rows' pixels out of
the driver: its source is a DataFrame that Spark's executors read from the run's data files. (delta-rs is handed the
same rows as a stream, but gathers a merge's source in memory itself: docs/data.md has the figures.)"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from tasks.changes import ingest_listing
from tasks.listing import source_uri
from tasks.resize_executor import DecodeRules
from tasks.stages.resize import resize_images
from tasks.table import ImageTable
from tests.conftest import REPO
from tests.lake import SCOPE, Lake, copy_digits

SIDE, NEW = 64, 480  # 480 new images of 64 x 64 x 3 bytes: 5.9 MB of pixels
RULES = DecodeRules(size=SIDE, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000)

# The write alone, in a fresh process, so that Arrow's peak (the default memory pool's, which no call resets) is the
# write's: every Arrow buffer the driver allocates to read or hand on the new rows is counted there.
WRITER = r"""
import json, os, sys
import pyarrow as pa
from infra.settings import Settings
from infra.spark import on_demand
from tasks.results import Resized
from tasks.table import ImageTable
from tasks.stages.write import write_images
args = json.loads(sys.argv[1])
resized = Resized.model_validate(args["resized"])
spark = on_demand(Settings(workspace=args["workspace"], spark_master="local[1]"))
table = ImageTable.at(spark, args["table"], resized.image_size, args["engine"], args["quarantine"])
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


def test_a_spark_merge_reads_the_new_rows_pixels_on_the_executors_never_in_the_driver(
    spark, digits_dir: Path, tmp_path: Path
) -> None:
    engine, lake = "spark", Lake(spark, tmp_path, "spark")
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
    args = {
        "resized": resized.model_dump(),
        "engine": engine,
        "table": lake.table,
        "quarantine": lake.quarantine,
        "workspace": str(tmp_path / "ws"),
    }
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

    # The driver's Arrow memory stayed far below the new pixels: it never read them (a read of the run's data files
    # into one table, and its copy for Spark, took twice their size).
    pixels = NEW * SIDE * SIDE * 3
    assert result["arrow_peak"] < pixels / 3, (
        f"the {engine} merge's driver held {result['arrow_peak'] / 1e6:.1f} MB of Arrow memory at its peak, for "
        f"{pixels / 1e6:.1f} MB of new pixels: it gathered the new rows in the driver"
    )
