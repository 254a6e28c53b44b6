"""Cancellation and crashes: a flow run's Spark and Ray end with it, an orphaned run ends itself, a silent one is
Crashed.

How a cancel (UI or API) reaches a run that a process worker started, in Prefect 3.8: the worker's runner sees the
Cancelling state, sends SIGTERM to the flow-run process's whole process group (Spark's JVM and a local Ray's daemons
and workers are in it) and waits until the group is gone; it then runs the flow's on_cancellation hooks in a fresh
process (which imports the flow's module first) and records Cancelled, unless the flow-run process recorded a final
state of its own first. Prefect turns the SIGTERM into a TerminationSignal exception in the flow-run process, which
this pipeline's compute does not let through: pyspark's clean-up after an interrupted JVM call talks to the JVM that
the same SIGTERM just stopped, and its error replaces the exception (the stage then retries and fails, and the run
ends Failed); and inside `ray.get()` Ray passes on only KeyboardInterrupt and SystemExit from a signal handler, while
`ray.init()` replaced the handler with one raising SystemExit (the run ends Crashed). Hence:

- `exit_on_cancel` (called by `spark_session` and `connect_ray`): once Spark or Ray runs in a runner-started process,
  a SIGTERM while the run is Cancelling ends the process at once, and the runner records Cancelled; any other SIGTERM
  goes to the handler it replaced, as before.
- `watch_worker` (an on_running hook): a flow-run process whose worker died would go on unsupervised, and nobody
  could cancel it; it interrupts itself instead, so the engine reports Crashed and the hooks below stop Spark and Ray.
- `release_compute` (on_cancellation and on_crashed hooks): stops this process's Spark and Ray, then any process
  still running for the run (everything started for it carries its id in PREFECT__FLOW_RUN_ID).
- `release_after_timeout` (an on_failure hook): the same for a run that failed TimedOut, past its own time limit, a
  stage's or a lock wait's (infra/deadline.py): what it waited on may be a Spark job or a Ray run that no longer moves.

When the flow-run process itself dies at once (SIGKILL, a lost machine), nothing is left to report: for that,
`ensure_crash_detection` creates the server automation that marks a deployment's flow run Crashed once three
heartbeats in a row have not arrived. `make worker` runs `python -m imagelake.infra.lifecycle` to create it. The
deployments
in prefect.yaml set PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 in their runs' environment (job variables), so their runs
beat often enough whatever worker starts them; flows beating at Prefect's default (every 180 s) would be marked
Crashed while they are fine. Only deployment runs are watched, because `imagelake run` flows beat at that default.
Subflow runs carry no deployment, so after a lost machine the pipeline subflow run stays Running under its Crashed
parent.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from uuid import UUID

from imagelake.infra.compat import active_spark_context, instantiated_spark_session
from imagelake.infra.threads import context_thread

# The runner sets it on each flow-run process; Spark's JVM, Ray's processes and their children inherit it.
RUN_ID_VARIABLE = "PREFECT__FLOW_RUN_ID"
CRASH_AUTOMATION = "imagelake: crash deployment runs whose heartbeats stopped"
HEARTBEAT_SECONDS = 30  # Prefect's minimum, and what `make worker` sets
MISSED_HEARTBEATS = 3
STOP_TIMEOUT = 5.0
WATCH_INTERVAL = 1.0

_watch_started = threading.Event()


# --- stopping what a run started -------------------------------------------------------------------------------


def stop_compute(timeout: float = STOP_TIMEOUT) -> tuple[list[str], list[str]]:
    """Cancel and stop this process's Spark and Ray, if it runs any (it never starts them): what stopped, what
    failed."""
    stopped, problems = [], []
    for name, stop in (("spark", _stop_spark), ("ray", _stop_ray)):
        done, problem = _within(timeout, stop)
        if done:
            stopped.append(name)
        if problem:
            problems.append(f"{name}: {problem}")
    return stopped, problems


def _stop_spark() -> bool:
    if "pyspark" not in sys.modules:
        return False
    context = active_spark_context()  # the public getters would create one
    if context is None:
        return False
    try:
        context.cancelAllJobs()
    finally:
        session = instantiated_spark_session()  # stopping the session also forgets it
        (session if session is not None else context).stop()
    return True


def _stop_ray() -> bool:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    ray.shutdown()  # a local Ray that this process started goes with it
    return True


def _within(timeout: float, stop: Callable[[], bool]) -> tuple[bool, str | None]:
    """Run `stop` in a daemon thread: a JVM or raylet that no longer answers must not hold up a cancel or a crash."""
    outcome: list[bool | BaseException] = []

    def attempt() -> None:
        try:
            outcome.append(stop())
        except BaseException as exc:  # reported to the caller; a half-dead JVM raises all sorts
            outcome.append(exc)

    stopping = context_thread(attempt, f"imagelake-{stop.__name__}")
    stopping.start()
    stopping.join(timeout)
    if not outcome:
        return False, f"did not finish within {timeout:.0f} s"
    if isinstance(outcome[0], BaseException):
        return False, f"{type(outcome[0]).__name__}: {str(outcome[0]).strip()[:300]}"
    return outcome[0], None


def _note(message: str) -> None:
    """A line on stderr, which may be a pipe to a worker that is gone (then the line is lost, not raised)."""
    try:
        os.write(2, f"imagelake: {message}\n".encode())
    except OSError:
        pass


def processes_with(variable: str, value: str, spared: frozenset[int] = frozenset()) -> list[Any]:
    """Live processes whose environment sets VARIABLE to VALUE (what a process starts inherits it), but the spared
    pids."""
    import psutil

    found = []
    for process in psutil.process_iter():
        if process.pid in spared:
            continue
        try:
            if process.environ().get(variable) == value:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def run_processes(flow_run_id: str) -> list[Any]:
    """Live processes started for this flow run (by its id in their environment), other than this one and its
    parents."""
    import psutil

    me = psutil.Process()
    return processes_with(RUN_ID_VARIABLE, flow_run_id, frozenset({me.pid, *(parent.pid for parent in me.parents())}))


def reap(flow_run_id: str, grace: float = STOP_TIMEOUT) -> list[str]:
    """SIGTERM every process still running for this flow run, SIGKILL those alive after `grace`; return what was
    there."""
    import psutil

    processes = run_processes(flow_run_id)
    described = []
    for process in processes:
        try:
            described.append(f"{process.name()}[{process.pid}]")
        except psutil.NoSuchProcess:
            continue
    stop_processes(processes, grace)
    return described


def stop_processes(processes: list[Any], grace: float) -> None:
    """SIGTERM these processes, then SIGKILL those still alive after `grace` seconds (a zombie counts as gone)."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    for process in _alive(processes, grace):
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    _alive(processes, grace)


def _alive(processes: list[Any], timeout: float) -> list[Any]:
    """Wait up to `timeout` for the processes to end; return those still running. A process that has exited but
    whose parent has not reaped it yet (a zombie: an orphan waits for the system's init) has ended."""
    import psutil

    def running(process: Any) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    left = [process for process in processes if running(process)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [process for process in left if running(process)]
    return left


def release_compute(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook (on_cancellation, on_crashed; on_failure through release_after_timeout): stop this process's Spark and
    Ray, then whatever still runs for the run."""
    from prefect.logging.loggers import flow_run_logger

    # Only a process that a runner started for one run may stop Spark and Ray outright: in `imagelake run` or a test
    # session they may serve more than this run, and they end with the process anyway.
    # A subflow's hook leaves them alone too: its siblings (a backfill's other dates) share them.
    stopped, problems = stop_compute() if os.environ.get(RUN_ID_VARIABLE) == str(flow_run.id) else ([], [])
    # A subflow shares its process with its parent, whose id the processes carry: the parent's hook reaps them.
    reaped = reap(str(flow_run.id))
    logger = flow_run_logger(flow_run, flow)
    if stopped or reaped:
        logger.warning(
            "%s: stopped %s; ended leftover processes %s",
            state.name,
            ", ".join(stopped) or "nothing in-process",
            reaped or "none",
        )
    for problem in problems:
        logger.warning("%s: could not stop %s (what is left ends with the process)", state.name, problem)


def release_after_timeout(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook (on_failure): a run that failed TimedOut (past flow_timeout_hours, a stage's limit or a lock wait) may
    have left a Spark job or a Ray run going, stuck on what made it late: release them as a cancel does. Other failures
    end the process and its compute with it, as before."""
    if state.name == "TimedOut":
        release_compute(flow, flow_run, state)


# --- a run whose worker died -------------------------------------------------------------------------------------


def watch_worker(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook (on_running): if the worker that started this run dies, end the run as Crashed rather than run on."""
    if os.environ.get(RUN_ID_VARIABLE) != str(flow_run.id):
        return  # not a process a worker or runner started for this run (a subflow, or `imagelake run`)
    parent = os.getppid()
    if parent == 1 or _watch_started.is_set():
        return
    _watch_started.set()
    context_thread(_watch, "imagelake-worker-watch", (parent,)).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL)
    # Orphaned: stdout and stderr were pipes to the dead worker, and writing to them now fails; then interrupt the
    # main thread. SIGINT rather than SIGTERM: ray.get() passes an interrupt on (the engine reports Crashed either
    # way), and pyspark's SIGINT handler cancels the running Spark jobs first.
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


# --- cancelling while Spark or Ray runs -------------------------------------------------------------------------


class _ExitOnCancel:
    """SIGTERM handler of a runner-started flow-run process that runs Spark or Ray (see the module docstring)."""

    def __init__(self, flow_run_id: str, previous: Any) -> None:
        self.flow_run_id = flow_run_id
        self.previous = previous

    def __call__(self, signum: int, frame: Any) -> None:
        if _is_cancelling(self.flow_run_id):
            _note("cancelled: leaving now; the worker records Cancelled")
            # The runner's SIGTERM went to the whole process group, so Spark's JVM and Ray's processes are going
            # too; whatever it missed dies with this process (Ray's kernel fate sharing, the JVM's stdin closing).
            # Status 0, because for a non-zero one the runner would first record Crashed.
            os._exit(0)
        # Any other SIGTERM is a crash, reported by the handler this one replaced (Prefect's, or Ray's SystemExit).
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _is_cancelling(flow_run_id: str, timeout: float = STOP_TIMEOUT) -> bool:
    """Whether the API has this run in Cancelling (or already Cancelled): the SIGTERM is the runner's cancel."""

    def cancelling() -> bool:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(flow_run_id)).state
        return state is not None and (state.is_cancelling() or state.is_cancelled())

    # No answer counts as no: then the handler replaced reports a crash, never a false Cancelled.
    answer, problem = _within(timeout, cancelling)
    if problem:
        _note(f"could not read the run's state from the API ({problem}); treating SIGTERM as a crash")
    return answer


def exit_on_cancel() -> None:
    """In a runner-started flow-run process, make SIGTERM during a cancel end the process at once (idempotent)."""
    flow_run_id = os.environ.get(RUN_ID_VARIABLE)
    if not flow_run_id or threading.current_thread() is not threading.main_thread():
        return  # `imagelake run` and tests keep their handlers; only the main thread may set one
    current = signal.getsignal(signal.SIGTERM)
    if not isinstance(current, _ExitOnCancel):
        signal.signal(signal.SIGTERM, _ExitOnCancel(flow_run_id, current))


# --- runs whose process vanished ---------------------------------------------------------------------------------


def ensure_crash_detection(heartbeat_seconds: int = HEARTBEAT_SECONDS, missed: int = MISSED_HEARTBEATS) -> UUID:
    """Create (or keep, if it matches) the automation marking deployment runs Crashed after `missed` heartbeats; return
    its id."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    if heartbeat_seconds < HEARTBEAT_SECONDS:
        raise ValueError(
            f"heartbeat_seconds must be at least {HEARTBEAT_SECONDS} (Prefect's minimum), got {heartbeat_seconds}"
        )
    if missed < 2:
        raise ValueError(f"missed must be at least 2, or one late heartbeat marks a healthy run Crashed; got {missed}")
    within = timedelta(seconds=heartbeat_seconds * missed)
    automation = AutomationCore(
        name=CRASH_AUTOMATION,
        description=(
            f"Flow runs of deployments beat every {heartbeat_seconds} s; {missed} missed in a row means their "
            "process is gone."
        ),
        trigger=EventTrigger(
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "deployment", "prefect.resource.id": "prefect.deployment.*"},
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=within,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"No heartbeat for {within.total_seconds():.0f} s: its process is gone.",
            )
        ],
    )
    with get_client(sync_client=True) as client:
        for existing in client.read_automations_by_name(CRASH_AUTOMATION):
            same = existing.trigger.model_dump() == automation.trigger.model_dump() and [
                a.model_dump() for a in existing.actions
            ] == [a.model_dump() for a in automation.actions]
            if existing.enabled and same:
                return existing.id
            client.delete_automation(existing.id)
        return client.create_automation(automation)


def main() -> int:
    """`python -m imagelake.infra.lifecycle`: set up crash detection on the configured Prefect server
    (PREFECT_API_URL)."""
    raw = os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_SECONDS))
    if not raw.isdigit() or int(raw) < HEARTBEAT_SECONDS:
        # Checked before Prefect reads its settings, which would fail on this value with a long traceback.
        print(
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY must be a whole number of seconds, at least "
            f"{HEARTBEAT_SECONDS}; got {raw!r}",
            file=sys.stderr,
        )
        return 2
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        print("PREFECT_API_URL is not set: point it at the Prefect server the workers use", file=sys.stderr)
        return 2
    import httpx

    heartbeat = int(raw)
    try:
        automation_id = ensure_crash_detection(heartbeat)
    except httpx.HTTPError as exc:
        print(
            f"cannot set up crash detection on {get_current_settings().api.url}: {exc} (is the server up? `make ui`)",
            file=sys.stderr,
        )
        return 1
    print(
        f"crash detection: automation {automation_id} marks deployment runs Crashed after "
        f"{MISSED_HEARTBEATS * heartbeat} s "
        f"without a heartbeat (prefect.yaml makes deployment runs beat every {HEARTBEAT_SECONDS} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
