"""Real servers for tests: a `prefect server start` (SQLite) and process workers, on 127.0.0.1 only, stopped by the
tests; the requests the Prefect UI sends (also used by bench/load.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx

from imagelake.infra.local.cluster import LEASES_KEPT, NO_MLFLOW_JOBS, free_port
from tests.conftest import PROCESS_POOL, REPO, cli_env

BIN = Path(sys.executable).parent


def wait_http(url: str, timeout: float, process: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Wait until URL answers 200; fail early (with the log) if the process that should serve it has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"{process.args[0]} exited {process.returncode} before {url} "
                f"answered:\n{log.read_text()[-4000:] if log else ''}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s:\n{log.read_text()[-4000:] if log else ''}")


BUSY = {429, 503}  # a Prefect server's "try again": rate-limited, or a retryable database error (SQLite busy)


class PatientClient(httpx.Client):
    """An httpx client for a server under the suite's load: it asks again, as Prefect's own client does, when the server
    answers that it is busy (429, 503: nothing was done) and, for a request that only reads (GET, a POST to a
    `/filter` query), when the answer does not come in time. A request that writes is never sent twice after a timeout
    (it may have been done). Each retry is printed; after `patience` seconds the last answer or error stands."""

    def __init__(self, *args, patience: float = 180, backoff: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.patience, self.backoff = patience, backoff

    def send(self, request: httpx.Request, **kwargs) -> httpx.Response:
        reads = request.method == "GET" or (request.method == "POST" and request.url.path.endswith("/filter"))
        deadline, attempt = time.monotonic() + self.patience, 0
        while True:
            attempt += 1
            try:
                response = super().send(request, **kwargs)
            except (httpx.ReadTimeout, httpx.PoolTimeout) as slow:
                if not reads or time.monotonic() > deadline:
                    raise
                print(f"{request.method} {request.url.path}: {type(slow).__name__} (attempt {attempt}), asking again")
                continue
            if response.status_code not in BUSY or time.monotonic() > deadline:
                return response
            print(f"{request.method} {request.url.path}: {response.status_code} (attempt {attempt}), asking again")
            response.close()
            time.sleep(self.backoff * min(attempt, 10))


# A Prefect worker given SIGTERM with its runs' processes around it never ended within 15 s in the suite's teardowns
# (15.02 s each, three of them in one run): it is killed after a short grace instead, as everything else is after 15.
WORKER_GRACE = 3.0


def stop_group(process: subprocess.Popen, grace: float = 15) -> None:
    """Stop a process started with start_new_session=True and everything it started."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # children that outlived their parent, too
    except ProcessLookupError:
        pass
    process.wait(grace)


class PrefectServer:
    """`prefect server start` on a free loopback port, with its own home and SQLite database under `root`."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_url = f"{self.url}/api"
        self.log = root / "prefect-server.log"
        self.process: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a client, worker or flow run that talks to this server."""
        env = cli_env(
            {
                "PREFECT_HOME": str(self.root / "prefect-home"),
                "PREFECT_API_URL": self.api_url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.root / 'prefect.db'}",
                "PREFECT_UI_API_URL": self.api_url,
            }
        )
        env.pop("PREFECT_PROFILES_PATH", None)
        env.update(extra or {})
        return env

    def start(self, timeout: float = 120, leases_kept: bool = True) -> PrefectServer:
        """Start (or start again) the server; with LEASES_KEPT, its concurrency leases on disk as imagelake's own
        servers keep them, else in memory (Prefect's default)."""
        self.root.mkdir(parents=True, exist_ok=True)
        env = self.env(LEASES_KEPT if leases_kept else None)
        env.pop("PREFECT_API_URL")  # the server itself must not think it is a client of another
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_http(f"{self.api_url}/health", timeout, self.process, self.log)
        return self

    def prefect(
        self, *args: str, timeout: float = 300, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """Run a `prefect` CLI command against this server from the repository root; fail with its output."""
        done = subprocess.run(
            [str(BIN / "prefect"), "--no-prompt", *args],
            cwd=REPO,
            env=self.env(extra_env),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, (
            f"prefect {' '.join(args)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
        return done

    def create_pool(self, pool: str) -> None:
        """The process work pool POOL with imagelake's job template (`make worker`'s): a run may set neither its
        command, nor its working folder, nor its environment."""
        self.prefect("work-pool", "create", pool, "--type", "process", "--base-job-template", str(REPO / PROCESS_POOL))

    def start_worker(self, pool: str, log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        """A process worker for POOL, run from the repository root (where the deployments' entrypoints are), which its
        runs' pull step (prefect.yaml) finds through IMAGELAKE_HOME. It polls every 5 s rather than Prefect's 10, so a
        run starts soon after it is created (each poll writes to SQLite, so not too often)."""
        with log.open("w") as out:
            worker = subprocess.Popen(
                [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"],
                cwd=REPO,
                env=self.env({"IMAGELAKE_HOME": str(REPO), "PREFECT_WORKER_QUERY_SECONDS": "5", **(extra_env or {})}),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.workers.append(worker)
        return worker

    def stop(self) -> None:
        for worker in self.workers:
            stop_group(worker, WORKER_GRACE)
        if self.process is not None:
            stop_group(self.process)


class MlflowServer:
    """`mlflow server` on 127.0.0.1: a tracking server on a SQLite file, or (artifacts_only) an artifact store alone,
    its files in ROOT, so that a stopped server started again on the same port serves what it served before."""

    def __init__(self, root: Path, artifacts_only: bool = False) -> None:
        self.root, self.artifacts_only = root, artifacts_only
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        store = (
            ["--artifacts-only"]
            if self.artifacts_only
            else ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
        )
        log = self.root / "mlflow.log"
        self.process = subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--artifacts-destination",
                str(self.root / "artifacts"),
                *store,
            ],
            stdout=log.open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=cli_env(NO_MLFLOW_JOBS),
            cwd=self.root,
        )
        wait_http(f"{self.url}/health", 120, self.process, log)
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)
            self.process = None


def custom_run_body(deployment: dict, parameters: dict, name: str) -> dict:
    """The body the Prefect UI (v2) POSTs to /deployments/{id}/create_flow_run when its "Custom run" form is
    submitted."""
    return {
        "name": name,
        "work_queue_name": deployment["work_queue_name"],
        "empirical_policy": {
            "resuming": False,
            "max_retries": 0,
            "retry_delay_seconds": 0,
            "retries": 0,
            "retry_delay": 0,
        },
        "state": {
            "type": "SCHEDULED",
            "state_details": {
                "pause_reschedule": False,
                "deferred": False,
                "untrackable_result": False,
                "scheduled_time": None,
            },
            "message": "",
        },
        "tags": [],
        "job_variables": deployment["job_variables"],
        "enforce_parameter_schema": deployment["enforce_parameter_schema"],
        "parameters": parameters,
    }


def form_defaults(deployment: dict) -> dict:
    """The adhoc form's fields with the defaults of the deployment's parameter schema (what the UI shows before any
    edit)."""
    fields = deployment["parameter_openapi_schema"]["definitions"]["RunParameters"]["properties"]
    return {name: field.get("default") for name, field in fields.items()}
