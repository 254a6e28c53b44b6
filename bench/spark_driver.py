"""A short-lived Spark driver, as a command, a flow run or a test's writer starts one, two ways side by side:

- `--compare flags` (default): the JVM's defaults against the client compiler only and a one-thread collector
  (`-XX:TieredStopAtLevel=1 -XX:+UseSerialGC` in SPARK_SUBMIT_OPTS, which the test suite sets for the processes it
  starts);
- `--compare archive`: without and with the class archive `make install` makes (infra/class_archive.py), with the
  JVM's defaults and with the suite's flags. The side without it names the JDK's own base archive, which every JVM
  maps anyway, so that imagelake adds none.

    .venv/bin/python bench/spark_driver.py [--compare flags|archive] [--runs 3] [--rows 20000]

Each run is a fresh process that starts imagelake's Spark session (local[2], with the Delta and S3A jars), writes ROWS
rows to a new Delta table, reads them back grouped by label and stops; the sides in turn, so that a busier minute
falls on each. Per side, the median (min and max) of the wall seconds and of the CPU seconds of the process and its
children (the JVM's included, read from /proc until they end) and of the seconds its Spark session took to start
(spark_session's own figure: the JVM up, the session made and a first empty job run), then the ratio of each side's
medians to the first side's (for `archive`, of each "archive" side to its "no archive" side).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
from figures import add_record_option, keep  # bench/figures.py

FLAGS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
DRIVER = """
import sys, tempfile
from pathlib import Path
from imagelake.infra.settings import Settings
from imagelake.infra.spark import spark_session, spark_startup_seconds
workspace = Path(tempfile.mkdtemp(prefix="spark-driver-"))
spark = spark_session(Settings(workspace=workspace, spark_master="local[2]"))
print("start", spark_startup_seconds(), flush=True)
rows = spark.range(int(sys.argv[1])).selectExpr("id", "id % 10 AS label", "repeat('x', 200) AS payload")
rows.write.format("delta").save(str(workspace / "table"))
spark.read.format("delta").load(str(workspace / "table")).groupBy("label").count().collect()
spark.stop()
"""


def one_run(options: str | None, rows: int) -> tuple[float, float, float]:
    """Wall and CPU seconds of one driver process with SPARK_SUBMIT_OPTS=OPTIONS (None: unset), and the seconds its
    Spark session took to start (spark_session's own figure: the JVM up, the session made, a first empty job)."""
    env = {k: v for k, v in os.environ.items() if k != "SPARK_SUBMIT_OPTS"}
    if options:
        env["SPARK_SUBMIT_OPTS"] = options
    log = tempfile.TemporaryFile()
    started = time.monotonic()
    out = tempfile.TemporaryFile()
    child = subprocess.Popen([sys.executable, "-c", DRIVER, str(rows)], env=env, stdout=out, stderr=log)
    cpu: dict[int, float] = {}
    root = psutil.Process(child.pid)
    while child.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for process in tree:
            try:
                times = process.cpu_times()
                cpu[process.pid] = times.user + times.system
            except psutil.Error:
                pass
        time.sleep(0.2)
    wall = time.monotonic() - started
    if child.returncode != 0:
        log.seek(0)
        sys.exit(f"the driver exited with {child.returncode}:\n{log.read().decode(errors='replace')[-3000:]}")
    out.seek(0)
    start = float(out.read().decode().split("start", 1)[1].split()[0])
    return wall, sum(cpu.values()), start


def base_archive() -> str:
    """The JDK's own class archive, which a JVM maps when no other is named."""
    from imagelake.infra.java import ensure_java

    found = sorted(ensure_java().resolve().glob("lib/server/classes.jsa"))
    if not found:
        sys.exit("no base class archive in this JDK (lib/server/classes.jsa): nothing to compare against")
    return f"-XX:SharedArchiveFile={found[0]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=["flags", "archive"], default="flags")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20000)
    add_record_option(parser)
    args = parser.parse_args()
    if args.compare == "flags":
        sides: dict[str, str | None] = {"defaults": None, "C1, serial GC": FLAGS}
        pairs = [("C1, serial GC", "defaults")]
    else:
        from imagelake.infra.class_archive import driver_archive
        from imagelake.infra.java import ensure_java

        if driver_archive(ensure_java()) is None:
            sys.exit("no class archive for this JVM and pyspark: `make install` makes it")
        base = base_archive()
        sides = {
            "no archive": base,
            "archive": None,
            "flags, no arch.": f"{FLAGS} {base}",
            "flags, archive": FLAGS,
        }
        pairs = [("archive", "no archive"), ("flags, archive", "flags, no arch.")]
    figures: dict[str, list[tuple[float, float, float]]] = {side: [] for side in sides}
    for run in range(args.runs):
        for side, options in sides.items():
            figures[side].append(one_run(options, args.rows))
            wall, cpu, start = figures[side][-1]
            print(f"run {run + 1} {side:15} wall {wall:5.1f} s  CPU {cpu:5.1f} s  start {start:4.1f} s", flush=True)
    print(f"\n{'':15}  {'wall s':>20}  {'CPU s':>20}  {'session start s':>20}")
    medians = {}
    for side, rows in figures.items():
        columns = list(zip(*rows, strict=True))
        medians[side] = tuple(statistics.median(c) for c in columns)
        cells = [f"{statistics.median(c):5.1f} ({min(c):.1f}-{max(c):.1f})" for c in columns]
        print(f"{side:15}  {cells[0]:>20}  {cells[1]:>20}  {cells[2]:>20}")
    found: dict[str, float] = {}
    for side, against in pairs:
        ratio = [medians[side][i] / medians[against][i] for i in (0, 1, 2)]
        print(f"{'ratio':15}  {ratio[0]:>20.2f}  {ratio[1]:>20.2f}  {ratio[2]:>20.2f}   ({side} / {against})")
        slug = "_".join("".join(c if c.isalnum() else " " for c in side).split()).lower()
        found |= {
            f"{slug}_wall_s": round(medians[side][0], 1),
            f"{slug}_session_start_s": round(medians[side][2], 1),
            f"{slug}_wall_ratio": round(ratio[0], 2),
            f"{slug}_cpu_ratio": round(ratio[1], 2),
            f"{slug}_session_start_ratio": round(ratio[2], 2),
        }
    keep(
        args,
        f"spark_driver_{args.compare}",
        f"an embedded Spark driver's start and a {args.rows}-row job: {', '.join(f'{a} / {b}' for a, b in pairs)} "
        f"(median of {args.runs})",
        found,
    )


if __name__ == "__main__":
    main()
