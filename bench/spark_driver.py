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
children (the JVM's included, read from /proc until they end), then the ratio of each side's medians to the first
side's (for `archive`, of each "archive" side to its "no archive" side).
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

FLAGS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
DRIVER = """
import sys, tempfile
from pathlib import Path
from imagelake.infra.settings import Settings
from imagelake.infra.spark import spark_session
workspace = Path(tempfile.mkdtemp(prefix="spark-driver-"))
spark = spark_session(Settings(workspace=workspace, spark_master="local[2]"))
rows = spark.range(int(sys.argv[1])).selectExpr("id", "id % 10 AS label", "repeat('x', 200) AS payload")
rows.write.format("delta").save(str(workspace / "table"))
spark.read.format("delta").load(str(workspace / "table")).groupBy("label").count().collect()
spark.stop()
"""


def one_run(options: str | None, rows: int) -> tuple[float, float]:
    """Wall and CPU seconds of one driver process with SPARK_SUBMIT_OPTS=OPTIONS (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "SPARK_SUBMIT_OPTS"}
    if options:
        env["SPARK_SUBMIT_OPTS"] = options
    log = tempfile.TemporaryFile()
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", DRIVER, str(rows)], env=env, stdout=subprocess.DEVNULL, stderr=log)
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
    return wall, sum(cpu.values())


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
    figures: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for run in range(args.runs):
        for side, options in sides.items():
            figures[side].append(one_run(options, args.rows))
            wall, cpu = figures[side][-1]
            print(f"run {run + 1} {side:15} wall {wall:5.1f} s  CPU {cpu:5.1f} s", flush=True)
    print(f"\n{'':15}  {'wall s':>20}  {'CPU s':>20}")
    medians = {}
    for side, rows in figures.items():
        walls, cpus = zip(*rows, strict=True)
        medians[side] = (statistics.median(walls), statistics.median(cpus))
        cells = [f"{statistics.median(c):5.1f} ({min(c):.1f}-{max(c):.1f})" for c in (walls, cpus)]
        print(f"{side:15}  {cells[0]:>20}  {cells[1]:>20}")
    for side, against in pairs:
        ratio = [medians[side][i] / medians[against][i] for i in (0, 1)]
        print(f"{'ratio':15}  {ratio[0]:>20.2f}  {ratio[1]:>20.2f}   ({side} / {against})")


if __name__ == "__main__":
    main()
