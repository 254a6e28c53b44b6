"""The Prefect and MLflow UIs of one machine (`make ui`), on SQLite files in the workspace or on a PostgreSQL of their
own.

    python -m imagelake.infra.local.ui --workspace .imagelake --database sqlite    # the default: files in the workspace
    python -m imagelake.infra.local.ui --workspace .imagelake --database postgres  # data in <workspace>/ui/postgres

The Prefect API asks for a generated auth string, kept in <workspace>/ui/ui.env (mode 0600), where `make worker` and
clients load it from; it checks CSRF tokens and answers CORS requests from its own UI's origin only (a web page open in
the same browser cannot drive it, and `make worker` runs whatever it is given). The MLflow server takes requests from
its own origin only too. With PostgreSQL, the generated password is kept in the same file and handed to the two servers
through their environment only. Ctrl-C (or SIGTERM) stops both servers, then PostgreSQL.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from imagelake.infra.local import postgres
from imagelake.infra.local.cluster import BIN, DATABASES, LEASES_KEPT, NO_MLFLOW_JOBS, read_env_file, write_private

PASSWORD = "IMAGELAKE_UI_POSTGRES_PASSWORD"
AUTH_STRING = "PREFECT_API_AUTH_STRING"  # the name Prefect's clients read it under: `. ui.env` sets it for them
USER = "imagelake"


def ui_secrets(folder: Path, database: str) -> dict[str, str]:
    """The UI servers' generated secrets, made once and kept in FOLDER/ui.env (mode 0600): the Prefect API's auth string
    and, with PostgreSQL, its password. A PostgreSQL data folder without its password is refused, never re-keyed."""
    folder.mkdir(parents=True, exist_ok=True)
    env_file = folder / "ui.env"
    found = read_env_file(env_file) if env_file.exists() else {}
    if database == "postgres" and (folder / "postgres" / "PG_VERSION").exists() and not found.get(PASSWORD):
        raise postgres.PostgresError(
            f"the PostgreSQL data in {folder / 'postgres'} has no password in {env_file}: remove "
            f"{folder / 'postgres'} to start afresh"
        )
    wanted = [AUTH_STRING] + ([PASSWORD] if database == "postgres" else [])
    made = {
        name: (f"{USER}:" if name == AUTH_STRING else "") + secrets.token_urlsafe(24)
        for name in wanted
        if not found.get(name)
    }
    if made:
        values = {**found, **made}
        header = (
            "# The secrets of `make ui`'s servers (generated; keep them private). A client loads them with\n# "
            f"set -a; . {env_file}; set +a\n"
        )
        write_private(env_file, header + "".join(f"{name}={value}\n" for name, value in values.items()))
    return {**found, **made}


def database_urls(
    workspace: Path, database: str, port: int, password: str | None
) -> tuple[dict[str, str], subprocess.Popen | None]:
    """The MLflow and Prefect servers' database URLs; with PostgreSQL, the server started for them."""
    if database == "sqlite":
        # Prefect's server keeps its own default (a SQLite file in its home folder, as `prefect server start` does).
        return {"mlflow": f"sqlite:///{workspace / 'mlflow.db'}"}, None
    folder = workspace / "ui"
    server = postgres.start(folder / "postgres", port, password, postgres.service_user(), folder / "postgres.log")
    return {
        "mlflow": postgres.url(port, password, "mlflow"),
        "prefect": postgres.url(port, password, "prefect", driver="asyncpg"),
    }, server


def prefect_server_env(env: dict[str, str], auth_string: str, port: int) -> dict[str, str]:
    """The Prefect server's environment: its API behind the auth string, with CSRF checks, CORS for its own UI only,
    and no telemetry."""
    origin = f"http://127.0.0.1:{port}"
    return {
        **env,
        "PREFECT_SERVER_API_AUTH_STRING": auth_string,
        "PREFECT_SERVER_CSRF_PROTECTION_ENABLED": "true",
        "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": origin,
        "PREFECT_UI_API_URL": f"{origin}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no telemetry: imagelake's servers reach nothing outside
        **LEASES_KEPT,
    }


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(
    workspace: Path, database: str, prefect_port: int = 4200, mlflow_port: int = 5000, postgres_port: int = 5440
) -> int:
    workspace = workspace.resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    found = ui_secrets(workspace / "ui", database)
    urls, database_server = database_urls(workspace, database, postgres_port, found.get(PASSWORD))
    env = dict(os.environ)
    prefect_env = prefect_server_env(env, found[AUTH_STRING], prefect_port)
    if "prefect" in urls:
        prefect_env["PREFECT_API_DATABASE_CONNECTION_URL"] = urls["prefect"]
    # The URL (and its password) through the environment, never the command line.
    mlflow_env = {**env, "MLFLOW_BACKEND_STORE_URI": urls["mlflow"], **NO_MLFLOW_JOBS}
    mlflow_origin = f"http://127.0.0.1:{mlflow_port}"
    servers = [
        subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            env=prefect_env,
        ),
        subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "ui",
                "--host",
                "127.0.0.1",
                "--port",
                str(mlflow_port),
                "--cors-allowed-origins",
                mlflow_origin,
                "--default-artifact-root",
                str(workspace / "mlartifacts"),
            ],
            env=mlflow_env,
        ),
    ]
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while all(server.poll() is None for server in servers):
            time.sleep(0.5)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for server in servers:
            if server.poll() is None:
                server.terminate()
        for server in servers:
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
        if database_server is not None:
            postgres.stop(workspace / "ui" / "postgres")
            database_server.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m imagelake.infra.local.ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workspace", type=Path, default=Path(".imagelake"))
    parser.add_argument("--database", choices=DATABASES, default="sqlite")
    parser.add_argument("--prefect-port", type=int, default=4200)
    parser.add_argument("--mlflow-port", type=int, default=5000)
    parser.add_argument("--postgres-port", type=int, default=5440)
    args = parser.parse_args(argv)
    try:
        return serve(args.workspace, args.database, args.prefect_port, args.mlflow_port, args.postgres_port)
    except postgres.PostgresError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
