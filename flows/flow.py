"""What every imagelake flow shares: one decorator, with the run's lifecycle hooks."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from prefect import flow
from prefect.context import FlowRunContext

from infra.lifecycle import release_compute, watch_worker
from infra.settings import refuse_unsafe

F = TypeVar("F", bound=Callable[..., Any])


def imagelake_flow(name: str) -> Callable[[F], F]:
    """A Prefect flow whose prints go to its run's log; a run a worker started ends as Crashed if that worker dies, and a
    cancelled or crashed run stops the Spark and Ray it started (see infra/lifecycle.py)."""
    return flow(name=name, log_prints=True, on_running=[watch_worker], on_cancellation=[release_compute], on_crashed=[release_compute])  # type: ignore[return-value]


def run_overrides(overrides: dict[str, Any] | None) -> dict[str, Any] | None:
    """A flow's `overrides` parameter, checked when the run came from a deployment (the UI, a schedule, the API): settings
    that can run code or load pickles are refused there (infra/settings.py:refuse_unsafe)."""
    context = FlowRunContext.get()
    if overrides and context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None:
        refuse_unsafe(overrides, f"the parameters of a deployment run ({context.flow_run.name})")
    return overrides
