"""Cancellation and crashes of adhoc deployment runs on a real `prefect server start` with a process worker.

A cancel from the API stops the run's Spark and Ray within 30 s and ends it Cancelled; a run whose worker is killed
ends Crashed and a re-run reuses the stored results of the stages done; a run whose worker and flow-run process both
vanish is marked Crashed by the heartbeat automation. Processes of a run are found by a marker in their environment: the
worker gets it, and everything started for its runs inherits it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import State

from imagelake.infra.lifecycle import (
    CRASH_AUTOMATION,
    HEARTBEAT_SECONDS,
    ensure_crash_detection,
    processes_with,
)
from tests.servers import WORKER_GRACE, PrefectServer, stop_group
from tests.test_summary import report_facts

pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.xdist_group("alone-cancel")]

POOL = "imagelake-process"
MARKER = "CANCEL_TEST_MARKER"
STOP_BOUND = 30.0  # the spec: a cancelled run's Spark jobs and Ray training stop within 30 s
CACHED = ("ingest", "split", "cache")
# What the tests train: the small CNN on one Ray worker (the form's default is MobileNetV2 on two), since what they
# check is how a run stops, crashes and resumes, whatever it trains.
SMALL = {"model_arch": "small_cnn", "num_workers": 1}
# Long enough training that a cancel lands mid-run; small images and batches keep the stages before it short.
LONG_RUN = {"image_size": 32, "max_epochs": 50, "batch_size": 16, **SMALL}
# Crash detection as `make worker` sets it up, but after the fewest missed heartbeats it accepts (2, not its default 3):
# the heartbeat test waits out every missed beat, 30 s each, with the rest of this part waiting behind it.
MISSED = 2


def wait_for(what: str, check: Callable[[], object], timeout: float, interval: float = 0.5) -> object:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries this marker."""
    return processes_with(MARKER, marker)


def describe(processes: list[psutil.Process]) -> list[str]:
    out = []
    for process in processes:
        try:
            out.append(f"{process.pid} {' '.join(process.cmdline())[:100]}")
        except psutil.Error:
            out.append(f"{process.pid} (gone)")
    return out


@dataclass
class Worker:
    """A process worker whose runs write into `workspace` and carry `marker` in their environment."""

    process: subprocess.Popen
    marker: str
    workspace: Path
    log: Path

    def run_processes(self) -> list[psutil.Process]:
        """Everything started for this worker's runs (the flow-run process, Spark's JVM and daemons, Ray's
        processes)."""
        return [p for p in marked(self.marker) if p.pid != self.process.pid]

    def compute_processes(self) -> list[psutil.Process]:
        """The run's own processes, less the short-lived one in which Prefect's runner imports the flow to run its
        hooks."""
        return [p for p in self.run_processes() if not _is_hook_runner(p)]


def _is_hook_runner(process: psutil.Process) -> bool:
    try:
        return (
            any(part.endswith("_workspace_runtime_bootstrap.py") for part in process.cmdline())
            and "hook" in process.cmdline()
        )
    except psutil.Error:
        return False


@dataclass
class Deployed:
    """A server with prefect.yaml deployed, the crash automation, and a client of its API."""

    server: PrefectServer
    client: SyncPrefectClient
    source: Path
    root: Path

    def start_worker(self, name: str, workspace: Path | None = None) -> Worker:
        marker = uuid.uuid4().hex
        workspace = workspace or self.root / f"ws-{name}"
        log = self.root / f"worker-{name}-{marker[:6]}.log"
        env = {
            "IMAGELAKE_WORKSPACE": str(workspace),
            MARKER: marker,
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_SECONDS),
        }
        env["IMAGELAKE_DECODE_IN_DRIVER_UP_TO"] = "0"  # resize on Spark's Python workers, which the tests watch for
        return Worker(self.server.start_worker(POOL, log, env), marker, workspace, log)

    def submit(self, **params: object) -> FlowRun:
        deployment = self.client.read_deployment_by_name("imagelake-adhoc/adhoc")
        return self.client.create_flow_run_from_deployment(
            deployment.id, parameters={"params": {"source": str(self.source), **params}}
        )

    def state(self, flow_run_id: uuid.UUID) -> State:
        return self.client.read_flow_run(flow_run_id).state

    def subflow(self, flow_run_id: uuid.UUID) -> FlowRun | None:
        runs = self.client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
        return runs[0] if runs else None

    def task_states(self, flow_run_id: uuid.UUID) -> dict[str, str]:
        """Stage name -> state name of the pipeline subflow's task runs."""
        subflow = self.subflow(flow_run_id)
        if subflow is None:
            return {}
        runs = self.client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[subflow.id])))
        return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs if run.state is not None}

    def summary(self, flow_run_id: uuid.UUID) -> dict[str, str]:
        """The figures of the pipeline's run-summary artifact (its report), under the JSON summary's names."""
        subflow = self.subflow(flow_run_id)
        found = self.client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["imagelake-run-summary"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[subflow.id]),
            )
        )
        assert len(found) == 1, found
        return report_facts(found[0].data)

    def wait_final(self, flow_run_id: uuid.UUID, timeout: float, worker: Worker | None = None) -> State:
        try:
            return wait_for(
                "a final state", lambda: (s := self.state(flow_run_id)).is_final() and s, timeout, interval=1
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; now {self.state(flow_run_id)!r}\n{_tail(worker)}") from None


def _tail(worker: Worker | None) -> str:
    return worker.log.read_text()[-4000:] if worker is not None and worker.log.exists() else ""


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path) -> Iterator[Deployed]:
    root = tmp_path_factory.mktemp("cancel")
    server = PrefectServer(root / "server").start()
    try:
        server.create_pool(POOL)
        server.prefect("deploy", "--all")
        with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
            ensure_crash_detection(HEARTBEAT_SECONDS, MISSED)
            yield Deployed(server, client, digits_dir, root)
    finally:
        server.stop()


@pytest.fixture
def workers(deployed: Deployed) -> Iterator[list[Worker]]:
    """Workers a test starts; each is stopped with its process group, and its runs' processes after it."""
    started: list[Worker] = []
    yield started
    for worker in started:
        stop_group(worker.process, WORKER_GRACE)
        for process in marked(worker.marker):
            process.kill()


# What shows that a stage is at work: Spark's Python workers run the resize UDFs, Ray's training workers the epochs.
AT_WORK = {"resize": "pyspark.daemon", "train": "RayTrainWorker"}


def wait_until_stage_runs(deployed: Deployed, worker: Worker, flow_run: FlowRun, stage: str) -> None:
    """Until the pipeline's `stage` task run is Running and its Spark or Ray workers exist."""

    def there() -> bool:
        state = deployed.state(flow_run.id)
        assert not state.is_final(), f"the run ended {state!r} before {stage} ran:\n{_tail(worker)}"
        if deployed.task_states(flow_run.id).get(stage) != "Running":
            return False
        return any(AT_WORK[stage] in " ".join(_cmdline(p)) for p in worker.run_processes())

    wait_for(f"{stage} running", there, timeout=420, interval=1)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


# First of the module (the `alone` part runs its tests in file order): most of this test is the automation's wait for
# missed heartbeats, with nothing of its own running, while the cluster and load tests use both cores.
def test_a_run_whose_worker_and_process_vanish_is_marked_crashed_by_the_heartbeat_automation(
    deployed: Deployed, workers: list[Worker]
) -> None:
    worker = deployed.start_worker("vanished")
    workers.append(worker)
    flow_run = deployed.submit(**LONG_RUN)
    wait_until_stage_runs(deployed, worker, flow_run, "resize")
    engine = [p for p in worker.run_processes() if "prefect.engine" in _cmdline(p)]
    assert len(engine) == 1, describe(worker.run_processes())
    assert engine[0].environ().get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY") == str(HEARTBEAT_SECONDS), (
        "the run beats as often as the automation expects"
    )

    started = time.monotonic()
    os.killpg(worker.process.pid, signal.SIGKILL)
    engine[0].kill()  # as if the machine went: nothing is left to report the run's end
    worker.process.wait(10)
    wait_for(
        "Spark's JVM and daemons gone with the flow-run process", lambda: not marked(worker.marker), timeout=STOP_BOUND
    )
    gone_after = time.monotonic() - started
    bound = (
        HEARTBEAT_SECONDS * (MISSED + 1) + 30
    )  # the last beat may be a period old, and the trigger is checked every few s
    final = deployed.wait_final(flow_run.id, timeout=bound)
    print(
        f"\nworker and flow-run process killed: processes gone after {gone_after:.1f} s, run {final.name} "
        f"after {time.monotonic() - started:.1f} s"
    )
    assert final.is_crashed(), repr(final)
    assert "heartbeat" in (final.message or ""), final.message


@pytest.mark.parametrize("stage", ["resize", "train"])
def test_a_cancel_stops_spark_and_ray_within_30_s_and_the_run_ends_cancelled(
    deployed: Deployed, workers: list[Worker], stage: str
) -> None:
    worker = deployed.start_worker(f"cancel-{stage}")
    workers.append(worker)
    flow_run = deployed.submit(**LONG_RUN)
    wait_until_stage_runs(deployed, worker, flow_run, stage)
    before = worker.compute_processes()
    names = " ".join(" ".join(_cmdline(p)) for p in before)
    assert all(part in names for part in ("prefect.engine", "java", AT_WORK[stage])), describe(before)
    if stage == "train":
        assert "raylet" in names and "gcs_server" in names, describe(before)

    started = time.monotonic()
    deployed.client.set_flow_run_state(flow_run.id, State(type=StateType.CANCELLING, name="Cancelling"))
    stopped_after = None
    while time.monotonic() - started < STOP_BOUND and stopped_after is None:
        if not [p for p in before if _alive(p)] and not worker.compute_processes():
            stopped_after = time.monotonic() - started
        time.sleep(0.25)
    left = describe(worker.compute_processes())
    assert stopped_after is not None, f"still running {STOP_BOUND:.0f} s after the cancel: {left}\n{_tail(worker)}"

    final = deployed.wait_final(flow_run.id, timeout=90, worker=worker)
    cancelled_after = time.monotonic() - started
    print(
        f"\ncancel during {stage}: {len(before)} processes gone after {stopped_after:.1f} s, run "
        f"{final.name} after {cancelled_after:.1f} s"
    )
    assert final.is_cancelled(), f"{final!r}\n{_tail(worker)}"
    assert not worker.run_processes(), describe(worker.run_processes())
    # The pipeline subflow: cancelled in-process during Spark work, by the server's cleanup after a cancel during Ray's.
    subflow = deployed.subflow(flow_run.id)
    sub_state = wait_for(
        "the subflow cancelled", lambda: (s := deployed.state(subflow.id)).is_final() and s, timeout=90, interval=1
    )
    print(f"subflow {sub_state.name} after {time.monotonic() - started:.1f} s")
    assert sub_state.is_cancelled(), repr(sub_state)
    assert worker.process.poll() is None, "the worker itself keeps running"


def test_a_run_whose_worker_is_killed_ends_crashed_and_a_rerun_resumes_from_the_cached_stages(
    deployed: Deployed, workers: list[Worker]
) -> None:
    # The small CNN trains an epoch in about a second: 12 leave epochs to resume after the kill at the first checkpoint.
    params = {"image_size": 32, "max_epochs": 12, "batch_size": 16, **SMALL}
    worker = deployed.start_worker("killed")
    workers.append(worker)
    flow_run = deployed.submit(**params)
    wait_until_stage_runs(deployed, worker, flow_run, "train")
    ray_results = worker.workspace / "ray_results"
    # Registered by Ray Train (its snapshot names it), not just a folder being written: only that one is resumed from.
    wait_for(
        "a first checkpoint",
        lambda: (
            list(ray_results.glob("*/checkpoint_*")) and list(ray_results.glob("*/checkpoint_manager_snapshot.json"))
        ),
        timeout=120,
    )
    engine = [p for p in worker.run_processes() if "prefect.engine" in _cmdline(p)]
    assert engine, describe(worker.run_processes())

    started = time.monotonic()
    os.killpg(worker.process.pid, signal.SIGKILL)  # the worker and whatever shares its process group; not the run
    worker.process.wait(10)
    final = deployed.wait_final(flow_run.id, timeout=60, worker=worker)
    crashed_after = time.monotonic() - started
    wait_for("the run's processes gone", lambda: not marked(worker.marker), timeout=STOP_BOUND)
    print(
        f"\nworker killed: run {final.name} ({final.message}) after {crashed_after:.1f} s; processes gone "
        f"after {time.monotonic() - started:.1f} s"
    )
    assert final.is_crashed(), repr(final)

    again = deployed.start_worker("rerun", workspace=worker.workspace)
    workers.append(again)
    started = time.monotonic()
    rerun = deployed.submit(**params)
    done = deployed.wait_final(rerun.id, timeout=480, worker=again)
    states = deployed.task_states(rerun.id)
    print(f"re-run {done.name} after {time.monotonic() - started:.1f} s: {states}")
    assert done.is_completed(), f"{done!r}\n{_tail(again)}"
    # resize and write key on the table's version, which the killed run's write moved: they look again, find
    # every image already there, and decode and write nothing.
    assert {stage: states.get(stage) for stage in CACHED} == dict.fromkeys(CACHED, "Cached"), states
    assert states["resize"] in {"Cached", "Completed"} and states["write"] in {"Cached", "Completed"}, states
    summary = deployed.summary(rerun.id)
    assert (summary["files_decoded"], summary["rows_added"]) == ("0", "0"), summary
    assert states["train"] == "Completed", states
    runs = [path.name for path in ray_results.iterdir() if path.is_dir()]
    assert len(runs) == 1, f"the re-run resumes the killed Ray run instead of starting another: {runs}"
    assert "resumes after epoch" in again.log.read_text(), "the training workers start from the killed run's checkpoint"
    store = f"sqlite:///{worker.workspace / 'mlflow.db'}"
    tracking = MlflowClient(store, store)
    trainings = tracking.search_runs([e.experiment_id for e in tracking.search_experiments()])
    assert [run.info.run_id for run in trainings] == [summary["mlflow_run_id"]], (
        "one MLflow run: the killed training, resumed"
    )


def test_crash_detection_is_set_up_once_and_refuses_settings_that_would_crash_healthy_runs(deployed: Deployed) -> None:
    first = ensure_crash_detection(HEARTBEAT_SECONDS, MISSED)
    assert ensure_crash_detection(HEARTBEAT_SECONDS, MISSED) == first
    assert len(deployed.client.read_automations_by_name(CRASH_AUTOMATION)) == 1
    with pytest.raises(ValueError, match="at least 30"):
        ensure_crash_detection(10)
    with pytest.raises(ValueError, match="missed must be at least 2"):
        ensure_crash_detection(HEARTBEAT_SECONDS, 1)
