"""Spark's JVM jars: Delta (delta-spark, delta-storage) and S3A (hadoop-aws and its AWS SDK), fetched once by `make
install`.

`python -m imagelake.infra.jars install` asks `mvn` for the artifacts in JARS (Maven Central, checksums checked by
Maven), copies them into the environment's jar folder and writes SHA256SUMS there. Spark is then given
those local files (infra/spark.py): nothing is downloaded at run time. Without `mvn` or Maven Central
the folder stays empty and tables are written and read with delta-rs.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Delta 3.3.3 is built for Spark 3.5 / Scala 2.12; hadoop-aws must match pyspark's Hadoop (hadoop-client-api-3.3.4.jar),
# and 1.12.262 is the AWS SDK bundle that hadoop-aws 3.3.4's build names.
JARS = (
    "io.delta:delta-spark_2.12:3.3.3",
    "io.delta:delta-storage:3.3.3",
    "org.apache.hadoop:hadoop-aws:3.3.4",
    "com.amazonaws:aws-java-sdk-bundle:1.12.262",
)
# Test-only: an S3-compatible server (S3Proxy on a filesystem) for the object-store tests.
TEST_JARS = ("org.gaul:s3proxy:3.0.0:jar:jar-with-dependencies",)
SUMS = "SHA256SUMS"


def jar_folder(configured: Path | None = None) -> Path:
    """Where the jars are: the settings' jars_dir when set, else `jars/` in this interpreter's environment, where
    `make install` puts them."""
    return configured or Path(sys.prefix) / "jars"


def file_name(coordinate: str) -> str:
    """The file `mvn dependency:copy` writes for group:artifact:version[:type[:classifier]]."""
    parts = coordinate.split(":")
    artifact, version = parts[1], parts[2]
    kind = parts[3] if len(parts) > 3 else "jar"
    classifier = f"-{parts[4]}" if len(parts) > 4 else ""
    return f"{artifact}-{version}{classifier}.{kind}"


@dataclass(frozen=True)
class JarState:
    coordinate: str
    path: Path
    present: bool
    checksum_ok: bool | None  # None: not checked (absent, or no SHA256SUMS entry)

    @property
    def ok(self) -> bool:
        return self.present and self.checksum_ok is not False


def runtime_jars(folder: Path | None = None) -> list[str]:
    """The installed runtime jars (Delta and S3A) as local paths, in JARS' order; [] when any one is missing."""
    folder = folder or jar_folder()
    paths = [folder / file_name(c) for c in JARS]
    return [str(p) for p in paths] if all(p.is_file() for p in paths) else []


def test_jar(coordinate: str, folder: Path | None = None) -> Path | None:
    """A test-only jar's path if `make install` fetched it."""
    path = (folder or jar_folder()) / "test" / file_name(coordinate)
    return path if path.is_file() else None


def check(folder: Path | None = None) -> list[JarState]:
    """Each runtime jar: present, and whether its SHA-256 is the one recorded at install."""
    folder = folder or jar_folder()
    sums = _read_sums(folder / SUMS)
    states = []
    for coordinate in JARS:
        path = folder / file_name(coordinate)
        present = path.is_file()
        expected = sums.get(path.name)
        ok = None if not present or expected is None else sha256(path) == expected
        states.append(JarState(coordinate, path, present, ok))
    return states


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_sums(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    return {
        name.strip(): digest
        for digest, name in (line.split(None, 1) for line in path.read_text().splitlines() if line.strip())
    }


def install(folder: Path, coordinates: tuple[str, ...] = JARS + TEST_JARS) -> int:
    """Fetch the jars with mvn (strict checksums) into FOLDER (test jars into FOLDER/test); record their SHA-256.

    Returns 0 when all are there, 1 when mvn is missing or a download failed (Delta then runs on delta-rs).
    """
    mvn = shutil.which("mvn")
    if mvn is None:
        print("jars: no mvn on PATH, so Spark's Delta and S3A jars are not installed; Delta tables use delta-rs")
        return 1
    folder.mkdir(parents=True, exist_ok=True)
    failed = []
    for coordinate in coordinates:
        target = folder / "test" if coordinate in TEST_JARS else folder
        if (target / file_name(coordinate)).is_file():
            continue
        done = subprocess.run(
            [mvn, "-B", "-q", "-C", "dependency:copy", f"-Dartifact={coordinate}", f"-DoutputDirectory={target}"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not (target / file_name(coordinate)).is_file():
            failed.append(coordinate)
            print(
                f"jars: mvn could not fetch {coordinate}: "
                f"{(done.stdout + done.stderr).strip().splitlines()[-1:] or ['no output']}"
            )
    runtime = [folder / file_name(c) for c in JARS if (folder / file_name(c)).is_file()]
    (folder / SUMS).write_text("".join(f"{sha256(path)}  {path.name}\n" for path in runtime))
    for state in check(folder):
        print(f"jars: {state.path.name}: {'ok' if state.ok else 'MISSING'}")
    if failed:
        print("jars: some jars are missing, so Spark's Delta is off and Delta tables use delta-rs")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m imagelake.infra.jars", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="fetch the jars with mvn into the jar folder").add_argument(
        "--folder", type=Path, default=None
    )
    sub.add_parser("check", help="list the jars and check their SHA-256").add_argument(
        "--folder", type=Path, default=None
    )
    args = parser.parse_args(argv)
    folder = args.folder or jar_folder()
    if args.command == "install":
        return install(folder)
    states = check(folder)
    for state in states:
        print(
            f"{state.coordinate}: {state.path} "
            f"{'ok' if state.ok else 'missing' if not state.present else 'CHECKSUM MISMATCH'}"
        )
    return 0 if all(s.ok for s in states) else 1


if __name__ == "__main__":
    sys.exit(main())
