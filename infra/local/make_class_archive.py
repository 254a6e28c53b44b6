"""Making the Spark driver's class archive (infra/class_archive.py finds it): what `make install` runs.

    python -m imagelake.infra.local.make_class_archive build

A short Spark job, started as the stages start theirs, loads what the stages load (a Delta write, a merge into it, a
read grouped by label, a Python function over Arrow batches) in a JVM that dumps its classes as it exits. A damaged
archive crashes the JVM that maps it, so the archive is written under a name of its own first; a JVM told to require
sharing and to verify the archive's checksums (-Xshare:on -XX:+VerifySharedSpaces) must then start a Spark session
from it, and only then is it renamed into place.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from imagelake.infra.class_archive import MIN_JAVA, archive_path
from imagelake.infra.java import ensure_java

BUILD_TIMEOUT_S = 900.0


def java_major(java_home: Path) -> int:
    """The JVM's major version (8 for 1.8), from `java -version`; 0 when it says none."""
    out = subprocess.run([str(java_home / "bin" / "java"), "-version"], capture_output=True, text=True, timeout=60)
    found = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not found:
        return 0
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major


def build(folder: Path | None = None, timeout: float = BUILD_TIMEOUT_S) -> Path | None:
    """Make this environment's archive unless it is there; return its path, or None (saying why) when none can be
    made. Archives of other keys in the folder (an older JVM or pyspark) are removed once this one is in place."""
    java_home = ensure_java()
    target = archive_path(java_home, folder)
    if target.is_file():
        print(f"class archive: {target.name} is there")
        return target
    major = java_major(java_home)
    if major < MIN_JAVA:
        print(f"class archive: Java {major or '?'} cannot make one (JDK {MIN_JAVA}+); Spark drivers start without it")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.stem}.{os.getpid()}.partial")
    started = time.perf_counter()
    try:
        dumped = run_driver("job", f"-XX:ArchiveClassesAtExit={partial}", timeout)
        if dumped is not None or not partial.is_file():
            print(f"class archive: the Spark job that records the classes failed, so there is none:\n{dumped or ''}")
            return None
        checked = run_driver("check", f"-Xshare:on -XX:+VerifySharedSpaces -XX:SharedArchiveFile={partial}", timeout)
        if checked is not None:
            print(f"class archive: a driver could not start from the new archive, so it is dropped:\n{checked}")
            return None
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    for other in target.parent.glob("driver-*.jsa"):
        if other != target:
            other.unlink(missing_ok=True)
    size_mb = target.stat().st_size / 2**20
    print(f"class archive: {target} ({size_mb:.0f} MB) made in {time.perf_counter() - started:.0f} s")
    return target


def run_driver(action: str, java_options: str, timeout: float) -> str | None:
    """Run this module's ACTION in a new process whose driver JVM gets JAVA_OPTIONS, and wait until that JVM has ended
    too (it dumps its archive as it exits); None when all went well, else the process's output."""
    import psutil

    env = {**os.environ, "SPARK_SUBMIT_OPTS": java_options}
    env.pop("PYSPARK_GATEWAY_PORT", None)  # a driver of its own, never this process's
    with tempfile.TemporaryDirectory(prefix="imagelake-class-archive-") as work:  # where a crashed JVM writes its log
        done = subprocess.run(
            [sys.executable, "-m", "imagelake.infra.local.make_class_archive", action],
            env=env,
            cwd=work,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    jvms = [int(pid) for pid in re.findall(r"^driver jvm (\d+)$", done.stdout, re.MULTILINE)]
    for pid in jvms:
        try:
            psutil.Process(pid).wait(timeout)
        except psutil.NoSuchProcess:
            pass
    if done.returncode != 0 or not jvms:
        return "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
    return None


def _job(action: str) -> None:
    """In the child: start a driver as the stages do; for `job`, load what the stages load. Then stop it and name its
    JVM, which ends (and dumps its archive) once this process has."""
    import psutil

    from imagelake.infra.settings import Settings
    from imagelake.infra.spark import spark_session

    with tempfile.TemporaryDirectory(prefix="imagelake-class-archive-") as work:
        spark = spark_session(Settings(workspace=Path(work), spark_master="local[2]"))
        if action == "job":
            _load_what_stages_load(spark, Path(work) / "table")
        spark.stop()
    for jvm in psutil.Process().children():
        if jvm.name() == "java":
            print(f"driver jvm {jvm.pid}", flush=True)


def _load_what_stages_load(spark, path: Path) -> None:
    """A Delta write, a merge into it, a read grouped by label and a Python function over Arrow batches: the classes
    of the write, cache and resize stages, on a few rows."""
    from delta.tables import DeltaTable

    rows = spark.createDataFrame(
        [(i, f"label{i % 3}", bytes([i % 256]) * 64) for i in range(64)], "id long, label string, image binary"
    )
    rows.write.format("delta").save(str(path))
    table = DeltaTable.forPath(spark, str(path))
    table.alias("t").merge(rows.alias("s"), "t.id = s.id").whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()
    frame = spark.read.format("delta").load(str(path))
    frame.groupBy("label").count().collect()
    frame.mapInArrow(lambda batches: (batch.select(["id"]) for batch in batches), "id long").count()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "action", choices=["build", "job", "check"], help="build: make the archive (job and check: its steps)"
    )
    parser.add_argument("--folder", type=Path, help="the jar folder (default: infra/jars.py's)")
    args = parser.parse_args(argv)
    if args.action == "build":
        return 0 if build(args.folder) is not None else 1
    _job(args.action)
    return 0


if __name__ == "__main__":
    sys.exit(main())
