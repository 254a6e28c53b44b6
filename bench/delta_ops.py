"""Each Delta operation the pipeline uses, timed with delta-rs and with Spark's Delta side by side on the same table.

    .venv/bin/python bench/delta_ops.py [--rows 4000] [--side 64] [--repeats 3]

The table holds ROWS images of SIDE x SIDE RGB pixels, appended in 20 commits (as 20 nightly runs would).
For each engine, on its own copy of that table: reading the keys the write stage plans with (path, sha256),
counting a version through a Spark DataFrame, a merge that replaces 2%, adds 2% and deletes 1% of the rows,
the history, compaction of the 20 small files, and a vacuum with retention 0. Medians of REPEATS fresh copies;
the ratio column is Spark's Delta time / delta-rs time (below 1: Spark's Delta is faster).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from figures import add_record_option, keep  # bench/figures.py

from imagelake.infra.delta import Table, append_arrow
from imagelake.infra.settings import Settings
from imagelake.infra.spark import delta_jars_loaded, spark_session


def rows(start: int, count: int, side: int, salt: str = "") -> pa.Table:
    rng = np.random.default_rng(start)
    images = [rng.integers(0, 255, side * side * 3, dtype=np.uint8).tobytes() for _ in range(count)]
    paths = [f"class{i % 2}/{i:06d}.jpg" for i in range(start, start + count)]
    return pa.table(
        {
            "path": paths,
            "image_size": pa.array([side] * count, pa.int32()),
            "sha256": [hashlib.sha256((p + salt).encode()).hexdigest() for p in paths],
            "label": [p.split("/")[0] for p in paths],
            "image": pa.array(images, pa.binary()),
        }
    )


def build(folder: Path, total: int, side: int) -> None:
    per = total // 20
    for commit in range(20):
        append_arrow(str(folder), rows(commit * per, per, side))


def changes(total: int, side: int) -> pa.Table:
    replaced = rows(0, total // 50, side, salt="v2")
    added = rows(total, total // 50, side)
    upserts = pa.concat_tables([replaced, added])
    upserts = upserts.append_column("_action", pa.array(["upsert"] * upserts.num_rows))
    gone = rows(total // 2, total // 100, side).append_column("_action", pa.array(["delete"] * (total // 100)))
    return pa.concat_tables([upserts, gone])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_record_option(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="imagelake-delta-ops-"))
    try:
        spark = spark_session(Settings(workspace=work / "ws"))
        if not delta_jars_loaded(spark):
            raise SystemExit(
                "Spark's Delta jars are not installed (`make install` fetches them with mvn): nothing to compare"
            )
        build(work / "seed", args.rows, args.side)
        merge_rows = changes(args.rows, args.side)
        operations = {
            "read keys (path, sha256)": lambda t: t.read(["path", "sha256"]),
            "count a version (DataFrame)": lambda t: t.frame(10).count(),
            "merge (2% replaced, 2% new, 1% deleted)": lambda t: t.merge(merge_rows),
            "history": lambda t: t.history(),
            "compact 20 files": lambda t: t.compact(),
            "vacuum (retention 0)": lambda t: t.vacuum(0, []),
        }
        times: dict[str, dict[str, list[float]]] = {op: {"delta-rs": [], "spark": []} for op in operations}
        for repeat in range(args.repeats + 1):  # the first round warms the JVM and both engines
            for engine in ("delta-rs", "spark") if repeat % 2 else ("spark", "delta-rs"):
                folder = work / f"{engine}-{repeat}"
                shutil.copytree(work / "seed", folder)
                table = Table(str(folder), spark, engine)  # type: ignore[arg-type]
                for op, run in operations.items():
                    started = time.perf_counter()
                    run(table)
                    if repeat:
                        times[op][engine].append(time.perf_counter() - started)
                shutil.rmtree(folder)
        print(f"{args.rows} rows of {args.side}x{args.side} RGB in 20 files; median of {args.repeats} (seconds)")
        print(f"{'operation':44} {'delta-rs':>9} {'spark':>9} {'spark / delta-rs':>17}")
        for op, by in times.items():
            rs, sp = statistics.median(by["delta-rs"]), statistics.median(by["spark"])
            print(f"{op:44} {rs:9.3f} {sp:9.3f} {sp / rs:17.2f}")
        slug = {op: "_".join(re.findall(r"[a-z0-9]+", op.split(" (")[0].lower())) for op in times}
        keep(
            args,
            "delta_ops",
            f"Delta operations on {args.rows} rows: Spark's Delta against delta-rs (median of {args.repeats})",
            {
                f"{slug[op]}_spark_of_delta_rs_ratio": round(
                    statistics.median(by["spark"]) / statistics.median(by["delta-rs"]), 2
                )
                for op, by in times.items()
            },
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
