"""Prefect's API and result storage for a run, from settings."""

from __future__ import annotations

import contextlib
from typing import Iterator

from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings

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


def prefect_api_in_use(settings: Settings) -> str | None:
    """The Prefect API URL runs will talk to, or None for Prefect's ephemeral local server."""
    if settings.prefect_api_url:
        return settings.prefect_api_url
    return PREFECT_API_URL.value() or None
