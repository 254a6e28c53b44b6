"""A PostgreSQL server of the project's own, for the Prefect and MLflow servers of `make cluster-up` and `make ui`.

Debian's server programs (the postgresql package, which `make postgres` installs), run by hand: the data folder
lives where the caller says (the cluster folder), the server listens on 127.0.0.1 only (no Unix socket), and its
one role, `imagelake`, has a password that the caller generates and keeps (cluster.env). PostgreSQL refuses to
run as root; run by root, the server runs as the `postgres` user that Debian's package creates, which then owns
the data folder and must be able to reach it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROLE = "imagelake"
DATABASES = ("mlflow", "prefect")  # one for each server
DEBIAN_PROGRAMS = Path("/usr/lib/postgresql")
SERVICE_USER = "postgres"  # the user Debian's package creates


class PostgresError(RuntimeError):
    """PostgreSQL cannot be set up or does not answer; the message says what to do."""


def programs() -> Path:
    """The folder with PostgreSQL's server programs: Debian's newest version, else initdb on the PATH."""
    versions = sorted(
        (path for path in DEBIAN_PROGRAMS.glob("*/bin") if (path / "postgres").exists()),
        key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0,
    )
    if versions:
        return versions[-1]
    found = shutil.which("initdb")
    if found and (Path(found).resolve().parent / "postgres").exists():
        return Path(found).resolve().parent
    raise PostgresError(
        "PostgreSQL's server programs (initdb, postgres) are not installed: run `make postgres` "
        "(Debian's postgresql package), or set the database setting back to sqlite"
    )


def service_user() -> str | None:
    """The user the server runs as: None (this one), or `postgres` when this process is root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        raise PostgresError(
            f"PostgreSQL refuses to run as root and there is no {SERVICE_USER!r} user to run it as: "
            "install Debian's postgresql package (`make postgres`), or start the cluster as another user"
        ) from None
    return SERVICE_USER


def check_reachable(data: Path, user: str | None) -> None:
    """Fail, naming the folder, when USER cannot get through every folder above DATA (it would fail to start)."""
    if user is None:
        return
    uid = pwd.getpwnam(user).pw_uid
    for folder in data.parents:
        info = folder.stat()
        if info.st_uid != uid and not info.st_mode & 0o001:
            raise PostgresError(
                f"PostgreSQL runs as the user {user} (it refuses root), which cannot enter {folder} (mode "
                f"{oct(info.st_mode & 0o777)}) "
                f"on the way to its data folder {data}: use a folder others can enter (chmod o+x {folder}), "
                "or another folder"
            )


def _own(path: Path, user: str | None) -> None:
    if user is not None:
        shutil.chown(path, user, user)


def initialise(data: Path, password: str, user: str | None, log: Path) -> bool:
    """Create the data folder with the `imagelake` role and PASSWORD, unless DATA holds one; say whether it did."""
    if (data / "PG_VERSION").exists():
        return False
    check_reachable(data, user)
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    _own(data, user)
    # initdb reads the password from a file; it exists only while initdb runs, readable by its owner alone.
    secret = data.parent / f".{data.name}-initdb-password"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(password + "\n")
        _own(secret, user)
        with log.open("a") as out:
            done = subprocess.run(
                [
                    str(programs() / "initdb"),
                    "--pgdata",
                    str(data),
                    "--username",
                    ROLE,
                    "--pwfile",
                    str(secret),
                    "--auth-host",
                    "scram-sha-256",
                    "--auth-local",
                    "scram-sha-256",
                    "--encoding",
                    "UTF8",
                    "--no-locale",
                ],
                user=user,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=data,
                env=server_env(data),
                timeout=300,
            )
    finally:
        secret.unlink(missing_ok=True)
    if done.returncode != 0:
        raise PostgresError(f"initdb exited {done.returncode} for {data}; its log is {log}")
    return True


def server_env(data: Path) -> dict[str, str]:
    """A plain environment for PostgreSQL's programs (C locale, home in the data folder's parent)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("PG", "LC_", "LANG"))}
    return {**env, "LC_ALL": "C", "HOME": str(data.parent)}


def server_command(data: Path, port: int) -> list[str]:
    """The server, on 127.0.0.1:PORT only, no Unix socket, its log on standard error."""
    return [
        str(programs() / "postgres"),
        "-D",
        str(data),
        "-p",
        str(port),
        "-c",
        "listen_addresses=127.0.0.1",
        "-c",
        "unix_socket_directories=",
        "-c",
        "logging_collector=off",
        "-c",
        "max_connections=200",
    ]


def start(
    data: Path,
    port: int,
    password: str,
    user: str | None,
    log: Path,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.Popen:
    """Initialise DATA if it is new, start the server in a session of its own (output to LOG, ENV added to its
    environment), wait until it answers and create DATABASES. On failure the server is killed and the error names
    LOG."""
    initialise(data, password, user, log)
    with log.open("a") as out:
        server = subprocess.Popen(
            server_command(data, port),
            env={**server_env(data), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            user=user,
            cwd=data.parent,
        )
    deadline = time.monotonic() + timeout
    while not answers(port, password):
        if server.poll() is not None or time.monotonic() > deadline:
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.wait()
            raise PostgresError(
                f"PostgreSQL did not start on 127.0.0.1:{port} within {timeout:.0f} s; its log is {log}"
            )
        time.sleep(0.3)
    create_databases(port, password, DATABASES)
    return server


def connect(port: int, password: str, database: str = "postgres", timeout: float = 3):
    import psycopg2

    return psycopg2.connect(
        host="127.0.0.1", port=port, user=ROLE, password=password, dbname=database, connect_timeout=int(max(1, timeout))
    )


def answers(port: int, password: str) -> bool:
    import psycopg2

    try:
        connect(port, password).close()
    except psycopg2.OperationalError:
        return False
    return True


def create_databases(port: int, password: str, names: tuple[str, ...]) -> None:
    """Create each database that does not exist yet."""
    connection = connect(port, password)
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            for name in names:
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cursor.fetchone() is None:
                    cursor.execute(f'CREATE DATABASE "{name}"')
    finally:
        connection.close()


def url(port: int, password: str, database: str, driver: str = "") -> str:
    """An SQLAlchemy URL for DATABASE (DRIVER: '' for psycopg2, 'asyncpg' for Prefect's server)."""
    scheme = f"postgresql+{driver}" if driver else "postgresql"
    return f"{scheme}://{ROLE}:{password}@127.0.0.1:{port}/{database}"


def postmaster_pid(data: Path) -> int | None:
    """The running server's pid, from its postmaster.pid (None when it is not running)."""
    import psutil

    try:
        pid = int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if psutil.pid_exists(pid) else None


def stop(data: Path, timeout: float = 30) -> bool:
    """Fast shutdown (SIGINT: sessions end, a checkpoint is written); say whether the server stopped in time."""
    import psutil

    pid = postmaster_pid(data)
    if pid is None:
        return True
    try:
        # The postmaster and every process it started: the last of them (the checkpointer) writes the shutdown's
        # final log line, after the postmaster has removed its pid file.
        server = psutil.Process(pid)
        processes = [server, *server.children(recursive=True)]
        server.send_signal(signal.SIGINT)
    except psutil.NoSuchProcess:
        return True
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not alive
