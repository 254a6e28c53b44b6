"""Timeouts: a stage or a flow run that blocks past its limit fails TimedOut (never hangs, never retries) and releases
its Spark and Ray; a wait for a lock gives up after its bound and names who holds it; no timeout enters a cache key."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL, temporary_settings

from imagelake.flows.flow import imagelake_flow, run_settings
from imagelake.infra import lifecycle
from imagelake.infra.prefect_env import lock_name, one_at_a_time
from imagelake.infra.settings import Settings, SettingsError, load_settings
from imagelake.tasks.stage import stage, stage_outcomes

BLOCK_SECONDS = 20  # far past the limits below; without a timeout the stage would end by itself, and the test fail
ATTEMPTS: list[int] = []
CHILDREN: list[subprocess.Popen] = []
SLEPT_OUT: list[int] = []  # a blocked stage whose sleep ran its course: the interrupt never reached it


@stage("blocks", retries=2, backoff=0.05, cache_policy=NO_CACHE)
def blocks(settings: Settings) -> str:
    """Starts a process of its own (as Spark's JVM or a Ray worker would be), then blocks in a system call."""
    ATTEMPTS.append(1)
    CHILDREN.append(subprocess.Popen(["sleep", str(BLOCK_SECONDS * 3)]))
    time.sleep(BLOCK_SECONDS)
    SLEPT_OUT.append(1)
    return "finished"


@imagelake_flow("imagelake-timeout-test")
def blocked(overrides: dict) -> str:
    settings = run_settings(None, overrides)
    # As in a process a worker started for this run: what it starts carries the run's id, and its hooks may stop Spark
    # and Ray.
    os.environ[lifecycle.RUN_ID_VARIABLE] = str(FlowRunContext.get().flow_run.id)
    return blocks(settings)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("limit", "error", "message"),
    [
        ({"stage_timeout_minutes": 0.02}, "StageTimedOut", r"stage blocks ran past stage_timeout_minutes=0.02"),
        (
            {"flow_timeout_hours": 0.0005},
            "FlowTimedOut",
            r"flow run .* of imagelake-timeout-test ran past flow_timeout_hours=0.0005",
        ),
    ],
    ids=["stage", "flow"],
)
def test_a_run_blocked_past_its_timeout_fails_timed_out_once_and_releases_spark_and_ray(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: dict, error: str, message: str
) -> None:
    stopped: list[str] = []
    monkeypatch.setattr(lifecycle, "stop_compute", lambda: (stopped.append("spark and ray") or ["spark", "ray"], []))
    monkeypatch.setenv(lifecycle.RUN_ID_VARIABLE, "set by the flow")
    ATTEMPTS.clear()
    CHILDREN.clear()
    SLEPT_OUT.clear()
    state = blocked({"workspace": str(tmp_path / "ws"), **limit}, return_state=True)
    assert state.is_failed() and state.name == "TimedOut", f"{state.name}: {state.message}"
    with pytest.raises(TimeoutError, match=message) as raised:
        state.result()
    assert type(raised.value).__name__ == error
    assert len(ATTEMPTS) == 1, "a timed-out stage is not retried: the retry would block as long again"
    assert not SLEPT_OUT, "the blocked call slept its full course: the interrupt never reached it"
    assert stage_outcomes(str(state.state_details.flow_run_id))[0] == {"blocks": "TimedOut"}
    assert stopped == ["spark and ray"], "the run's hook stopped its Spark and Ray, as a cancel's does"
    assert CHILDREN[0].wait(timeout=60) == -signal.SIGTERM, "what the run started was ended with it"


def test_a_deadline_interrupts_a_blocking_call_in_the_main_thread_and_a_loop_in_another() -> None:
    from imagelake.infra.deadline import StageTimedOut, deadline

    SLEPT_OUT.clear()
    with pytest.raises(StageTimedOut, match="past"):
        with deadline(0.3, StageTimedOut("ran past its limit")):
            time.sleep(BLOCK_SECONDS)
            SLEPT_OUT.append(1)
    assert not SLEPT_OUT, "the blocked call slept its full course: the interrupt never reached it"
    raised: list[BaseException] = []

    def loop() -> None:
        try:
            with deadline(0.3, StageTimedOut("ran past its limit in a thread")):
                while True:
                    time.sleep(0.05)  # a thread is interrupted between two bytecodes: a loop, not one long call
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            raised.append(exc)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    thread.join(BLOCK_SECONDS)
    assert [type(exc) for exc in raised] == [StageTimedOut]
    with deadline(60, StageTimedOut("never")):
        pass  # a deadline not reached changes nothing


def _holds(settings: Settings, what: str, held: threading.Event, done: threading.Event) -> None:
    with one_at_a_time(settings, what):
        held.set()
        done.wait(60)


def test_a_second_holder_gives_up_after_its_wait_and_names_the_first(tmp_path: Path) -> None:
    settings = load_settings(overrides={"workspace": str(tmp_path / "ws")})
    held, done = threading.Event(), threading.Event()
    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # no Prefect API: the file lock is the lock
        first = threading.Thread(target=_holds, args=(settings, "train-x", held, done), daemon=True)
        first.start()
        try:
            assert held.wait(30)
            with pytest.raises(
                TimeoutError, match=rf"pid {os.getpid()} on {re.escape(socket.gethostname())}.* since .*cancel"
            ) as raised:
                with one_at_a_time(settings, "train-x", timeout=0.5):
                    pass
            assert "outside any flow run" in str(raised.value) and "train_lock_wait_minutes" in str(raised.value)
        finally:
            done.set()
            first.join(30)
        assert not list((settings.workspace_dir / "locks").glob("*.holder")), (
            "the first let go: no record of it is left to name"
        )
        with one_at_a_time(settings, "train-x", timeout=5):
            pass


@flow(name="holds-a-lock")
def holds_a_lock(settings: Settings, what: str, held_path: str, done_path: str) -> None:
    with one_at_a_time(settings, what):
        Path(held_path).write_text(str(FlowRunContext.get().flow_run.id))
        deadline = time.monotonic() + 60
        while not Path(done_path).exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def test_a_run_on_another_host_gives_up_after_its_wait_and_names_the_flow_run_holding_the_lock(
    prefect_api: str, tmp_path: Path
) -> None:
    from imagelake.infra.holders import shared_record

    # Two hosts: their own workspaces (no file lock in common), one Prefect server.
    here = load_settings(overrides={"workspace": str(tmp_path / "a"), "prefect_api_url": prefect_api})
    there = load_settings(overrides={"workspace": str(tmp_path / "b"), "prefect_api_url": prefect_api})
    held, done = tmp_path / "held", tmp_path / "done"
    first = threading.Thread(target=holds_a_lock, args=(here, "cache-y", str(held), str(done)), daemon=True)
    first.start()
    try:
        deadline = time.monotonic() + 60
        while not held.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        flow_run_id = held.read_text()
        with pytest.raises(TimeoutError, match=rf"flow run '[^']+' \({flow_run_id}\) of holds-a-lock.*cancel"):
            with one_at_a_time(there, "cache-y", timeout=2):
                pass
    finally:
        done.touch()
        first.join(60)
    assert shared_record(prefect_api, lock_name("cache-y")) is None, (
        "the holder let go: no record of it is left to name"
    )


def test_no_timeout_or_lock_wait_enters_a_cache_key_or_a_ray_run_name() -> None:
    import importlib

    from prefect import Task

    from imagelake.tasks.rules.training import TRAINING_SETTINGS
    from imagelake.tasks.stage import StageKey, key_parts

    timing = {name for name in Settings.model_fields if "timeout" in name or "lock_wait" in name}
    assert {"flow_timeout_hours", "stage_timeout_minutes", "train_timeout_minutes", "train_lock_wait_minutes"} <= timing
    stages = [
        value
        for name in (
            "ingest",
            "resize",
            "write",
            "split",
            "cache",
            "train",
            "promote",
            "score",
            "summary",
            "retention",
            "maintain",
        )
        for value in vars(importlib.import_module(f"imagelake.tasks.stages.{name}")).values()
        if isinstance(value, Task) and isinstance(value.cache_policy, StageKey)
    ]
    for task in stages:
        assert not timing & set(task.cache_policy.settings_fields), task.name
    assert not timing & set(TRAINING_SETTINGS)
    train = next(task for task in stages if task.name == "train")
    shorter = load_settings(overrides={name: 2 if "timeout" in name else 1 for name in timing})
    fields = train.cache_policy.settings_fields
    assert key_parts(train.fn, {"settings": load_settings()}, fields) == key_parts(
        train.fn, {"settings": shorter}, fields
    )


def test_a_lock_wait_must_end_before_its_stage_s_timeout() -> None:
    with pytest.raises(SettingsError, match="train_lock_wait_minutes=360.*train_timeout_minutes=60"):
        load_settings(overrides={"train_timeout_minutes": 60})
    load_settings(overrides={"train_timeout_minutes": 60, "train_lock_wait_minutes": 30})


def test_a_git_that_does_not_answer_never_fails_the_commit_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The promote stage tags the model with the code's commit: a git that hangs (a slow disk, a locked index) gives
    "unknown" or the commit with "-status-unknown", within the bound, never an error."""
    from imagelake.infra import tracking

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "git").write_text(
        '#!/bin/sh\n[ "$1" = rev-parse ] && [ -z "$HANG_REV_PARSE" ] && { echo 0123abcd; exit 0; }\nexec sleep 5\n'
    )
    (fake / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(tracking, "GIT_SECONDS", 0.5)
    assert tracking.git_commit() == "0123abcd-status-unknown"
    monkeypatch.setenv("HANG_REV_PARSE", "1")
    assert tracking.git_commit() == "unknown"
