"""What every imagelake flow shares: one decorator, with the run's lifecycle hooks."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from prefect import flow
from prefect.context import FlowRunContext

from infra.lifecycle import release_compute, watch_worker
from infra.settings import Settings, load_settings, refuse_unsafe, refuse_unsafe_file

F = TypeVar("F", bound=Callable[..., Any])


def imagelake_flow(name: str) -> Callable[[F], F]:
    """A Prefect flow whose prints go to its run's log; a run a worker started ends as Crashed if that worker dies, and a
    cancelled or crashed run stops the Spark and Ray it started (see infra/lifecycle.py)."""
    return flow(name=name, log_prints=True, on_running=[watch_worker], on_cancellation=[release_compute], on_crashed=[release_compute])  # type: ignore[return-value]


def run_settings(config_file: str | None, overrides: dict[str, Any] | None, **fixed: Any) -> Settings:
    """A flow's settings from its `config_file` and `overrides` parameters (then FIXED), checked by check_run_parameters."""
    check_run_parameters(config_file, overrides)
    return load_settings(config_file, {**(overrides or {}), **fixed})


def check_run_parameters(config_file: str | None, overrides: dict[str, Any] | None) -> None:
    """When the run came from a deployment (the UI, a schedule, the API), its `overrides` and a settings file it names
    outside the code may set only what infra/settings.py:ALLOWED_FROM_RUNS allows, within RUN_LIMITS: where the worker
    connects, keeps data or loads code from comes from the worker alone (infra/settings.py:refuse_unsafe)."""
    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None:
        where = f"the parameters of a deployment run ({context.flow_run.name})"
        refuse_unsafe(overrides, where)
        refuse_unsafe_file(config_file, where)
