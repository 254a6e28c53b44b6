"""Writes that survive crashes and concurrency: a writer killed at each phase of its write, two writers at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import date
from pathlib import Path

import pytest

from imagelake.infra.delta import Table, commit_files, read_version
from imagelake.tasks.data.changes import ingest_listing
from imagelake.tasks.data.listing import source_uri
from imagelake.tasks.data.resize_executor import DecodeRules
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.results import Resized
from imagelake.tasks.rules.listed_files import Scope
from imagelake.tasks.rules.schemas import IMAGE_TABLE_SCHEMA
from imagelake.tasks.stages.resize import resize_images
from imagelake.tasks.stages.write import WRITE_PHASES, plan_changes, settle_concurrent_append, write_images
from tests.conftest import REPO
from tests.lake import copy_digits

RULES = DecodeRules(size=64, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000)


def stage_run(spark, source: Path, root: Path | str, name: str, scope: Scope) -> dict:
    """Resize into the table under ROOT (a folder or an s3:// prefix), without writing."""
    images = ImageTable.at(spark, f"{root}/tables/images", RULES.size)
    ingested = ingest_listing(images, source_uri(str(source)), scope, False, f"{root}/staging")
    resized = resize_images(images, ingested, RULES, f"{root}/staging/{name}")
    return resized.model_dump()


def lake_of(spark, table: str, quarantine: str, engine: str) -> ImageTable:
    return ImageTable.at(spark, table, RULES.size, engine, quarantine)


def writer(
    root: Path,
    resized: dict,
    engine: str,
    barrier: Path | None = None,
    lake: str | None = None,
    stop_at: str | None = None,
) -> subprocess.Popen:
    """A writer process for the tables under LAKE (default: ROOT), its workspace and log under ROOT; with STOP_AT, it
    prints each phase of its write (tasks/stages/write.py: WRITE_PHASES) and waits at that one to be killed."""
    lake = lake or str(root)
    args = {
        "workspace": str(root / "ws"),
        "resized": resized,
        "engine": engine,
        "table": f"{lake}/tables/images",
        "quarantine": f"{lake}/tables/quarantine",
        "barrier": str(barrier) if barrier else None,
        "stop_at": stop_at,
    }
    # The writer's stderr goes to a file next to its data, so a failing writer can be diagnosed.
    log = (root / f"writer-{resized['staging_uri'].rstrip('/').rsplit('/', 1)[-1]}.log").open("w")
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "writer.py"), json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=REPO,
    )


def wait_for(process: subprocess.Popen, line: str) -> None:
    for got in process.stdout:
        if got.strip() == line:
            return
    raise AssertionError(f"writer exited before printing {line}")


def phases_until(process: subprocess.Popen, phase: str) -> list[str]:
    """The phases the writer reported, in order, once it reports PHASE (where it then waits)."""
    seen = []
    for got in process.stdout:
        if got.startswith("PHASE "):
            seen.append(got.split(" ", 1)[1].strip())
            if seen[-1] == phase:
                return seen
    raise AssertionError(f"the writer exited after the phases {seen}, before {phase}; its log is in the test's folder")


def table_rows(spark, table: str, engine: str) -> list[str]:
    version = Table(table).version()
    return [row["path"] for row in read_version(spark, table, version, engine).select("path").collect()]


def rows_in(spark, table: str, engine: str) -> list[str]:
    """The table's paths, none where there is no table yet."""
    return table_rows(spark, table, engine) if Table(table).exists() else []


IMAGES, BAD_FILES = 300, 3
# What a writer killed at each phase of its write has committed: (quarantine rows, image rows).
COMMITTED_AT = {"planned": (0, 0), "quarantine-committed": (BAD_FILES, 0), "images-committed": (BAD_FILES, IMAGES)}


def source_with_bad_files(digits_dir: Path, source: Path) -> Path:
    """300 digits and three files that are no image: the write then commits the quarantine, then the images."""
    copy_digits(digits_dir, source, labels=tuple(str(d) for d in range(10)), per_label=IMAGES // 10)
    for n in range(BAD_FILES):
        (source / "0" / f"broken-{n}.png").write_bytes(f"not an image {n}".encode())
    return source


def kill_at(root: Path, resized: dict, engine: str, lake_root: str, phase: str) -> list[str]:
    """Start a writer, kill it where its write reports PHASE; the phases it reported."""
    process = writer(root, resized, engine, lake=lake_root, stop_at=phase)
    try:
        return phases_until(process, phase)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()


def kill_writers_and_rerun(spark, source: Path, tmp_path: Path, engine: str, lake: Callable[[str], str]) -> None:
    """For each phase of a write: resize, start a writer, kill it at that phase, then write again; the tables end
    whole."""
    for phase in WRITE_PHASES:
        root, lake_root = tmp_path / phase, lake(phase)
        root.mkdir()
        table, quarantine = f"{lake_root}/tables/images", f"{lake_root}/tables/quarantine"
        resized = stage_run(spark, source, lake_root, "all", Scope((".png",)))
        reported = kill_at(root, resized, engine, lake_root, phase)
        # The kill landed in the window PHASE names: after the phases before it, before any later one, and the tables
        # hold what the write commits up to that phase, no more and no less.
        assert reported == list(WRITE_PHASES[: WRITE_PHASES.index(phase) + 1]), (
            f"killed at {phase}, the writer reported {reported}"
        )
        committed = (len(rows_in(spark, quarantine, engine)), len(rows_in(spark, table, engine)))
        assert committed == COMMITTED_AT[phase], f"killed at {phase}: (quarantine rows, image rows) = {committed}"
        # The re-run after the crash (or after a commit Prefect never recorded) completes the write exactly once.
        written = write_images(lake_of(spark, table, quarantine, engine), Resized.model_validate(resized), 1.0)
        paths, bad = table_rows(spark, table, engine), table_rows(spark, quarantine, engine)
        assert len(paths) == len(set(paths)) == IMAGES, (
            f"killed at {phase}: {len(paths)} image rows, {len(set(paths))} paths"
        )
        assert len(bad) == len(set(bad)) == BAD_FILES, (
            f"killed at {phase}: {len(bad)} quarantine rows, {len(set(bad))} paths"
        )
        again = write_images(lake_of(spark, table, quarantine, engine), Resized.model_validate(resized), 1.0)
        assert (again.rows, again.version, again.quarantined) == (0, written.version, 0)


@pytest.mark.both_engines
@pytest.mark.slow
def test_a_writer_killed_at_each_phase_of_its_write_loses_and_duplicates_nothing(
    spark, digits_dir: Path, tmp_path: Path, engine: str
) -> None:
    source = source_with_bad_files(digits_dir, tmp_path / "src")
    kill_writers_and_rerun(spark, source, tmp_path, engine, lambda phase: str(tmp_path / phase))


@pytest.mark.both_engines
@pytest.mark.slow
def test_a_writer_killed_at_each_phase_on_s3_loses_and_duplicates_nothing(
    spark, s3, digits_dir: Path, tmp_path: Path, engine: str
) -> None:
    source = source_with_bad_files(digits_dir, tmp_path / "src")
    prefix = f"s3://lake/{uuid.uuid4().hex[:12]}"
    kill_writers_and_rerun(spark, source, tmp_path, engine, lambda phase: f"{prefix}/{phase}")


@pytest.mark.both_engines
@pytest.mark.slow
def test_two_writers_at_once_both_land(spark, digits_dir: Path, tmp_path: Path, engine: str) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source / "date=2024-03-01", labels=("0", "1", "2"), per_label=20)
    copy_digits(digits_dir, source / "date=2024-03-02", labels=("3", "4", "5"), per_label=20)
    first = stage_run(spark, source, tmp_path, "d1", Scope((".png",), start=date(2024, 3, 1), end=date(2024, 3, 1)))
    second = stage_run(spark, source, tmp_path, "d2", Scope((".png",), start=date(2024, 3, 2), end=date(2024, 3, 2)))
    barrier = tmp_path / "go"
    writers = [writer(tmp_path, first, engine, barrier), writer(tmp_path, second, engine, barrier)]
    for process in writers:
        wait_for(process, "READY")
    barrier.touch()
    results = []
    for process in writers:
        out, _ = process.communicate(timeout=300)
        logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("writer-*.log"))
        assert process.returncode == 0, (
            f"a writer exited {process.returncode}; it printed {out[-500:]!r}; the logs:\n{logs}"
        )
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["rows"] for r in results) == [60, 60]
    assert len({r["version"] for r in results}) == 2
    paths = table_rows(spark, str(tmp_path / "tables" / "images"), engine)
    assert len(paths) == len(set(paths)) == 120


@pytest.mark.both_engines
def test_two_runs_adding_the_same_files_at_once_land_them_once(
    spark, digits_dir: Path, tmp_path: Path, engine: str
) -> None:
    """The race an append cannot see: both runs plan before either commits, then both commit the same paths."""
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=10)
    copy_digits(digits_dir, tmp_path / "first", labels=("7",), per_label=5)
    table, quarantine = str(tmp_path / "tables" / "images"), str(tmp_path / "tables" / "quarantine")
    images = lake_of(spark, table, quarantine, engine)
    write_images(
        images, Resized.model_validate(stage_run(spark, tmp_path / "first", tmp_path, "v0", Scope((".png",)))), 1.0
    )
    one = Resized.model_validate(stage_run(spark, source, tmp_path, "one", Scope((".png",))))
    two = Resized.model_validate(stage_run(spark, source, tmp_path, "two", Scope((".png",))))
    planned = plan_changes(images, two)
    assert planned.read_version == 0 and planned.upserts.num_rows == 20 and not planned.replaces
    assert write_images(images, one, 1.0).rows == 20
    # The second run commits its own files for the same paths, as a blind append would, then settles.
    raced = commit_files(table, IMAGE_TABLE_SCHEMA, planned.files)
    assert len(table_rows(spark, table, engine)) == 45  # the duplicates are visible until the run settles
    settled = settle_concurrent_append(images, two, planned, raced)
    paths = table_rows(spark, table, engine)
    assert settled > raced and len(paths) == len(set(paths)) == 25
    # A replay of that write adds nothing and keeps the files the raced version still references.
    assert write_images(images, two, 1.0).rows == 0
    assert all((Path(table) / name).exists() for name in planned.files)
    # Time travel still shows each version as it was committed.
    assert len(read_version(spark, table, 1, engine).collect()) == 25
    assert len(read_version(spark, table, raced, engine).collect()) == 45
