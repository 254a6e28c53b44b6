"""Two runs of the same data at once (a nightly run and an ad-hoc one): each completes, and neither mixes with the
other."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from imagelake.infra.settings import load_settings
from imagelake.infra.tracking import mlflow_client
from imagelake.tasks.data.cache_files import CacheLine
from imagelake.tasks.stages.cache import cache_one_at_a_time, cache_splits, line_key
from imagelake.tasks.stages.split import plan_splits
from tests.conftest import REPO, cli_env
from tests.lake import Lake, copy_digits
from tests.servers import MlflowServer


@pytest.mark.slow
def test_two_runs_of_one_cache_key_at_once_train_once_and_register_one_version(
    spark, lake: Lake, digits_dir: Path, tmp_path: Path, prefect_api: str, ray_local
) -> None:
    import ray

    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        # Two hosts: their own workspaces (no file lock in common), one MLflow server, one Prefect server, one Ray
        # cluster (this process's), shared storage.
        shared = {
            "IMAGELAKE_RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            "IMAGELAKE_MLFLOW_TRACKING_URI": server.url,
            "IMAGELAKE_PREFECT_API_URL": prefect_api,
            "IMAGELAKE_RAY_STORAGE_ROOT": str(tmp_path / "ray"),
            "IMAGELAKE_IMAGE_SIZE": "24",
            "IMAGELAKE_MAX_EPOCHS": "2",
            "IMAGELAKE_NUM_WORKERS": "1",
            "IMAGELAKE_BATCH_SIZE": "16",
        }
        copy_digits(digits_dir, tmp_path / "src", labels=("0", "1", "2"), per_label=12)
        _, _, written = lake.run(tmp_path / "src")
        settings = load_settings(overrides={"workspace": str(tmp_path / "ws"), "image_size": 24})
        cached = cache_splits(spark, plan_splits(spark, written, settings), 24, settings.cache_uri)
        (tmp_path / "cached.json").write_text(cached.model_dump_json())

        go = tmp_path / "go"
        outs = [tmp_path / f"out-{host}.json" for host in ("a", "b")]
        racers = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.train_racer", str(tmp_path / "cached.json"), str(go), str(out)],
                cwd=REPO,
                env=cli_env({**shared, "IMAGELAKE_WORKSPACE": str(tmp_path / f"ws-{out.stem}")}),
            )
            for out in outs
        ]
        deadline = time.monotonic() + 180
        while (
            not all(Path(f"{out}.ready").exists() for out in outs)
            and time.monotonic() < deadline
            and all(r.poll() is None for r in racers)
        ):
            time.sleep(0.1)
        assert all(Path(f"{out}.ready").exists() for out in outs), "both racers ready before the signal: else no race"
        go.touch()
        assert [racer.wait(600) for racer in racers] == [0, 0], "both runs complete"
        a, b = (json.loads(out.read_text()) for out in outs)
        assert a["started"] < b["ended"] and b["started"] < a["ended"], "the two runs overlapped"
        assert a["run"] == b["run"] and a["checkpoint"] == b["checkpoint"], "one trained; the other took its result"
        assert a["version"] == b["version"] and {a["alias"], b["alias"]} == {"champion"}
        client = mlflow_client(
            load_settings(overrides={"mlflow_tracking_uri": server.url, "workspace": str(tmp_path / "ws")})
        )
        assert [v.version for v in client.search_model_versions(f"run_id = '{a['run']}'")] == [a["version"]], (
            "one model version"
        )
        history = client.get_metric_history(a["run"], "val_loss")
        assert sorted(m.step for m in history) == list(range(a["epochs"])), (
            "one training's epochs in the run, not two mixed"
        )
    finally:
        server.stop()


def test_two_runs_caching_one_table_version_at_once_write_it_once(
    spark, lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    """Without the cache line's lock both wrote generation 0's folder at once: Spark's write of one failed, or a
    manifest listed the other's files too (a training then refused it: "holds 41 rows where its table version has
    27")."""
    copy_digits(digits_dir, tmp_path / "src", labels=("0", "1", "2"), per_label=12)
    _, _, written = lake.run(tmp_path / "src")
    settings = load_settings(overrides={"workspace": str(tmp_path / "ws"), "image_size": 24})
    plan = plan_splits(spark, written, settings)
    both = threading.Barrier(2)

    def one_run(_: int):
        both.wait()
        return cache_one_at_a_time(spark, plan, settings)

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(one_run, range(2))
    line = CacheLine(f"{settings.cache_uri.rstrip('/')}/{line_key(plan, settings.image_size, settings.seed)}")
    assert line.problem(plan.version) is None
    assert sorted([first.reused, second.reused]) == [False, True], "one wrote the version, the other reused it"
    assert line.read(plan.version)["test"]["generation"] == 0 and line.versions() == [plan.version]


@pytest.mark.slow
def test_a_prefect_server_restart_keeps_a_live_holder_s_lease_and_a_slot_no_lease_holds_is_named_not_waited_for(
    tmp_path: Path,
) -> None:
    """A lock's holder keeps its Prefect slot across a restart of a server that keeps leases on disk (as imagelake's
    servers do): a second host waits and times out naming it. On a server keeping leases in memory, the restart loses
    the lease and the slot stays taken: the second host names the slot as held by no live lease (with the command to
    free it) instead of waiting for ever."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from imagelake.infra.holders import OrphanedSlot, orphan_check, shared, waiting_for
    from imagelake.infra.lease import LeaseLost, acquire
    from imagelake.infra.prefect_env import ensure_one_slot
    from tests.servers import PrefectServer

    for kept in (True, False):
        server = PrefectServer(tmp_path / f"prefect-{kept}").start(leases_kept=kept)
        try:
            name = f"imagelake-restart-{kept}".lower()
            with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
                ensure_one_slot(name)
            holder = acquire(server.api_url, name, timeout=10, duration=60)
            with shared(server.api_url, name, holder):
                server.stop()
                server.start(leases_kept=kept)
                if kept:
                    holder.check()  # still the holder: the lease outlived the restart
                    assert holder.lost is None
                    continue
                # The holder's record stops being renewed with its lease: a waiter judging by 3 s (3 leases in use)
                # names the orphan rather than wait.
                waiter = orphan_check(server.api_url, name, "the restart test", after_seconds=3)
                with pytest.raises(OrphanedSlot) as raised, waiting_for("the restart test", 30, lambda: None):
                    acquire(server.api_url, name, timeout=30, duration=60, on_busy=waiter)
                with pytest.raises(LeaseLost, match="no longer holds lease"):
                    holder.check()  # the restarted server no longer knows the lease
                free = f"global-concurrency-limit update {name} --active-slots 0"
                assert free in str(raised.value)
                server.prefect(*free.split())  # as the message says: the slot is free again
                acquire(server.api_url, name, timeout=10, duration=60).release()
            holder.release()
        finally:
            server.stop()


def test_a_long_hold_of_a_lock_finds_its_lease_lost_as_it_works_and_its_result_is_fenced(
    prefect_api: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The train lock's check, called as the epochs are reported from another thread: while the lease holds it says
    nothing; once the server has dropped the lease (and another host entered), it says so once, and the fence before
    the result is published refuses it; what it is told to call when the lease is lost (training writes the workers'
    stop marker) is called once."""
    import logging

    from imagelake.infra.lease import LeaseLost, acquire, client_of
    from imagelake.infra.prefect_env import _leases, fence, lease_watch, lock_name, one_at_a_time

    settings = load_settings(overrides={"workspace": str(tmp_path / "ws"), "prefect_api_url": prefect_api})
    logger = logging.getLogger("imagelake.test.lease_watch")
    with one_at_a_time(settings, "train-watched"):
        told: list[str] = []
        watch = lease_watch("train-watched", logger, on_lost=lambda exc: told.append(str(exc)))
        checked = threading.Thread(target=watch)  # as the report thread calls it
        checked.start(), checked.join()
        assert "train-watched" not in caplog.text and not told
        with client_of(prefect_api) as prefect:  # lapsed: the server gives the slot to the next caller
            prefect.release_concurrency_slots_with_lease(_leases.get()["train-watched"].lease_id)
        other = acquire(prefect_api, lock_name("train-watched"), timeout=30)
        try:
            with caplog.at_level(logging.WARNING, logger.name):
                for _ in range(2):
                    checked = threading.Thread(target=watch)
                    checked.start(), checked.join()
            assert caplog.text.count("train-watched: the lock") == 1, caplog.text
            assert len(told) == 1, "the work under way is told once to stop (training: at the end of its epoch)"
            with pytest.raises(LeaseLost, match="may be held by another run now"):
                fence("train-watched")
        finally:
            other.release()
