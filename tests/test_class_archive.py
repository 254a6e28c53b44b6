"""The Spark driver's class archive (infra/class_archive.py; infra/local/make_class_archive.py makes it): made by `make
install`, mapped by the drivers spark_session starts, found only by the JVM and the Spark jars it was made with, never
put in place damaged."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from imagelake.infra.class_archive import MIN_JAVA, archive_key, driver_archive, driver_java_options
from imagelake.infra.java import ensure_java
from imagelake.infra.local.make_class_archive import build, java_major, run_driver


@pytest.fixture(scope="module")
def java_home() -> Path:
    home = ensure_java()
    if java_major(home) < MIN_JAVA:
        pytest.skip(f"Java {java_major(home)} makes no class archive (JDK {MIN_JAVA}+)")
    return home


def test_a_driver_started_by_spark_session_maps_the_archive_make_install_made(spark, java_home: Path) -> None:
    archive = driver_archive(java_home)
    assert archive is not None, (
        "`make install` makes the class archive (python -m imagelake.infra.local.make_class_archive build)"
    )
    spark.range(1).count()
    # The session's JVM: the child of this process that runs SparkSubmit (not the test S3 server's JVM).
    drivers = [
        process for process in psutil.Process().children() if "org.apache.spark.deploy.SparkSubmit" in process.cmdline()
    ]
    assert len(drivers) == 1, [process.cmdline() for process in drivers]
    assert f"-XX:SharedArchiveFile={archive}" in drivers[0].cmdline(), drivers[0].cmdline()
    # Given is not used: a JVM that cannot use an archive warns and starts without it. Its memory map says.
    maps = Path(f"/proc/{drivers[0].pid}/maps").read_text()
    assert str(archive) in maps, f"the driver's JVM ({drivers[0].pid}) has not mapped {archive}"


def test_another_spark_jar_or_jvm_finds_no_archive(
    tmp_path: Path, java_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "spark"
    (home / "jars").mkdir(parents=True)
    jar = home / "jars" / "spark-core_2.12-3.5.0.jar"
    jar.write_bytes(b"one")
    key = archive_key(java_home, home)
    assert archive_key(java_home, home) == key
    jar.write_bytes(b"other")
    assert archive_key(java_home, home) != key, "a replaced jar of the same name makes another key"
    other_jvm = tmp_path / "jvm"
    (other_jvm / "lib" / "server").mkdir(parents=True)
    (other_jvm / "lib" / "server" / "libjvm.so").write_bytes(b"jvm")
    assert archive_key(other_jvm, home) != archive_key(java_home, home)

    monkeypatch.setenv("SPARK_HOME", str(home))
    assert driver_archive(java_home) is None
    assert driver_java_options(java_home, " -Dx=1 ") == "-Dx=1", "the settings' own options, as they are"
    monkeypatch.delenv("SPARK_HOME")
    archive = driver_archive(java_home)
    assert driver_java_options(java_home, "-Dx=1") == f"-XX:SharedArchiveFile={archive} -Dx=1"
    own = "-XX:SharedArchiveFile=/elsewhere.jsa"
    assert driver_java_options(java_home, own) == own, "an archive of the settings' own is the only one"
    monkeypatch.setenv("SPARK_SUBMIT_OPTS", "-XX:ArchiveClassesAtExit=/new.jsa")
    assert driver_java_options(java_home) == "", "nor is one given to a JVM that makes one (or maps one) already"


def test_a_damaged_archive_fails_the_check_and_a_failed_build_leaves_no_archive(
    tmp_path: Path, java_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    archive = driver_archive(java_home)
    assert archive is not None, "`make install` makes the class archive"
    damaged = tmp_path / "damaged.jsa"
    with archive.open("rb") as whole, damaged.open("wb") as part:
        part.write(whole.read(1 << 20))  # a dump cut short
    out = run_driver("check", f"-Xshare:on -XX:+VerifySharedSpaces -XX:SharedArchiveFile={damaged}", timeout=300)
    assert out is not None and "JAVA_GATEWAY_EXITED" in out, f"a driver started from a damaged archive: {out}"

    # A Spark without jars: the job that records the classes fails, and nothing is left in the folder.
    (tmp_path / "spark" / "jars").mkdir(parents=True)
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "spark"))
    assert build(tmp_path / "folder") is None
    assert "the Spark job that records the classes failed" in capsys.readouterr().out
    assert list((tmp_path / "folder" / "class-archive").iterdir()) == []
