"""What every imagelake flow shares: one decorator, with the run's lifecycle hooks."""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from prefect import flow
from prefect.context import FlowRunContext
from prefect.utilities.hashing import file_hash

from imagelake.infra.deadline import Deadline, FlowTimedOut, deadline
from imagelake.infra.lifecycle import release_after_timeout, release_compute, watch_worker
from imagelake.infra.run_policy import refuse_job_variables, refuse_unsafe, refuse_unsafe_file
from imagelake.infra.settings import Settings, load_settings
from imagelake.infra.tracking import bind_credentials
from imagelake.tasks.progress import stage_logger

F = TypeVar("F", bound=Callable[..., Any])

# The deadline of the flow run this code runs in, with that run's id: run_settings arms it.
_flow_deadline: contextvars.ContextVar[tuple[Deadline, str] | None] = contextvars.ContextVar(
    "imagelake_flow_deadline", default=None
)


def imagelake_flow(name: str) -> Callable[[F], F]:
    """A Prefect flow whose prints go to its run's log; a run a worker started ends as Crashed if that worker dies, a
    cancelled or crashed run stops the Spark and Ray it started, and so does one that ran past a time limit (its own,
    flow_timeout_hours from its settings, a stage's or a lock wait's), which ends TimedOut (see infra/lifecycle.py)."""

    def declare(fn: F) -> F:
        return flow(  # type: ignore[return-value]
            time_limited(fn),
            name=name,
            version=flow_version(fn),
            log_prints=True,
            on_running=[watch_worker],
            on_failure=[release_after_timeout],
            on_cancellation=[release_compute],
            on_crashed=[release_compute],
        )

    return declare


def time_limited(fn: F) -> F:
    """FN under a deadline that the run's settings arm once read (run_settings): Prefect's own flow timeout is fixed
    before the run starts, and its alarm cannot end a ray.get() (infra/deadline.py)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        context = FlowRunContext.get()
        with deadline() as scope:
            token = _flow_deadline.set(
                (scope, str(context.flow_run.id)) if context is not None and context.flow_run else None
            )
            try:
                return fn(*args, **kwargs)
            finally:
                _flow_deadline.reset(token)

    # Prefect validates a run's parameters against the annotations of the function it is given, evaluated in that
    # function's module: this one's, where the flow's own types (a form's model) are not defined. Hence FN's, resolved.
    run.__signature__ = resolved_signature(fn)  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def resolved_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """FN's signature with its annotations evaluated in FN's module (as written, where one cannot be evaluated yet)."""
    try:
        return inspect.signature(fn, eval_str=True)
    except (NameError, TypeError, SyntaxError):
        return inspect.signature(fn)


def flow_version(fn: Callable[..., Any]) -> str | None:
    """Prefect's default version of a flow, a digest of its file: FN's file, not that of the wrapper around it."""
    try:
        path = inspect.getsourcefile(fn)
        return file_hash(path) if path else None
    except (TypeError, OSError):
        return None


def run_settings(config_file: str | None, overrides: dict[str, Any] | None, **fixed: Any) -> Settings:
    """A flow's settings from its `config_file` and `overrides` parameters (then FIXED), checked by
    check_run_parameters; MLflow's credentials kept for the servers they were configured for (bind_credentials); the
    run's time limit, flow_timeout_hours, runs from here."""
    check_run_parameters(config_file, overrides)
    settings = load_settings(config_file, {**(overrides or {}), **fixed})
    unbound = bind_credentials(settings, load_settings(config_file))
    if unbound:
        stage_logger().warning(unbound)
    arm_flow_deadline(settings)
    return settings


def check_weights(settings: Settings) -> None:
    """Before any data stage of a run that trains: the pretrained weights its settings name are in torchvision's cache
    with the publisher's digest (else WeightsUnavailable, never retried, naming the file and what to do). Weights
    imagelake knows by name and digest (infra/weights.py:KNOWN) that are in the cache are checked without torch, as is
    a run from scratch or from a state dict: only the others load torchvision here (seconds at every run's start)."""
    from imagelake.infra.weights import checkpoints_dir, is_weights_name, known_setting, verified_file

    if not is_weights_name(settings.pretrained):
        return  # from scratch, or a state dict's path: read (and checked) where the model is built
    entry = known_setting(settings.model_arch, settings.pretrained)
    if entry is not None and (checkpoints_dir() / entry.file).is_file():
        verified_file(entry.file, settings.pretrained, entry.url)
        return
    from imagelake.tasks.worker.model import pretrained_source  # names torchvision's file; downloads it where it can

    pretrained_source(settings.model_arch, settings.pretrained)


def arm_flow_deadline(settings: Settings) -> None:
    """Start the clock of the flow run this runs in: past flow_timeout_hours it is stopped and fails TimedOut."""
    held, context = _flow_deadline.get(), FlowRunContext.get()
    hours = settings.flow_timeout_hours
    if (
        held is None
        or context is None
        or context.flow_run is None
        or held[1] != str(context.flow_run.id)
        or hours is None
    ):
        return  # not in an imagelake flow's own run (a test's flow, a plain call), or no limit
    run = context.flow_run
    held[0].arm(
        hours * 3600,
        FlowTimedOut(
            f"flow run {run.name!r} ({run.id}) of {context.flow.name} ran past flow_timeout_hours={hours:g} "
            "and was stopped; its Spark and Ray are released as for a cancel. If it was working rather than stuck "
            "(on a hung mount, a Spark or Ray job that no longer moves), raise flow_timeout_hours in the worker's "
            "settings (a run may set at most 24)"
        ),
    )


def check_run_parameters(config_file: str | None, overrides: dict[str, Any] | None) -> None:
    """When the run came from a deployment (the UI, a schedule, the API), its `overrides` and a settings file it names
    outside the code may set only what infra/run_policy.py:ALLOWED_FROM_RUNS allows, within RUN_LIMITS: where the
    worker connects, keeps data or loads code from comes from the worker alone (infra/run_policy.py:refuse_unsafe)."""
    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None:
        where = f"the parameters of a deployment run ({context.flow_run.name})"
        refuse_job_variables(context.flow_run.job_variables, f"a deployment run ({context.flow_run.name})")
        refuse_unsafe(overrides, where)
        refuse_unsafe_file(config_file, where)
