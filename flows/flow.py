"""What every imagelake flow shares: one decorator, with the run's lifecycle hooks."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from prefect import flow

from infra.lifecycle import release_compute, watch_worker

F = TypeVar("F", bound=Callable[..., Any])


def imagelake_flow(name: str) -> Callable[[F], F]:
    """A Prefect flow whose prints go to its run's log; a run a worker started ends as Crashed if that worker dies, and a
    cancelled or crashed run stops the Spark and Ray it started (see infra/lifecycle.py)."""
    return flow(name=name, log_prints=True, on_running=[watch_worker], on_cancellation=[release_compute], on_crashed=[release_compute])  # type: ignore[return-value]
