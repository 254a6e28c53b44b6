"""The MLflow client: tracking and registry URIs and the experiment, from settings; the code's git commit for
provenance."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from imagelake.infra.settings import Settings

if TYPE_CHECKING:  # MLflow loads when a client is asked for (start-up: a run that reuses every stage needs none)
    from mlflow import MlflowClient


def mlflow_client(settings: Settings) -> MlflowClient:
    """Point MLflow at the settings' tracking and registry stores and return a client for them."""
    import mlflow
    from mlflow import MlflowClient

    if not settings.mlflow_tracking_uri:
        settings.workspace_dir.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(settings.tracking_uri)
    mlflow.set_registry_uri(settings.mlflow_registry_uri or settings.tracking_uri)
    return MlflowClient(settings.tracking_uri, settings.mlflow_registry_uri or settings.tracking_uri)


def run_url(client: MlflowClient, settings: Settings, run_id: str) -> str:
    """The MLflow UI's page of a run (at mlflow_ui_url), for links from Prefect."""
    return f"{settings.mlflow_ui_url.rstrip('/')}/#/experiments/{experiment_id(client, settings)}/runs/{run_id}"


def model_version_url(settings: Settings, name: str, version: str) -> str:
    """The MLflow UI's page of a registered model's version (at mlflow_ui_url), for links from Prefect."""
    return (
        f"{settings.mlflow_ui_url.rstrip('/')}/#/models/{quote(name, safe='')}/versions/{quote(str(version), safe='')}"
    )


def experiment_id(client: MlflowClient, settings: Settings) -> str:
    """The experiment's id, creating it (with local artifacts on the embedded store) if needed."""
    found = client.get_experiment_by_name(settings.mlflow_experiment)
    if found is not None:
        return found.experiment_id
    return client.create_experiment(settings.mlflow_experiment, artifact_location=settings.artifact_location)


GIT_SECONDS = 10  # git's answer about the checkout; a slow disk must not fail the stage that asks


def git_commit() -> str:
    """The commit of the code that runs, with "-dirty" when the checkout has changes; "unknown" outside a git checkout
    or when git does not answer, and "-status-unknown" when git names the commit but not the checkout's state in
    GIT_SECONDS."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=GIT_SECONDS, cwd=here)

    try:
        out = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    try:
        dirty = git("status", "--porcelain").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return out.stdout.strip() + "-status-unknown"
    return out.stdout.strip() + ("-dirty" if dirty else "")
