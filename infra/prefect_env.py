"""Prefect's API and result storage for a run, from settings."""

from __future__ import annotations

import contextlib
from typing import Iterator

from prefect.context import FlowRunContext
from prefect.filesystems import LocalFileSystem, RemoteFileSystem, WritableFileSystem
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_LOCAL_STORAGE_PATH,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    PREFECT_TASKS_REFRESH_CACHE,
    temporary_settings,
)

from infra.compat import flow_run_context_with_result_storage
from infra.settings import Settings


@contextlib.contextmanager
def prefect_for(settings: Settings) -> Iterator[None]:
    """Results persist under the workspace; the API is the configured server, else Prefect's own default."""
    # No telemetry: an ephemeral server would try to reach the internet on every run.
    updates = {PREFECT_LOCAL_STORAGE_PATH: settings.prefect_results_dir, PREFECT_SERVER_ANALYTICS_ENABLED: False}
    if settings.prefect_api_url:
        updates[PREFECT_API_URL] = settings.prefect_api_url
    with temporary_settings(updates=updates):
        yield


def result_storage(uri: str) -> WritableFileSystem:
    """A Prefect file system for a folder or an fsspec URI (s3://, gs://, abfs://...)."""
    if "://" in uri and not uri.startswith("file://"):
        return RemoteFileSystem(basepath=uri)
    return LocalFileSystem(basepath=uri.removeprefix("file://"))


@contextlib.contextmanager
def stage_results(settings: Settings, refresh: bool = False) -> Iterator[None]:
    """Inside a flow: stages cache their results under settings.results_uri; with refresh, every stage recomputes."""
    context = FlowRunContext.get()
    if context is None:
        raise RuntimeError("stage_results() belongs inside a flow run")
    staged = flow_run_context_with_result_storage(context, result_storage(settings.results_uri))
    # A deployment run gets no say over the worker's Prefect settings: the flow picks the store itself.
    refresh = refresh or bool(PREFECT_TASKS_REFRESH_CACHE.value())  # the environment's PREFECT_TASKS_REFRESH_CACHE still counts
    with staged, temporary_settings(updates={PREFECT_TASKS_REFRESH_CACHE: refresh}):
        yield


def prefect_api_in_use(settings: Settings) -> str | None:
    """The Prefect API URL runs will talk to, or None for Prefect's ephemeral local server."""
    if settings.prefect_api_url:
        return settings.prefect_api_url
    return PREFECT_API_URL.value() or None
