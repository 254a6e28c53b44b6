"""Backfills: a dry-run plan, dates ingested as subflows with a failing date that does not stop the others, no work
twice."""

from __future__ import annotations

import shutil
from datetime import date
from pathlib import Path

import pytest
from deltalake import DeltaTable

from imagelake.flows.backfill import BackfillFailed, backfill
from imagelake.infra.delta import read_version
from imagelake.infra.tracking import mlflow_client
from imagelake.tasks.data.listing import ListingIncomplete
from tests.lake import LostMount, copy_digits

pytestmark = pytest.mark.slow


def test_backfill_plans_runs_each_date_and_does_no_work_twice(
    spark, prefect_api: str, digits_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    source = tmp_path / "landing"
    copy_digits(digits_dir, source / "date=2024-03-01", labels=("0", "1", "2"), per_label=12)
    # Other images than the first date's: content already in the table is not added again under another path.
    copy_digits(digits_dir, source / "date=2024-03-02", labels=("0", "1", "2"), per_label=12, skip=12)
    (source / "date=2024-03-03" / "0").mkdir(parents=True)
    for i in range(3):
        (source / "date=2024-03-03" / "0" / f"junk{i}.png").write_text("not an image")
    overrides = {
        "workspace": str(tmp_path / "ws"),
        "image_size": 24,
        "max_epochs": 1,
        "num_workers": 1,
        "batch_size": 8,
        "model_name": "backfill",
    }
    # The local file system through a wrapper that can lose a folder (tests/lake.py:LostMount); nothing is lost yet.
    span = dict(
        source=f"lostmount://{source}", start_date=date(2024, 3, 1), end_date=date(2024, 3, 5), overrides=overrides
    )

    planned = backfill(**span, dry_run=True)
    assert [(p["date"], p["status"]) for p in planned["plan"]] == [
        ("2024-03-01", "missing"),
        ("2024-03-02", "missing"),
        ("2024-03-03", "missing"),
    ]
    table = tmp_path / "ws" / "tables" / "images"
    assert not (table / "_delta_log").exists(), "a dry run writes nothing"

    # The bad date fails on its own; the other two land, and training runs once on the result.
    with pytest.raises(BackfillFailed, match=r"1 of 3 dates failed; re-run them: 2024-03-03: TooManyBadFiles"):
        backfill(**span, max_concurrency=2)
    rows = read_version(spark, str(table), DeltaTable(str(table)).version(), "delta-rs").select("date").collect()
    assert sorted({str(r["date"]) for r in rows}) == ["2024-03-01", "2024-03-02"] and len(rows) == 72
    client = mlflow_client(overrides_settings(overrides))
    assert len(client.search_model_versions("name='backfill'")) == 1

    # The bad date removed at the source: the same backfill has nothing left to do.
    shutil.rmtree(source / "date=2024-03-03")
    version = DeltaTable(str(table)).version()
    again = backfill(**span)
    assert {p["status"] for p in again["plan"]} == {"done"} and again["ingested"] == []
    assert again["delta_version"] == version and again["model_version"] == "1", "no new table version, no new training"

    # A folder that cannot be listed (a lost mount): the backfill, which retires what is not listed, stops naming it
    # before any date runs; nothing is retired and no model trained.
    monkeypatch.setattr(LostMount, "lost", "date=2024-03-02/1")
    with pytest.raises(ListingIncomplete, match=r"could not list lostmount://.*date=2024-03-02/1 \(PermissionError"):
        backfill(**span)
    assert (
        DeltaTable(str(table)).version() == version
        and read_version(spark, str(table), version, "delta-rs").count() == 72
    )
    assert len(client.search_model_versions("name='backfill'")) == 1


def overrides_settings(overrides: dict):
    from imagelake.infra.settings import load_settings

    return load_settings(overrides=overrides)


def test_the_cli_plans_a_backfill_and_refuses_a_reversed_range(digits_dir: Path, tmp_path: Path) -> None:
    import json
    import sqlite3
    import subprocess

    from imagelake.infra.lifecycle import processes_with
    from tests.conftest import REPO, cli_env
    from tests.servers import BIN

    source = tmp_path / "landing"
    copy_digits(digits_dir, source / "date=2024-03-01", labels=("0", "1"), per_label=4)
    copy_digits(digits_dir, source / "date=2024-03-03", labels=("0", "1"), per_label=4)
    command = [str(BIN / "imagelake"), "backfill", "--source", str(source), "--set", f"workspace={tmp_path / 'ws'}"]
    # No Prefect API, as for a user without a server: the command starts Prefect's temporary server itself, before
    # it imports the flow (infra/prefect_server.py), runs the flow on it, and leaves no process behind. A fresh Prefect
    # home's server takes longer to answer than Prefect's own start-up timeout allows (here 1 s): the command waits.
    home = tmp_path / "prefect-home"
    alone = {
        key: value
        for key, value in cli_env(
            {"PREFECT_HOME": str(home), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"}
        ).items()
        if key != "PREFECT_API_URL"
    }
    done = subprocess.run(
        [*command, "2024-03-01", "2024-03-04", "--dry-run", "--json"],
        cwd=REPO,
        env=alone,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Starting temporary server" not in done.stdout + done.stderr, "Prefect started a server of its own"
    with sqlite3.connect(home / "prefect.db") as db:
        assert ("imagelake-backfill",) in db.execute("SELECT name FROM flow").fetchall()
    assert not [p.cmdline() for p in processes_with("PREFECT_HOME", str(home)) if p.is_running()], "left running"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["dry_run"] and [(p["date"], p["status"], p["files"]) for p in result["plan"]] == [
        ("2024-03-01", "missing", 8),
        ("2024-03-03", "missing", 8),
    ]
    assert "2024-03-03  missing" in done.stdout
    assert not (tmp_path / "ws" / "tables" / "images").exists(), "a dry run writes nothing"
    # A reversed range is refused before anything starts: no Prefect server (none made a database in its home).
    refused_home = tmp_path / "refused-prefect-home"
    reversed_range = subprocess.run(
        [*command, "2024-03-04", "2024-03-01"],
        cwd=REPO,
        env={**alone, "PREFECT_HOME": str(refused_home)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (
        reversed_range.returncode == 2
        and "start_date 2024-03-04 is after end_date 2024-03-01: swap them" in reversed_range.stderr
    )
    assert not (refused_home / "prefect.db").exists(), "a Prefect server was started for a refused range"
    version = subprocess.run([str(BIN / "imagelake"), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("imagelake ")
