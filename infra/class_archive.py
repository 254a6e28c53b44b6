"""The Spark driver's class archive: the classes a driver's JVM loads, stored once and mapped into every later driver.

A driver's JVM loads about 21,000 classes (Spark, Scala, Hadoop, Delta) before its first job, and finding, parsing and
verifying them is much of the time a Spark session takes to start. Java's class-data sharing (JDK 13 and later) dumps
the classes a JVM loaded into an archive when it exits (-XX:ArchiveClassesAtExit) and maps them, ready-made, into later
JVMs (-XX:SharedArchiveFile). `make install` makes one for this environment:

    python -m imagelake.infra.local.make_class_archive build    # a short Spark job (Delta write, merge, an Arrow UDF)

and infra/spark.py hands it to every driver it starts (spark.driver.extraJavaOptions). An archive fits only the JVM
and the Spark class path it was made with, so its file name carries a key of both: the JVM's library, and every jar
on Spark's class path by name, size and time. Another JVM, or another pyspark, finds no archive of its key and starts
as it did without one. Classes of the jars given through spark.jars (Delta, S3A) are checked by the JVM itself, class
by class, against the archive's copy.

This module finds the archive; infra/local/make_class_archive.py makes it.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from imagelake.infra.jars import jar_folder

MIN_JAVA = 13  # the first JDK with -XX:ArchiveClassesAtExit
FOLDER = "class-archive"  # in the jar folder (infra/jars.py)
ARCHIVE_OPTION = re.compile(r"-XX:(SharedArchiveFile|ArchiveClassesAtExit)=")


def spark_home() -> Path:
    """The Spark installation whose jars the driver's class path holds: SPARK_HOME, else pyspark's own."""
    if os.environ.get("SPARK_HOME"):
        return Path(os.environ["SPARK_HOME"])
    import pyspark

    return Path(pyspark.__file__).parent


def archive_key(java_home: Path, home: Path | None = None) -> str:
    """What an archive must have been made with: the JVM's library and Spark's class path (its jars and conf folder)."""
    home = home or spark_home()
    parts = [str(java_home.resolve()), str(home.resolve()), os.environ.get("SPARK_CONF_DIR", "")]
    libraries = sorted(java_home.resolve().glob("lib/server/libjvm.*")) or sorted(
        java_home.resolve().glob("jre/lib/*/server/libjvm.*")
    )
    for path in [*libraries, *sorted((home / "jars").glob("*.jar"))]:
        stat = path.stat()
        parts.append(f"{path.name} {stat.st_size} {stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def archive_path(java_home: Path, folder: Path | None = None) -> Path:
    """Where this JVM's and this Spark's archive is (or would be)."""
    return (folder or jar_folder()) / FOLDER / f"driver-{archive_key(java_home)}.jsa"


def driver_archive(java_home: Path, folder: Path | None = None) -> Path | None:
    """The archive a driver started with the JVM at JAVA_HOME can map, if `make install` made it; None otherwise."""
    path = archive_path(java_home, folder)
    return path if path.is_file() else None


def driver_java_options(java_home: Path, own: str = "", folder: Path | None = None) -> str:
    """spark.driver.extraJavaOptions for a driver started with the JVM at JAVA_HOME: the archive's option, if there is
    an archive, then the settings' own options. An archive option of the settings' own or of SPARK_SUBMIT_OPTS (the
    build's steps use that) is the only one given. FOLDER: the jar folder the archive is kept in (infra/jars.py)."""
    named = ARCHIVE_OPTION.search(f"{os.environ.get('SPARK_SUBMIT_OPTS', '')} {own}")
    archive = None if named else driver_archive(java_home, folder)
    return " ".join(part for part in (f"-XX:SharedArchiveFile={archive}" if archive else "", own.strip()) if part)
