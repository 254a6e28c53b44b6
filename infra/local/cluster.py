"""A whole cluster on this machine, 127.0.0.1 only: what `make cluster-up` / `make cluster-down` run.

Spark standalone (a master and two workers, from the pyspark installation's own launch classes, with Spark's shared
secret authentication), Ray (a head and one more node, `ray start`, with Ray's token authentication), a PostgreSQL
server (infra/local/postgres.py, its data in <folder>/postgres), an MLflow tracking server (runs in PostgreSQL, an
artifacts folder, basic authentication) and a Prefect server (its database in PostgreSQL, with an API auth string).
`--database sqlite` keeps both servers on SQLite files in the folder instead. Every process it starts is in a
session the folder's state.json records, and carries IMAGELAKE_CLUSTER=<folder> in its environment, so `down` finds
and stops all of them, the Spark executors and Ray workers they started included.

The addresses and the generated credentials go to <folder>/cluster.env (mode 0600), for a shell to load (the
PostgreSQL password is for the servers alone: clients get everything else, `client_env`):
    set -a; . .imagelake/cluster/cluster.env; set +a; unset IMAGELAKE_CLUSTER_POSTGRES_PASSWORD
    imagelake run --config infra/clusters/local.yaml --source ...
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from base64 import b64encode
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from imagelake.infra.java import ensure_java
from imagelake.infra.lifecycle import processes_with, stop_processes
from imagelake.infra.local import postgres

# For the Prefect servers imagelake starts: leases kept on disk, so that a server restart neither drops a live holder's
# lease nor leaves a slot taken that no lease holds (Prefect's default keeps them in the server's memory).
LEASES_KEPT = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}
# For the MLflow servers imagelake starts: no job runner. MLflow's server otherwise starts a job runner and a Huey
# consumer process for each kind of job it can run (GenAI evaluation, trace rollups); imagelake submits none of them,
# and they cost a start seconds and every server tens of seconds of CPU (bench/mlflow_server.py).
NO_MLFLOW_JOBS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}

CLUSTER_VARIABLE = "IMAGELAKE_CLUSTER"
BIN = Path(sys.executable).parent
DEFAULT_ROOT = Path(".imagelake/cluster")
# A driver joining a Ray on 127.0.0.1 needs this, or Ray swaps the address for the machine's routable one.
LOOPBACK_RAY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
MLFLOW_USER = "imagelake"  # the pipeline's own MLflow user (not the admin)
PREFECT_USER = "imagelake"
POSTGRES_PASSWORD = "IMAGELAKE_CLUSTER_POSTGRES_PASSWORD"  # in cluster.env and the servers' environment, nowhere else
# Spark's shared secret (spark.authenticate), in Spark's own variable: the master's, the workers' and the driver's
# environment (infra/spark.py); each worker hands it to the executors it starts in the same variable.
SPARK_AUTH_SECRET = "_SPARK_AUTH_SECRET"
DATABASES = ("postgres", "sqlite")


class ClusterError(RuntimeError):
    """The local cluster cannot start or answer; the message says which part and where its log is."""


@dataclass
class Ports:
    """The cluster's ports; the defaults are the ones infra/clusters/local.yaml names."""

    spark: int = 7077
    spark_ui: int = 8080
    spark_workers_ui: tuple[int, int] = (8081, 8082)
    ray: int = 6380
    mlflow: int = 5050
    prefect: int = 4250
    ray_client: int = 10001
    postgres: int = 5450

    @classmethod
    def free(cls) -> Ports:
        """Ports nothing listens on now (tests run beside a developer's own cluster)."""
        spark, spark_ui, worker_1, worker_2, ray, mlflow, prefect, ray_client, pg = free_ports(9)
        return cls(
            spark=spark,
            spark_ui=spark_ui,
            spark_workers_ui=(worker_1, worker_2),
            ray=ray,
            mlflow=mlflow,
            prefect=prefect,
            ray_client=ray_client,
            postgres=pg,
        )


@dataclass
class Cluster:
    """Where the cluster's parts listen and keep their files (state.json in the cluster folder)."""

    root: str
    ports: Ports
    ray_temp_dir: str
    started_at: float = 0.0
    sessions: list[int] = field(default_factory=list)
    database: str = "postgres"
    compute: bool = True  # False: the servers alone (PostgreSQL, MLflow, Prefect); runs bring their own Spark and Ray

    @property
    def postgres_data(self) -> Path:
        return Path(self.root) / "postgres"

    @property
    def spark_master(self) -> str:
        return f"spark://127.0.0.1:{self.ports.spark}"

    @property
    def spark_ui(self) -> str:
        return f"http://127.0.0.1:{self.ports.spark_ui}"

    @property
    def ray_address(self) -> str:
        return f"127.0.0.1:{self.ports.ray}"

    @property
    def ray_client_address(self) -> str:
        """Ray Client's address (ray://), for drivers that are not on a Ray node."""
        return f"ray://127.0.0.1:{self.ports.ray_client}"

    @property
    def mlflow_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.mlflow}"

    @property
    def prefect_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.prefect}"

    @property
    def env_file(self) -> Path:
        return Path(self.root) / "cluster.env"

    def settings_env(self) -> dict[str, str]:
        """The addresses, as IMAGELAKE_* and PREFECT_* variables (no secrets)."""
        compute = (
            {"IMAGELAKE_SPARK_MASTER": self.spark_master, "IMAGELAKE_RAY_ADDRESS": self.ray_address}
            if self.compute
            else {}
        )
        return {
            **compute,
            "IMAGELAKE_MLFLOW_TRACKING_URI": self.mlflow_url,
            "IMAGELAKE_MLFLOW_UI_URL": self.mlflow_url,
            "IMAGELAKE_PREFECT_API_URL": f"{self.prefect_url}/api",
            "PREFECT_API_URL": f"{self.prefect_url}/api",
            LOOPBACK_RAY: "0",
        }

    def credentials(self) -> dict[str, str]:
        """The generated credentials, as the clients read them from the environment."""
        return read_env_file(
            self.env_file,
            only=(
                "MLFLOW_TRACKING_USERNAME",
                "MLFLOW_TRACKING_PASSWORD",
                "PREFECT_API_AUTH_STRING",
                "RAY_AUTH_TOKEN",
                SPARK_AUTH_SECRET,
            ),
        )

    def client_env(self) -> dict[str, str]:
        """Everything a client of this cluster needs in its environment (the database's password is not for clients)."""
        return {name: value for name, value in read_env_file(self.env_file).items() if name != POSTGRES_PASSWORD}

    def database_urls(self, password: str) -> dict[str, str]:
        """The MLflow and Prefect servers' database URLs (they hold the password: servers' environment only)."""
        if self.database == "sqlite":
            return {
                "mlflow": f"sqlite:///{Path(self.root) / 'mlflow.db'}",
                "prefect": f"sqlite+aiosqlite:///{Path(self.root) / 'prefect.db'}",
            }
        return {
            "mlflow": postgres.url(self.ports.postgres, password, "mlflow"),
            "prefect": postgres.url(self.ports.postgres, password, "prefect", driver="asyncpg"),
        }


def free_ports(count: int) -> list[int]:
    """COUNT different loopback ports nothing listens on, below the kernel's range for ephemeral ports: the cluster's
    parts start one after another, and a port from that range (what binding port 0 gives) can be taken meanwhile by any
    process that binds one, Ray's many workers included."""
    bounds = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(bounds.read_text().split()[0]) if bounds.exists() else 32768
    found: list[int] = []
    for port in random.Random().sample(range(max(1024, low - 12000), low), 2000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise ClusterError(f"fewer than {count} free loopback ports between {max(1024, low - 12000)} and {low}")


def free_port() -> int:
    return free_ports(1)[0]


def read_env_file(path: Path, only: tuple[str, ...] | None = None) -> dict[str, str]:
    """NAME=value lines of a cluster.env file (comments skipped)."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and "=" in line:
            name, value = line.split("=", 1)
            if only is None or name in only:
                values[name.strip()] = value.strip().strip("'")
    return values


def _state_file(root: Path) -> Path:
    return root / "state.json"


def load(root: Path = DEFAULT_ROOT) -> Cluster:
    """The cluster last started in ROOT."""
    path = _state_file(root.resolve())
    if not path.exists():
        raise ClusterError(
            f"no cluster state in {path}: start one with `make cluster-up` (python -m imagelake.infra.local.cluster up)"
        )
    data = json.loads(path.read_text())
    ports = data.pop("ports")
    ports["spark_workers_ui"] = tuple(ports["spark_workers_ui"])
    return Cluster(
        ports=Ports(**ports), **{name: value for name, value in data.items() if name in Cluster.__dataclass_fields__}
    )


_RECORDING = threading.Lock()  # the parts start at once: one at a time records its process in the state file


def _save(cluster: Cluster) -> None:
    _state_file(Path(cluster.root)).write_text(json.dumps(asdict(cluster), indent=2))


def _record(cluster: Cluster, pid: int) -> None:
    """Add a started part's process (its session) to the cluster's state file, which `down` reads."""
    with _RECORDING:
        cluster.sessions.append(pid)
        _save(cluster)


def _at_once(*starts) -> None:
    """Run the parts' starts side by side (each mostly waits for its process to answer) and wait for all of them; the
    first failure is raised once every start has ended, so that `down` finds each process that did start."""
    if not starts:
        return
    with ThreadPoolExecutor(max_workers=len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    for future in futures:
        future.result()


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (it holds credentials)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(path, 0o600)


RAY_AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")  # Ray's token authentication, in every Ray process's environment


def _base_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in list(env):
        # A developer's own Prefect, MLflow or imagelake settings must not leak into the cluster's servers.
        if name.startswith(
            ("PREFECT_", "MLFLOW_", "IMAGELAKE_", "RAY_ADDRESS", "RAY_AUTH", LOOPBACK_RAY, SPARK_AUTH_SECRET)
        ):
            env.pop(name)
    env[CLUSTER_VARIABLE] = str(root)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _spawn(
    name: str, args: list[str], root: Path, env: dict[str, str], cluster: Cluster, user: str | None = None
) -> subprocess.Popen:
    """Start one part in a session of its own (recorded: `down` stops the whole session), output in
    <root>/logs/<name>.log;
    as USER when one is given (this process being root)."""
    log = root / "logs" / f"{name}.log"
    with log.open("a") as out:
        process = subprocess.Popen(
            args,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=root,
            user=user,
        )
    _record(cluster, process.pid)
    return process


def _wait(what: str, check, timeout: float, root: Path, log: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None and process.returncode != 0:
            break
        try:
            if check():
                return
        except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
            pass
        time.sleep(0.5)
    raise ClusterError(f"{what} did not come up within {timeout:.0f} s; {_log_tail(root, log)}")


def _log_tail(root: Path, log: str) -> str:
    """Where a server's log is, and its last lines, for an error that says the server did not answer."""
    path = root / "logs" / f"{log}.log"
    return f"its log is {path}:\n{path.read_text()[-3000:] if path.exists() else ''}"


def http_json(url: str, auth: tuple[str, str] | None = None, data: dict | None = None, timeout: float = 30) -> dict:
    """GET (or POST data as JSON) and decode the JSON answer. The servers answer in well under a second when the
    machine is free; the default timeout leaves room for a machine busy with other work (a first request with a
    password pays a slow hash)."""
    request = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None)
    request.add_header("Content-Type", "application/json")
    if auth:
        request.add_header("Authorization", "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body else {}


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status == 200
    except OSError:  # refused, reset or an HTTP error status
        return False


def running(root: Path = DEFAULT_ROOT) -> list:
    """The live processes of the cluster in ROOT: in a session it started, or marked in their environment.

    Both, because Ray's agents overwrite their environment when they set their process title, and a process
    may leave its session (the Spark executors and Ray workers do not).
    """
    import psutil

    root = root.resolve()
    sessions, since = set(), 0.0
    if _state_file(root).exists():
        state = json.loads(_state_file(root).read_text())
        sessions, since = set(state.get("sessions", [])), state.get("started_at", 0.0)
    found = {process.pid: process for process in processes_with(CLUSTER_VARIABLE, str(root))}
    for process in psutil.process_iter():
        try:
            # A session id is a pid, which the system reuses: only processes started since the cluster was count.
            if (
                process.pid not in found
                and os.getsid(process.pid) in sessions
                and process.create_time() >= since - 1
                and process.status() != psutil.STATUS_ZOMBIE
            ):
                found[process.pid] = process
        except (OSError, psutil.Error):
            continue
    return list(found.values())


def up(
    root: Path = DEFAULT_ROOT,
    ports: Ports | None = None,
    timeout: float = 180,
    database: str = "postgres",
    compute: bool = True,
) -> Cluster:
    """Start every part (without Spark and Ray when not COMPUTE), wait until each answers, write cluster.env; on any
    failure stop what started."""
    if database not in DATABASES:
        raise ClusterError(f"database {database!r}: use one of {', '.join(DATABASES)}")
    root = root.resolve()
    if running(root):
        raise ClusterError(f"a cluster is already running from {root}: stop it first (make cluster-down)")
    (root / "logs").mkdir(parents=True, exist_ok=True)
    ports = ports or Ports()
    # Ray's socket paths must stay short (Unix sockets allow ~107 bytes), so its session folder lives in /tmp.
    cluster = Cluster(
        root=str(root),
        ports=ports,
        ray_temp_dir=tempfile.mkdtemp(prefix="imagelake-ray-"),
        started_at=time.time(),
        database=database,
        compute=compute,
    )
    # A cluster started again in the same folder keeps its runs and models, and so its MLflow user and the passwords.
    earlier = read_env_file(cluster.env_file) if cluster.env_file.exists() else {}
    mlflow_password = (
        (root / "mlflow-auth.db").exists() and earlier.get("MLFLOW_TRACKING_PASSWORD") or secrets.token_urlsafe(24)
    )
    database_password = (cluster.postgres_data / "PG_VERSION").exists() and earlier.get(POSTGRES_PASSWORD)
    if database == "postgres" and (cluster.postgres_data / "PG_VERSION").exists() and not database_password:
        raise ClusterError(
            f"the PostgreSQL data in {cluster.postgres_data} is from an earlier cluster whose password "
            f"{cluster.env_file} no longer holds: remove {root} to start afresh"
        )
    database_password = database_password or secrets.token_urlsafe(24)
    if database == "postgres":
        postgres.check_reachable(cluster.postgres_data, postgres.service_user())
    _save(cluster)
    prefect_token = secrets.token_urlsafe(24)
    # Ray's own token authentication: every node, driver and Ray Client must present it (the nodes hold the MLflow
    # password).
    ray_auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # Spark's own authentication (spark.authenticate): the master, the workers, their executors and every driver share
    # this secret; the master refuses a driver or worker without it.
    spark_secret = secrets.token_hex(32)
    write_private(
        cluster.env_file,
        "# imagelake local cluster (written by `make cluster-up`; holds credentials, keep it private)\n"
        + "".join(f"{name}={value}\n" for name, value in cluster.settings_env().items())
        + f"MLFLOW_TRACKING_USERNAME={MLFLOW_USER}\nMLFLOW_TRACKING_PASSWORD={mlflow_password}\n"
        + f"PREFECT_API_AUTH_STRING={PREFECT_USER}:{prefect_token}\n"
        + "".join(f"{name}={value}\n" for name, value in ray_auth.items())
        + (f"{SPARK_AUTH_SECRET}={spark_secret}\n" if compute else "")
        + "# The servers' database password (the MLflow and Prefect servers use it; clients need not and do not "
        + "get it).\n"
        + f"{POSTGRES_PASSWORD}={database_password}\n",
    )
    ray_env = {"MLFLOW_TRACKING_USERNAME": MLFLOW_USER, "MLFLOW_TRACKING_PASSWORD": mlflow_password, **ray_auth}
    urls = cluster.database_urls(database_password)
    try:

        def servers() -> None:  # the MLflow and Prefect servers need the database, and nothing else
            if database == "postgres":
                _start_postgres(cluster, timeout, database_password)
            _at_once(
                lambda: _start_mlflow(cluster, timeout, mlflow_password, urls["mlflow"]),
                lambda: _start_prefect(cluster, timeout, f"{PREFECT_USER}:{prefect_token}", urls["prefect"]),
            )

        # Spark, Ray and the servers need nothing of each other: they start side by side (bench/startup.py --cluster).
        _at_once(
            *([lambda: _start_spark(cluster, timeout, spark_secret)] if compute else []),
            *([lambda: _start_ray(cluster, timeout, ray_env)] if compute else []),
            servers,
        )
    except BaseException:
        down(root)
        raise
    return cluster


def _start_spark(cluster: Cluster, timeout: float, secret: str) -> None:
    """The master and the workers, with Spark's authentication on: the secret in their environment (never a command
    line), where Spark reads it first; the setting that turns it on in a properties file."""
    import pyspark

    root = Path(cluster.root)
    spark_home = Path(pyspark.__file__).parent
    env = _base_env(root)
    env.update(
        SPARK_HOME=str(spark_home),
        JAVA_HOME=str(ensure_java()),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(root / "logs"),
        SPARK_NO_DAEMONIZE="1",
        PYSPARK_PYTHON=sys.executable,
    )
    env[SPARK_AUTH_SECRET] = secret
    properties = root / "spark.conf"
    write_private(properties, "spark.authenticate true\n")
    spark_class = str(spark_home / "bin" / "spark-class")
    master = _spawn(
        "spark-master",
        [
            spark_class,
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            str(cluster.ports.spark),
            "--webui-port",
            str(cluster.ports.spark_ui),
            "--properties-file",
            str(properties),
        ],
        root,
        env,
        cluster,
    )
    _wait("the Spark master", lambda: _answers(f"{cluster.spark_ui}/json/"), timeout, root, "spark-master", master)
    for number, ui_port in enumerate(cluster.ports.spark_workers_ui, start=1):
        work = root / f"spark-worker-{number}"
        work.mkdir(exist_ok=True)
        _spawn(
            f"spark-worker-{number}",
            [
                spark_class,
                "org.apache.spark.deploy.worker.Worker",
                cluster.spark_master,
                "--host",
                "127.0.0.1",
                "--cores",
                "1",
                "--memory",
                "3g",
                "--webui-port",
                str(ui_port),
                "--work-dir",
                str(work),
                "--properties-file",
                str(properties),
            ],
            root,
            env,
            cluster,
        )
    workers = cluster.ports.spark_workers_ui
    _wait(
        f"{len(workers)} Spark workers",
        lambda: sum(w["state"] == "ALIVE" for w in http_json(f"{cluster.spark_ui}/json/")["workers"]) == len(workers),
        timeout,
        root,
        "spark-worker-2",
    )


def _start_ray(cluster: Cluster, timeout: float, node_env: dict[str, str]) -> None:
    root = Path(cluster.root)
    env = _base_env(root)
    # Each node passes these to the training workers it starts: rank 0 logs to the MLflow server with them,
    # as a real cluster's nodes get them from its secret store.
    env.update(node_env)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    common = [
        "--num-cpus",
        "2",
        "--num-gpus",
        "0",
        "--object-store-memory",
        str(400 * 1024 * 1024),
        "--disable-usage-stats",
    ]
    # `ray start` swaps 127.0.0.1 for the machine's routable address (so that other machines can join) and then
    # listens on every interface. Told that this Ray stays on one machine, the head keeps loopback; the second
    # node is `ray start` too, run so that it keeps the loopback addresses it is given (see ray_start_loopback).
    head_env = {**env, LOOPBACK_RAY: "0"}
    head = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(cluster.ports.ray),
        "--include-dashboard",
        "false",
        "--temp-dir",
        cluster.ray_temp_dir,
        "--ray-client-server-port",
        str(cluster.ports.ray_client),
        *common,
    ]
    node = [
        sys.executable,
        "-m",
        "imagelake.infra.local.cluster",
        "ray-start-loopback",
        "--address",
        cluster.ray_address,
        "--node-ip-address",
        "127.0.0.1",
        *common,
    ]
    for name, args, part_env in (("ray-head", head, head_env), ("ray-node-2", node, env)):
        started = _spawn(name, args, root, part_env, cluster)
        try:
            started.wait(90)
        except subprocess.TimeoutExpired:
            raise ClusterError(
                f"`ray start` for {name} did not finish in 90 s; its log is {root / 'logs' / (name + '.log')}"
            ) from None
        if started.returncode != 0:
            raise ClusterError(
                f"`ray start` for {name} exited {started.returncode}; its log is {root / 'logs' / (name + '.log')}"
            )
    _wait("2 Ray nodes", lambda: len(ray_nodes(cluster)) == 2, timeout, root, "ray-node-2")


def ray_start_loopback(args: list[str]) -> int:
    """`ray start ARGS` for a node joining a head on this machine, keeping 127.0.0.1 as given (the CLI would swap
    it)."""
    from ray.scripts.scripts import main as ray_main

    from imagelake.infra.compat import keep_ray_loopback

    sys.argv = ["ray", "start", *args]
    with keep_ray_loopback():
        return ray_main()


def ray_nodes(cluster: Cluster) -> list[str]:
    """The ids of the Ray cluster's live nodes (asked through a short-lived driver)."""
    code = (
        f"import json, ray; ray.init(address={cluster.ray_address!r}, logging_level='ERROR', log_to_driver=False); "
        "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))"
    )
    env = _base_env(Path(cluster.root))
    env.pop(CLUSTER_VARIABLE)
    env[LOOPBACK_RAY] = "0"
    env.update(read_env_file(cluster.env_file, only=RAY_AUTH))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ValueError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _start_postgres(cluster: Cluster, timeout: float, password: str) -> None:
    """PostgreSQL on 127.0.0.1 with the `imagelake` role, and the `mlflow` and `prefect` databases."""
    root = Path(cluster.root)
    server = postgres.start(
        cluster.postgres_data,
        cluster.ports.postgres,
        password,
        postgres.service_user(),
        root / "logs" / "postgres.log",
        {CLUSTER_VARIABLE: str(root)},
        timeout,
    )
    _record(cluster, server.pid)


def _start_mlflow(cluster: Cluster, timeout: float, password: str, database: str) -> None:
    root = Path(cluster.root)
    admin_password = secrets.token_urlsafe(24)
    config = root / "mlflow-auth.ini"
    write_private(
        config,
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{root / 'mlflow-auth.db'}\n"
        "admin_username = admin\nauthorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # A checked password is remembered for a minute by the one server process: otherwise each request
        # pays a deliberately slow password hash (0.4 s of a core here). A password changed through the
        # server's API counts at once (it has one worker process).
        "auth_cache_ttl_seconds = 60\n",
    )
    env = _base_env(root)
    # The database URL (with its password) through the environment, never the command line that `ps` shows.
    env.update(
        MLFLOW_AUTH_CONFIG_PATH=str(config),
        MLFLOW_AUTH_ADMIN_PASSWORD=admin_password,
        MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16),
        MLFLOW_BACKEND_STORE_URI=database,
        **NO_MLFLOW_JOBS,
    )
    server = _spawn(
        "mlflow",
        [
            str(BIN / "mlflow"),
            "server",
            "--app-name",
            "basic-auth",
            "--host",
            "127.0.0.1",
            "--port",
            str(cluster.ports.mlflow),
            "--artifacts-destination",
            str(root / "mlartifacts"),
            "--workers",
            "1",
        ],
        root,
        env,
        cluster,
    )
    _wait("the MLflow server", lambda: _answers(f"{cluster.mlflow_url}/health"), timeout, root, "mlflow", server)
    # The pipeline gets a user of its own; the admin's password is used once, here, and written nowhere. On a busy
    # machine the first answers after the health check can take many seconds (two slow password hashes, the first
    # write to the users' database): the call gets the whole start's timeout, not a request's usual few seconds.
    try:
        http_json(
            f"{cluster.mlflow_url}/api/2.0/mlflow/users/create",
            auth=("admin", admin_password),
            data={"username": MLFLOW_USER, "password": password},
            timeout=timeout,
        )
    except TimeoutError:
        raise ClusterError(
            f"the MLflow server answered its health check but not the creation of its user within {timeout:.0f} s; "
            + _log_tail(root, "mlflow")
        ) from None
    except urllib.error.HTTPError as exc:
        # An earlier cluster in this folder made the admin (whose first password alone counts) and the user.
        if exc.code != 401 or not _answers_as(cluster, MLFLOW_USER, password, timeout):
            raise ClusterError(
                f"the MLflow server's users in {root / 'mlflow-auth.db'} are from an earlier cluster whose credentials "
                f"{cluster.env_file} no longer holds: stop the cluster and remove {root} to start afresh"
            ) from None


def _answers_as(cluster: Cluster, user: str, password: str, timeout: float) -> bool:
    try:
        http_json(
            f"{cluster.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1",
            auth=(user, password),
            timeout=timeout,
        )
    except OSError:
        return False
    return True


def _start_prefect(cluster: Cluster, timeout: float, auth_string: str, database: str) -> None:
    root = Path(cluster.root)
    env = _base_env(root)
    # A retryable database error (SQLite busy, a lost connection) reaches clients as a bare 503: the log says which.
    env.update(
        PREFECT_HOME=str(root / "prefect"),
        PREFECT_API_DATABASE_CONNECTION_URL=database,
        PREFECT_API_LOG_RETRYABLE_ERRORS="true",
        PREFECT_SERVER_API_AUTH_STRING=auth_string,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_API_URL=f"{cluster.prefect_url}/api",
        **LEASES_KEPT,
    )
    server = _spawn(
        "prefect",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(cluster.ports.prefect)],
        root,
        env,
        cluster,
    )
    _wait("the Prefect server", lambda: _answers(f"{cluster.prefect_url}/api/health"), timeout, root, "prefect", server)


def down(root: Path = DEFAULT_ROOT, grace: float = 5) -> list[str]:
    """Stop every process of the cluster in ROOT (SIGTERM, then SIGKILL after `grace`); return what was running.

    Spark, MLflow and Prefect end on SIGTERM within a second; Ray's GCS, raylets and agents outwait any grace when
    all go at once, and nothing of theirs needs saving, so the grace is short.
    """
    root = root.resolve()
    found = running(root)
    names = sorted({_describe(process) for process in found})
    # PostgreSQL last, once its clients are gone, with a fast shutdown (SIGINT) that writes a checkpoint: SIGKILL
    # would leave it to recover on the next start.
    data = root / "postgres"
    database = postgres.postmaster_pid(data)
    stop_processes([process for process in found if database is None or _session(process) != database], grace)
    if database is not None and not postgres.stop(data):
        print(f"PostgreSQL ({data}) did not stop within 30 s of a fast shutdown: killing it", file=sys.stderr)
    stop_processes(running(root), 0)  # anything a dying part started meanwhile
    if _state_file(root).exists():
        state = json.loads(_state_file(root).read_text())
        temp = state.get("ray_temp_dir")
        if temp and Path(temp).name.startswith("imagelake-ray-"):
            shutil.rmtree(temp, ignore_errors=True)
        if not running(root):
            # Stopped: forget the sessions, whose ids the system may give to other processes later.
            _state_file(root).write_text(json.dumps({**state, "sessions": []}, indent=2))
    return names


def _session(process) -> int | None:
    try:
        return os.getsid(process.pid)
    except OSError:
        return None


def _describe(process) -> str:
    try:
        return process.name()
    except Exception:  # gone already
        return "?"


def status(root: Path = DEFAULT_ROOT) -> dict:
    """What each part answers now."""
    cluster = load(root)
    report: dict = {"processes": len(running(Path(cluster.root)))}
    try:
        master = http_json(f"{cluster.spark_ui}/json/")
        report["spark"] = {
            "master": cluster.spark_master,
            "ui": cluster.spark_ui,
            "alive_workers": sum(w["state"] == "ALIVE" for w in master["workers"]),
        }
    except OSError as exc:
        report["spark"] = f"not answering: {exc}"
    try:
        report["ray"] = {"address": cluster.ray_address, "nodes": len(ray_nodes(cluster))}
    except (ValueError, subprocess.TimeoutExpired) as exc:
        report["ray"] = f"not answering: {str(exc)[-300:]}"
    if cluster.database == "postgres":
        report["postgres"] = {
            "address": f"127.0.0.1:{cluster.ports.postgres}",
            "data": str(cluster.postgres_data),
            "running": postgres.postmaster_pid(cluster.postgres_data) is not None,
        }
    report["mlflow"] = {"url": cluster.mlflow_url, "healthy": _answers(f"{cluster.mlflow_url}/health")}
    report["prefect"] = {"url": cluster.prefect_url, "healthy": _answers(f"{cluster.prefect_url}/api/health")}
    report["env_file"] = str(cluster.env_file)
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m imagelake.infra.local.cluster", description=__doc__.split("\n\n")[0]
    )
    if argv is None and sys.argv[1:2] == ["ray-start-loopback"]:
        return ray_start_loopback(sys.argv[2:])
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument(
        "--root", type=Path, default=DEFAULT_ROOT, help="the cluster's folder (default .imagelake/cluster)"
    )
    parser.add_argument("--free-ports", action="store_true", help="pick free ports instead of the defaults")
    parser.add_argument(
        "--database",
        choices=DATABASES,
        default="postgres",
        help="where the MLflow and Prefect servers keep their data (default postgres; sqlite: files in the folder)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            cluster = up(args.root, Ports.free() if args.free_ports else None, database=args.database)
            database = f"PostgreSQL 127.0.0.1:{cluster.ports.postgres}" if cluster.database == "postgres" else "SQLite"
            print(
                f"Spark master {cluster.spark_master} (UI {cluster.spark_ui}), Ray {cluster.ray_address}, "
                f"MLflow {cluster.mlflow_url}, Prefect {cluster.prefect_url}, their database {database}"
            )
            print(
                f"addresses and credentials: {cluster.env_file} (load it with: set -a; . {cluster.env_file}; "
                f"set +a; unset {POSTGRES_PASSWORD})"
            )
        elif args.command == "down":
            stopped = down(args.root)
            print(
                f"stopped {len(stopped)} kinds of process: {', '.join(stopped)}"
                if stopped
                else "no cluster process was running"
            )
            left = running(args.root)
            if left:
                print(f"still running: {[p.pid for p in left]}", file=sys.stderr)
                return 1
        else:
            print(json.dumps(status(args.root), indent=2))
    except (ClusterError, postgres.PostgresError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
