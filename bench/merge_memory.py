"""Driver memory of a write that merges (adds new images and retires one), this code against an earlier checkout,
side by side, with each Delta engine.

    .venv/bin/python bench/merge_memory.py [--images 2500] [--side 224] [--engines delta-rs,spark] [--against DIR]

For each checkout ((a) the one under --against, e.g. a `git worktree add /tmp/merge-old HEAD`, then (b) this tree)
and each engine, in a folder of its own: a table of 10 rows, then what the resize stage leaves for the next run, made
directly (decoding is not what is measured): IMAGES new rows of SIDE x SIDE RGB pixels in uncommitted data files in
the table's folder (2,048 rows a file, row groups of 16, as the executors write them) and the staged bookkeeping rows,
with one row of the table retired. A fresh process with that checkout's code (imported as imagelake through
bench/checkout.py; for Spark's Delta, its Spark session started first) then runs tasks/stages/write.py:write_images, a
merge. It prints the growth of the driver's peak resident memory over the write (the Python process: its peak is reset
through /proc/self/clear_refs where Linux allows, else ru_maxrss), in MB and in bytes per new image; for Spark's Delta
also the JVM's peak, which on an embedded Spark (local[2]) holds the executors too. Then (b) over (a).

The data files take IMAGES x SIDE^2 x 3 bytes of disk (15 GB for 100,000 images at 224 px), the merge's output as
much again, and Spark's Delta materialises the merge's source on its local disk a third time: size IMAGES to the disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import checkout  # bench/checkout.py: a checkout's code under the name imagelake
from figures import add_record_option, keep  # bench/figures.py

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHILD = r"""
import importlib, json, os, resource, sys, time
write = importlib.import_module(sys.argv[1])  # the checkout's, first on PYTHONPATH (bench/checkout.py)
args = json.loads(sys.argv[2])
from imagelake.infra.spark import on_demand, spark_session
# the write's own classes (a checkout from before the rename imports them as infra.settings, tasks.results, ...)
Settings, Resized, ImageTable = write.Settings, write.Resized, write.ImageTable

def status(pid):
    with open(f"/proc/{pid}/status") as handle:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in handle) if k in ("VmRSS", "VmHWM")}

def reset_peak(pid):
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False

settings = Settings(workspace=args["workspace"], spark_master="local[2]")
spark = spark_session(settings) if args["engine"] == "spark" else on_demand(settings)
jvm = spark.sparkContext._gateway.proc.pid if args["engine"] == "spark" else None
resized = Resized.model_validate(args["resized"])
table = ImageTable.at(spark, args["table"], resized.image_size, args["engine"], args["quarantine"])
reset = reset_peak("self") and (jvm is None or reset_peak(jvm))
before, jvm_before = status("self")["VmRSS"], status(jvm)["VmRSS"] if jvm else 0
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
written = write.write_images(table, resized, 1.0)
seconds = time.perf_counter() - started
peak = status("self")["VmHWM"] - before if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss
print(json.dumps({
    "peak_kb": peak, "jvm_peak_kb": status(jvm)["VmHWM"] - jvm_before if jvm and reset else None,
    "reset": reset, "seconds": seconds, "rows": written.rows, "retired": written.retired, "code": write.__file__,
}), flush=True)
sys.stderr.flush()
os._exit(0)  # no teardown: Arrow's thread pool can abort it, which says nothing about the write
"""

ROWS_PER_FILE = 2048  # the rows one decode task writes at most (imagelake.tasks.rules.partitions.ROWS_PER_DECODE_TASK)


def stage(root: Path, images: int, side: int) -> dict:
    """A table of 10 rows under ROOT, and a resize stage's output for the next run: IMAGES new rows, one retired.
    Returns the Resized that the write takes, as JSON."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from imagelake.infra.delta import Table
    from imagelake.tasks.data.resize_executor import ImageFileWriter
    from imagelake.tasks.results import Resized
    from imagelake.tasks.rules.schemas import IMAGE_TABLE_SCHEMA, STAGED_ARROW_SCHEMA

    table, staging = root / "tables" / "images", root / "staging" / "resize"
    staging.mkdir(parents=True)
    pixels = np.random.default_rng(7).integers(0, 256, side * side * 3, dtype=np.uint8).tobytes()
    now = datetime.now(UTC)

    def rows(start: int, count: int, partition: int) -> list[dict]:
        out = []
        with ImageFileWriter(str(table), partition, side, now) as writer:
            for n in range(start, start + count):
                row = {"path": f"file:///source/label{n % 10}/{n:08d}.jpg", "label": f"label{n % 10}", "date": None}
                row |= {"size": 40_000, "mtime": 1.7e9, "stamp": None, "issue": None, "action": "upsert"}
                row |= {"sha256": f"{n:064x}", "width": side, "height": side, "status": "new", "reason": None}
                row |= {"detail": None, "data_file": None, "read_retries": 0}
                writer.add(row, n.to_bytes(8, "little") + pixels[8:])  # every image its own bytes
                out.append(row)
        return out

    first = rows(0, 10, 0)
    Table(str(table)).commit_files(IMAGE_TABLE_SCHEMA, sorted({row["data_file"] for row in first}))
    staged = []
    for partition, start in enumerate(range(10, 10 + images, ROWS_PER_FILE)):
        staged += rows(start, min(ROWS_PER_FILE, 10 + images - start), partition + 1)
    staged.append({**first[0], "action": "delete", "status": "delete", "sha256": None, "data_file": None})
    pq.write_table(pa.Table.from_pylist(staged, schema=STAGED_ARROW_SCHEMA), staging / "part-00000.parquet")
    resized = Resized(
        staging_uri=str(staging),
        table_uri=str(table),
        image_size=side,
        decoded=images,
        known=0,
        retired=1,
        quarantined={},
        content_fingerprint="bench",
    )
    return resized.model_dump()


def measure(code: Path, engine: str, images: int, side: int) -> dict:
    """One merge with the checkout at CODE and ENGINE, in a fresh process, on data staged in a folder removed after."""
    # the write stage's module now, then where it was before the stages had a folder of their own
    module = checkout.module_in(code, "imagelake.tasks.stages.write", "imagelake.tasks.write")
    root = Path(tempfile.mkdtemp(prefix="merge-memory-"))
    try:
        args = {
            "resized": stage(root, images, side),
            "engine": engine,
            "table": str(root / "tables" / "images"),
            "quarantine": str(root / "tables" / "quarantine"),
            "workspace": str(root / "ws"),
        }
        # PYTHONPATH, not sys.path: Spark's Python workers import the checkout's code too
        done = subprocess.run(
            [sys.executable, "-c", CHILD, module, json.dumps(args)],
            capture_output=True,
            text=True,
            cwd=code,
            env=checkout.environ(checkout.import_path(code)),
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if done.returncode:
        sys.exit(f"the write with the code at {code} ({engine}) failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    checkout.verify(code, result["code"])
    if (result["rows"], result["retired"]) != (images, 1):
        sys.exit(
            f"the write with the code at {code} ({engine}) landed {result['rows']} rows, retired {result['retired']}"
        )
    return result


def report(name: str, code: Path, engine: str, images: int, result: dict) -> None:
    peak = result["peak_kb"] * 1024
    jvm = f"  JVM peak {result['jvm_peak_kb'] * 1024 / 1e6:6.0f} MB" if result.get("jvm_peak_kb") is not None else ""
    print(
        f"  {name} {str(code)[-24:]:>24} {engine:>8}  driver peak {peak / 1e6:7.0f} MB  "
        f"{peak / images:9.0f} bytes an image{jvm}  {result['seconds']:6.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2500)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--engines", default="delta-rs,spark", help="comma-separated: delta-rs, spark")
    parser.add_argument("--against", type=Path, help="an earlier checkout to measure first")
    add_record_option(parser)
    args = parser.parse_args()
    engines = [engine.strip() for engine in args.engines.split(",") if engine.strip()]
    size = args.images * args.side * args.side * 3
    print(
        f"a write of {args.images:,} new {args.side} px images ({size / 1e6:,.0f} MB of pixels) that retires one row "
        "of a 10-row table (a merge), each in a fresh process"
    )
    for engine in engines:
        results = {}
        for name, code in (("(a)", args.against), ("(b)", REPO)):
            if code is not None:
                started = time.perf_counter()
                results[name] = measure(code.resolve(), engine, args.images, args.side)
                report(name, code.resolve(), engine, args.images, results[name])
                if not results[name]["reset"]:
                    print(f"    (peak from ru_maxrss; {time.perf_counter() - started:.0f} s with staging)")
        if "(a)" in results:
            old, now = results["(a)"], results["(b)"]
            print(f"  (b) / (a), {engine}: driver peak {now['peak_kb'] / max(old['peak_kb'], 1):.3f}")
        now = results["(b)"]
        keep(
            args,
            f"merge_memory_{engine.replace('-', '_')}",
            f"the driver's peak memory in a write of {args.images:,} new {args.side} px images ({engine})",
            {
                "driver_peak_mb": round(now["peak_kb"] * 1024 / 1e6),
                "bytes_per_image": round(now["peak_kb"] * 1024 / args.images),
                "seconds": round(now["seconds"], 1),
            },
        )


if __name__ == "__main__":
    main()
