"""Prefect's temporary server for a command run without a Prefect API, started before the command's own imports.

Prefect starts one itself when a flow first asks for its API and none is configured: it imports its server's modules
into the flow's process (seconds, only to spawn the server) and then waits while the server starts in a process of
its own, before any work. imagelake's CLI spawns the same server (uvicorn on Prefect's `create_app` factory, the
settings and environment Prefect gives its own) first thing, goes on importing the flow meanwhile, and points the run
at it; the server stops when the command ends. Where an API is configured (settings' `prefect_api_url`,
PREFECT_API_URL, the Prefect profile) or Prefect's ephemeral mode is turned off, nothing is started.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# What Prefect's own temporary server is told (prefect.server.api.server.SubprocessASGIServer): no UI, the ephemeral
# server's services only; and no telemetry (infra/prefect_env.py:prefect_for says the same to the run).
SERVER_ENV = {
    "PREFECT_UI_ENABLED": "0",
    "PREFECT__SERVER_EPHEMERAL": "1",
    "PREFECT__SERVER_FINAL": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


# A server in a fresh Prefect home builds its database before it answers: 17 to 18 s on an idle 2-core machine, and
# longer beside a Spark or Ray job, where Prefect's default of 20 s ran out. While the server's process lives, the
# command waits at least this long (or longer, where PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS says so).
LEAST_STARTUP_WAIT_S = 120.0


class ServerFailed(RuntimeError):
    """Prefect's temporary server did not answer."""


class TemporaryServer:
    """`python -m uvicorn prefect.server.api.server:create_app` on a free port of 127.0.0.1, started at once."""

    def __init__(self) -> None:
        import prefect
        from prefect.settings import get_current_settings

        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True), **SERVER_ENV}
        self.process: subprocess.Popen | None = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--app-dir",
                str(Path(prefect.__file__).parent.parent),
                "--factory",
                "prefect.server.api.server:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ],
            env=env,
        )

    def wait(self) -> str:
        """The API's URL once it answers (within PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, and never less than
        LEAST_STARTUP_WAIT_S); at once an error if the server's process ends first."""
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        timeout = max(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(), LEAST_STARTUP_WAIT_S)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    code = None if self.process is None else self.process.returncode
                    raise ServerFailed(f"Prefect's temporary server on port {self.port} exited (code {code})")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return self.api_url
                time.sleep(0.1)
        self.stop()
        raise ServerFailed(
            f"Prefect's temporary server on port {self.port} did not answer within {timeout:g} s: raise "
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS on a loaded machine, or run a server (`make ui`) and set "
            "PREFECT_API_URL"
        )

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_if_needed(configured_api: str | None) -> TemporaryServer | None:
    """A temporary server, started now, unless a Prefect API is configured (CONFIGURED_API: the settings' own) or
    Prefect's ephemeral mode is off (then Prefect says what to do when the run asks for its API)."""
    if configured_api:
        return None
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return None
    return TemporaryServer()
