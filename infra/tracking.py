"""The MLflow client: tracking and registry URIs and the experiment, from settings; the code's git commit for
provenance."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

from imagelake.infra.settings import Settings, SettingsError

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


# MLflow's credentials in the environment: sent by MLflow to whichever tracking and registry servers it is pointed at.
CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
CREDENTIALS_FILE = Path("~/.mlflow/credentials")


def server_of(uri: str | None) -> str | None:
    """The host and port an MLflow store URI talks to (http, https), without user or password; None for a local store
    (sqlite:, file:, a path)."""
    if not uri or not uri.startswith(("http://", "https://")):
        return None
    parts = urlsplit(uri)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"


def bind_credentials(settings: Settings, configured: Settings) -> str | None:
    """Keep MLflow's credentials for the servers they were configured for: where SETTINGS (a run's, overrides
    included) name a tracking or registry server that CONFIGURED (the worker's or the user's own, without the run's
    overrides) does not, the credential variables leave this process's environment, so that no request of the run,
    nor of a process it starts, carries them there. Returns what it did, for the run's log (None: nothing to do). A
    credentials file (~/.mlflow/credentials), which MLflow would still read, refuses the run instead."""
    own = {server_of(configured.tracking_uri), server_of(configured.mlflow_registry_uri or configured.tracking_uri)}
    named = {server_of(settings.tracking_uri), server_of(settings.mlflow_registry_uri or settings.tracking_uri)}
    others = sorted(server for server in named - own if server)
    if not others:
        return None
    if CREDENTIALS_FILE.expanduser().is_file():
        raise SettingsError(
            f"the run names the MLflow server {', '.join(others)}, not the one the worker's credentials are for, and "
            f"MLflow would send it the credentials of {CREDENTIALS_FILE}: set the tracking URI in the worker's own "
            "settings, or move the credentials into the environment (MLFLOW_TRACKING_USERNAME/PASSWORD)"
        )
    dropped = [name for name in CREDENTIAL_VARIABLES if os.environ.pop(name, None) is not None]
    if not dropped:
        return None
    return (
        f"the run names the MLflow server {', '.join(others)}, not the one the credentials are for: its requests go "
        f"without credentials ({', '.join(dropped)} left out)"
    )


def run_url(client: MlflowClient, settings: Settings, run_id: str) -> str:
    """The MLflow UI's page of a run (at mlflow_ui_url), for links from Prefect."""
    return f"{settings.mlflow_ui_url.rstrip('/')}/#/experiments/{experiment_id(client, settings)}/runs/{run_id}"


def ui_answers(url: str, timeout: float = 0.5) -> bool:
    """Whether anything accepts a connection at URL's host and port (the MLflow UI a summary links to)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.hostname:
        return False
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname, port), timeout):
            return True
    except OSError:
        return False


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
