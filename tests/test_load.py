"""The shared servers under load (bench/load.py): a backfill, the nightly deployment twice and an ad-hoc run at once.

The small scenario runs on PostgreSQL in every full test run; the full one (a 20-date backfill, 3 ad-hoc runs), on
both databases, only with IMAGELAKE_LOAD_FULL=1 (about half an hour each on two cores).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from bench.load import Report, run_load

pytestmark = [pytest.mark.slow, pytest.mark.load, pytest.mark.alone, pytest.mark.xdist_group("alone-cluster")]


@pytest.fixture
def load_root():
    # Run by root, PostgreSQL runs as `postgres`, which must be able to enter its data folder (pytest's is closed).
    root = Path(tempfile.mkdtemp(prefix="imagelake-load-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def check(report: Report) -> None:
    print(report)
    assert not report.failed_from_busy, f"runs failed because the server was busy: {report.failed_from_busy}"
    assert not report.not_completed, f"runs that did not complete: {report.not_completed}"
    assert report.errors == 0, f"{report.errors} requests failed even after retrying busy answers"
    assert report.duplicate_rows == 0, f"{report.duplicate_rows} images are in the table more than once"
    assert report.images_in_table == report.images_expected, (
        f"{report.images_expected - report.images_in_table} images lost"
    )
    assert report.champion is not None and report.history_chain_whole and not report.pending_move, report
    assert not report.left_running, f"processes left running: {report.left_running}"


def test_a_small_load_on_postgresql_loses_duplicates_and_leaves_nothing(load_root: Path) -> None:
    check(run_load(load_root, "postgres", "small"))


@pytest.mark.skipif(
    not os.environ.get("IMAGELAKE_LOAD_FULL"),
    reason="the full load scenario runs with IMAGELAKE_LOAD_FULL=1 (bench/load.py)",
)
@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_the_full_load(load_root: Path, database: str) -> None:
    check(run_load(load_root, database, "full"))
