"""The jar folder `make install` fills: what Spark is given, and a machine without mvn."""

from __future__ import annotations

from pathlib import Path

import pytest

from imagelake.infra.jars import JARS, SUMS, check, file_name, install, jar_folder, runtime_jars


def test_spark_gets_the_jars_only_when_all_are_there(tmp_path: Path) -> None:
    installed = runtime_jars()
    assert [Path(j).name for j in installed] == [file_name(c) for c in JARS], (
        "`make install` fetches every jar in infra/jars.py"
    )
    partial = tmp_path / "partial"
    partial.mkdir()
    for jar in installed[:-1]:
        (partial / Path(jar).name).symlink_to(jar)
    assert runtime_jars(partial) == [], "a missing jar (here the AWS SDK) would fail Spark's start: none are given"
    assert [s.present for s in check(partial)] == [True, True, True, False]


def test_a_machine_without_mvn_installs_no_jar_and_says_delta_rs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    assert install(tmp_path / "jars") == 1
    out = capsys.readouterr().out
    assert "no mvn on PATH" in out and "Delta tables use delta-rs" in out
    assert not (tmp_path / "jars").exists()


def test_the_recorded_checksums_are_the_jars(tmp_path: Path) -> None:
    sums = (jar_folder() / SUMS).read_text().split()
    assert sorted(sums[1::2]) == sorted(file_name(c) for c in JARS)
    assert all(state.checksum_ok for state in check())
