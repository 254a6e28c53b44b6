"""The Prefect and MLflow UIs of one machine (`make ui`), on SQLite files in the workspace or on a PostgreSQL of their own.

    python -m infra.ui --workspace .imagelake --database sqlite     # the default: files in the workspace
    python -m infra.ui --workspace .imagelake --database postgres   # PostgreSQL, its data in <workspace>/ui/postgres

With PostgreSQL, the generated password is kept in <workspace>/ui/ui.env (mode 0600) and handed to the two servers
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

from infra import postgres
from infra.cluster import BIN, DATABASES, read_env_file, write_private

PASSWORD = "IMAGELAKE_UI_POSTGRES_PASSWORD"


def database_urls(workspace: Path, database: str, port: int) -> tuple[dict[str, str], subprocess.Popen | None]:
    """The MLflow and Prefect servers' database URLs; with PostgreSQL, the server started for them."""
    if database == "sqlite":
        # Prefect's server keeps its own default (a SQLite file in its home folder, as `prefect server start` does).
        return {"mlflow": f"sqlite:///{workspace / 'mlflow.db'}"}, None
    folder = workspace / "ui"
    folder.mkdir(parents=True, exist_ok=True)
    env_file, data, user = folder / "ui.env", folder / "postgres", postgres.service_user()
    password = read_env_file(env_file).get(PASSWORD) if env_file.exists() else None
    if (data / "PG_VERSION").exists() and not password:
        raise postgres.PostgresError(f"the PostgreSQL data in {data} has no password in {env_file}: remove {data} to start afresh")
    if not password:
        password = secrets.token_urlsafe(24)
        write_private(env_file, f"# The UI servers' database password (written by `make ui`; keep it private)\n{PASSWORD}={password}\n")
    server = postgres.start(data, port, password, user, folder / "postgres.log")
    return {"mlflow": postgres.url(port, password, "mlflow"), "prefect": postgres.url(port, password, "prefect", driver="asyncpg")}, server


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve(workspace: Path, database: str, prefect_port: int = 4200, mlflow_port: int = 5000, postgres_port: int = 5440) -> int:
    workspace = workspace.resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    urls, database_server = database_urls(workspace, database, postgres_port)
    env = dict(os.environ)
    prefect_env = {**env, "PREFECT_API_DATABASE_CONNECTION_URL": urls["prefect"]} if "prefect" in urls else env
    # The URL (and its password) through the environment, never the command line.
    mlflow_env = {**env, "MLFLOW_BACKEND_STORE_URI": urls["mlflow"]}
    servers = [
        subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)], env=prefect_env),
        subprocess.Popen([str(BIN / "mlflow"), "ui", "--host", "127.0.0.1", "--port", str(mlflow_port),
                          "--default-artifact-root", str(workspace / "mlartifacts")], env=mlflow_env),
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
    parser = argparse.ArgumentParser(prog="python -m infra.ui", description=__doc__.split("\n\n")[0])
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
