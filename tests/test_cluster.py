"""The same pipeline on a cluster: Spark standalone, two Ray nodes, an MLflow server with basic auth, a Prefect server.

The module starts the cluster of `make cluster-up` (infra/local/cluster.py) on free loopback ports, with the MLflow and
Prefect servers on its PostgreSQL, runs `imagelake run` against it with infra/clusters/local.yaml and the cluster's
environment file, checks where the work ran, where the servers kept it and that no credential leaked, and stops
the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit

import httpx
import psutil
import pytest

from imagelake.infra.local import cluster as local_cluster
from tests.conftest import REPO, cli_env
from tests.servers import PatientClient

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.alone, pytest.mark.xdist_group("alone-cluster")]

BIN = Path(sys.executable).parent
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


@dataclass
class ClusterRun:
    cluster: local_cluster.Cluster
    workspace: Path
    summary: dict
    output: str
    credentials: dict[str, str] = field(repr=False)  # a failing test's report shows the fixture's repr

    @property
    def mlflow_auth(self) -> tuple[str, str]:
        return self.credentials["MLFLOW_TRACKING_USERNAME"], self.credentials["MLFLOW_TRACKING_PASSWORD"]

    def mlflow(self, path: str, **query: str) -> dict:
        params = "&".join(f"{key}={quote(str(value))}" for key, value in query.items())
        return local_cluster.http_json(
            f"{self.cluster.mlflow_url}/api/2.0/mlflow/{path}?{params}", auth=self.mlflow_auth
        )

    def prefect(self) -> httpx.Client:
        user, token = self.credentials["PREFECT_API_AUTH_STRING"].split(":", 1)
        return PatientClient(base_url=f"{self.cluster.prefect_url}/api", auth=(user, token), timeout=30)

    @property
    def database_password(self) -> str:
        return local_cluster.read_env_file(self.cluster.env_file)[local_cluster.POSTGRES_PASSWORD]

    @property
    def secrets(self) -> list[str]:
        return [
            self.credentials["MLFLOW_TRACKING_PASSWORD"],
            self.credentials["PREFECT_API_AUTH_STRING"].split(":", 1)[1],
            self.database_password,
            self.credentials[local_cluster.SPARK_AUTH_SECRET],
        ]


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path):
    # PostgreSQL refuses root: run by root, it runs as the `postgres` user, which must be able to enter the folder
    # (pytest's own temporary folder is closed to other users).
    root = Path(tempfile.mkdtemp(prefix="imagelake-cluster-"))
    os.chmod(root, 0o711)
    workspace = tmp_path_factory.mktemp("cluster-ws")
    started = local_cluster.up(root, local_cluster.Ports.free())
    try:
        env = cli_env(started.client_env())
        done = subprocess.run(
            [
                str(BIN / "imagelake"),
                "run",
                "--config",
                str(REPO / "infra" / "clusters" / "local.yaml"),
                "--source",
                str(digits_dir),
                "--set",
                f"workspace={workspace}",
                "--set",
                "image_size=16",
                "--set",
                "max_epochs=2",
                "--set",
                "batch_size=16",
                "--json",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            stdin=subprocess.DEVNULL,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"imagelake run on the cluster exited {done.returncode}:\n{output[-6000:]}"
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        yield ClusterRun(started, workspace, summary, output, started.credentials())
    finally:
        local_cluster.down(root)
        shutil.rmtree(root, ignore_errors=True)


def test_every_part_of_the_cluster_listens_on_loopback_only(cluster_run: ClusterRun) -> None:
    processes = local_cluster.running(Path(cluster_run.cluster.root))
    names = {process.name() for process in processes}
    assert {"java", "gcs_server", "raylet", "postgres"} <= names, names
    listening = []
    for process in processes:
        try:
            sockets = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [
            (process.name(), sock.laddr.ip, sock.laddr.port) for sock in sockets if sock.status == psutil.CONN_LISTEN
        ]
    ports = {port for _, _, port in listening}
    ours = cluster_run.cluster.ports
    assert {
        ours.spark,
        ours.spark_ui,
        *ours.spark_workers_ui,
        ours.ray,
        ours.mlflow,
        ours.prefect,
        ours.postgres,
    } <= ports, listening
    exposed = [entry for entry in listening if entry[1] not in LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert not mlflow_job_runners(processes), "the MLflow server runs no job runner: imagelake submits no MLflow job"


def mlflow_job_runners(processes: list[psutil.Process]) -> list[str]:
    """The command lines of MLflow's job runner and Huey consumers among PROCESSES."""
    found = []
    for process in processes:
        try:
            line = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if "mlflow.server.jobs" in line:
            found.append(line)
    return found


def test_the_spark_stages_ran_as_an_application_of_the_standalone_master(cluster_run: ClusterRun) -> None:
    application = cluster_run.summary["spark_application"]
    assert application["master"] == cluster_run.cluster.spark_master
    master = local_cluster.http_json(f"{cluster_run.cluster.spark_ui}/json/")
    apps = {app["id"]: app for app in master["activeapps"] + master["completedapps"]}
    assert application["id"] in apps, f"{application['id']} not among {list(apps)}"
    assert apps[application["id"]]["name"] == "imagelake"
    assert cluster_run.summary["delta_engine"] == "spark", (
        "the cluster reads and merges with Spark's Delta (infra/clusters/local.yaml)"
    )
    # Both workers launched executors for it: each keeps a work folder per application.
    for number in (1, 2):
        work = Path(cluster_run.cluster.root) / f"spark-worker-{number}"
        assert (work / application["id"]).is_dir(), (
            f"worker {number} ran no executor of {application['id']}: {list(work.iterdir())}"
        )


def test_ray_train_placed_its_workers_on_both_ray_nodes(cluster_run: ClusterRun) -> None:
    nodes = local_cluster.ray_nodes(cluster_run.cluster)
    placed = cluster_run.summary["ray_worker_nodes"]
    assert len(nodes) == 2 and len(placed) == 2
    assert set(placed) == set(nodes), f"ranks ran on {placed}; the cluster's nodes are {nodes}"
    # The MLflow run records the same placement (rank 0 logged it).
    run = cluster_run.mlflow("runs/get", run_id=cluster_run.summary["mlflow_run_id"])["run"]
    tags = {tag["key"]: tag["value"] for tag in run["data"]["tags"]}
    assert json.loads(tags["ray_worker_nodes"]) == placed


def test_a_driver_outside_the_ray_cluster_joins_through_ray_client(cluster_run: ClusterRun) -> None:
    # The form infra/clusters/kubernetes.yaml gives ray_address (ray://, KubeRay's head service): a task runs on the
    # cluster.
    code = (
        "import json, ray; from imagelake.infra.settings import load_settings; "
        "from imagelake.infra.ray_runtime import connect_ray; "
        "connect_ray(load_settings(None, {'ray_address': %r})); print(json.dumps([ray.get(ray.remote(lambda: "
        "ray.get_runtime_context().get_node_id()).remote()), len(ray.nodes())]))"
    )
    token = local_cluster.read_env_file(cluster_run.cluster.env_file, only=local_cluster.RAY_AUTH)
    # A Ray Client driver without the token, trying once: the server's answer to its first request is the refusal,
    # which Ray Client logs (at debug level) before it gives up. connect_ray would try three times, and Ray Client
    # three times in each, waiting longer each time: over a minute and a half to say the same.
    refusal = (
        "import logging, ray; logging.getLogger('ray.util.client.worker').setLevel(logging.DEBUG); "
        f"ray.util.connect({cluster_run.cluster.ray_client_address.removeprefix('ray://')!r}, connection_retries=1)"
    )
    tokenless = {name: value for name, value in cli_env().items() if not name.startswith("RAY_AUTH")}
    refused = subprocess.run(
        [sys.executable, "-c", refusal],
        cwd=REPO,
        # How long Ray Client waits after a refused request before it gives up (5 s unless set).
        env={**tokenless, "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0, "Ray refuses a driver without the cluster's token"
    assert "Invalid or missing authentication token" in refused.stdout + refused.stderr, refused.stderr[-3000:]
    done = subprocess.run(
        [sys.executable, "-c", code % cluster_run.cluster.ray_client_address],
        cwd=REPO,
        env=cli_env(token),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:] + ray_client_logs(cluster_run.cluster)
    node, count = json.loads(done.stdout.strip().splitlines()[-1])
    assert count == 2 and node in local_cluster.ray_nodes(cluster_run.cluster)


def test_a_spark_driver_without_the_cluster_s_secret_is_refused_by_the_master(cluster_run: ClusterRun) -> None:
    # A session as infra/spark.py starts one, from a process without the cluster's Spark secret and from one with a
    # wrong secret: the master refuses the driver's connection (the pipeline's driver, which has the secret from
    # cluster.env, ran its application). Each attempt stops at the driver's first refusal (it would retry for a minute).
    cluster = cluster_run.cluster
    overrides = {"spark_master": cluster.spark_master, "spark_driver_memory": "512m"}
    code = (
        "from imagelake.infra.settings import load_settings; from imagelake.infra.spark import spark_session; "
        f"spark_session(load_settings(None, {overrides!r})); print('connected', flush=True)"
    )
    secret = local_cluster.SPARK_AUTH_SECRET
    without = {name: value for name, value in cli_env().items() if name != secret}
    master_log = Path(cluster.root) / "logs" / "spark-master.log"
    assert "SecurityManager: authentication enabled" in master_log.read_text(errors="replace")
    for case, env in (("no secret", without), ("a wrong secret", {**without, secret: "not-the-cluster-secret"})):
        apps = spark_applications(cluster)
        logged = master_log.stat().st_size
        output = spark_driver_until_refused(code, env)
        assert "connected" not in output.splitlines(), (
            f"the master accepted a Spark driver with {case}:\n{output[-3000:]}"
        )
        assert "Failed to connect to master" in output, output[-3000:]
        with master_log.open(errors="replace") as log:
            log.seek(logged)
            said = log.read()
        assert "sasl" in said.lower(), f"the master's log does not say why it refused the driver with {case}:\n{said}"
        assert spark_applications(cluster) == apps, "the refused driver registered an application"


def spark_applications(cluster: local_cluster.Cluster) -> set[str]:
    master = local_cluster.http_json(f"{cluster.spark_ui}/json/")
    return {app["id"] for app in master["activeapps"] + master["completedapps"]}


def spark_driver_until_refused(code: str, env: dict[str, str]) -> str:
    """Run CODE (a Spark driver) until it prints `connected`, says it failed to connect to the master, or ends; stop
    it and its JVM; return its output."""
    import signal
    import threading

    lines: list[str] = []
    with subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    ) as driver:
        # A bound on a driver that says neither (its log is then the failure's message).
        bound = threading.Timer(300, os.killpg, (driver.pid, signal.SIGKILL))
        bound.start()
        try:
            for line in driver.stdout:
                lines.append(line)
                if line.strip() == "connected" or "Failed to connect to master" in line:
                    break
        finally:
            bound.cancel()
            try:
                os.killpg(driver.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return "".join(lines)


def ray_client_logs(cluster: local_cluster.Cluster) -> str:
    """The head's Ray client server logs (the proxy's and each driver's server), for a failed connection's message."""
    logs = sorted(Path(cluster.ray_temp_dir).glob("session_*/logs/ray_client_server*"))
    return "".join(f"\n--- {path.name}\n{path.read_text(errors='replace')[-2000:]}" for path in logs)


def test_the_run_and_the_model_version_are_on_the_mlflow_server_behind_basic_auth(cluster_run: ClusterRun) -> None:
    summary = cluster_run.summary
    run = cluster_run.mlflow("runs/get", run_id=summary["mlflow_run_id"])["run"]
    assert run["info"]["status"] == "FINISHED"
    metrics = {metric["key"] for metric in run["data"]["metrics"]}
    assert {"val_loss", "val_acc", "train_loss"} <= metrics, metrics
    version = cluster_run.mlflow("model-versions/get", name=summary["model_name"], version=summary["model_version"])[
        "model_version"
    ]
    assert version["status"] == "READY"
    # The model's files went through the server's artifact proxy into its artifacts folder.
    assert any((Path(cluster_run.cluster.root) / "mlartifacts").rglob("MLmodel"))
    assert summary["mlflow_run_url"].startswith(cluster_run.cluster.mlflow_url)
    # Without the credentials the server refuses.
    with pytest.raises(urllib.error.HTTPError) as refused:
        local_cluster.http_json(
            f"{cluster_run.cluster.mlflow_url}/api/2.0/mlflow/runs/get?run_id={summary['mlflow_run_id']}"
        )
    assert refused.value.code == 401


def test_the_flow_run_is_on_the_prefect_server(cluster_run: ClusterRun) -> None:
    flow_run_id = cluster_run.summary["flow_run_id"]
    with cluster_run.prefect() as api:
        run = api.get(f"/flow_runs/{flow_run_id}").json()
        assert run["state_type"] == "COMPLETED", run
        flow = api.get(f"/flows/{run['flow_id']}").json()
        assert flow["name"] == "imagelake-pipeline"
        artifacts = api.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).json()
        assert "imagelake-run-summary" in {artifact["key"] for artifact in artifacts}
    assert httpx.get(f"{cluster_run.cluster.prefect_url}/api/flow_runs/{flow_run_id}").status_code == 401


def test_the_mlflow_and_prefect_servers_keep_their_records_in_postgresql(cluster_run: ClusterRun) -> None:
    import psycopg2

    from imagelake.infra.local import postgres

    root, port = Path(cluster_run.cluster.root), cluster_run.cluster.ports.postgres
    with psycopg2.connect(
        host="127.0.0.1", port=port, user=postgres.ROLE, password=cluster_run.database_password, dbname="mlflow"
    ) as db:
        with db.cursor() as cursor:
            cursor.execute("SELECT status FROM runs WHERE run_uuid = %s", (cluster_run.summary["mlflow_run_id"],))
            assert cursor.fetchall() == [("FINISHED",)]
            cursor.execute("SELECT count(*) FROM model_versions WHERE name = %s", (cluster_run.summary["model_name"],))
            assert cursor.fetchone()[0] >= 1
    with psycopg2.connect(
        host="127.0.0.1", port=port, user=postgres.ROLE, password=cluster_run.database_password, dbname="prefect"
    ) as db:
        with db.cursor() as cursor:
            cursor.execute("SELECT state_type FROM flow_run WHERE id = %s", (cluster_run.summary["flow_run_id"],))
            assert cursor.fetchall() == [("COMPLETED",)]
    # No SQLite file beside them; the data folder is the cluster's; a wrong password is refused.
    assert sorted(path.name for path in root.glob("*.db")) == ["mlflow-auth.db"], (
        "only the MLflow server's users stay in SQLite"
    )
    assert (root / "postgres" / "PG_VERSION").exists()
    with pytest.raises(psycopg2.OperationalError, match="password authentication failed"):
        psycopg2.connect(host="127.0.0.1", port=port, user=postgres.ROLE, password="not-the-password", dbname="mlflow")
    # Clients of the cluster never get the database's password.
    assert local_cluster.POSTGRES_PASSWORD not in cluster_run.cluster.client_env()


def all_pages(api: httpx.Client, path: str, page: int = 200) -> list[dict]:
    """Every record of a Prefect /filter endpoint, page by page (each answers at most `page`)."""
    records: list[dict] = []
    while True:
        batch = api.post(path, json={"limit": page, "offset": len(records)}).json()
        records += batch
        if len(batch) < page:
            return records


def found_in_files(secret: str, folders: list[Path], skip: set[Path]) -> list[str]:
    needle = secret.encode()
    hits = []
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_symlink() and path not in skip:
                try:
                    if needle in path.read_bytes():
                        hits.append(str(path))
                except OSError:
                    continue
    return hits


def test_no_credential_appears_in_parameters_artifacts_tags_or_logs(cluster_run: ClusterRun) -> None:
    root = Path(cluster_run.cluster.root)
    texts = {"the run's output": cluster_run.output}
    with cluster_run.prefect() as api:
        runs = api.post("/flow_runs/filter", json={}).json()
        texts["flow run parameters"] = json.dumps([run["parameters"] for run in runs])
        texts["task runs"] = api.post("/task_runs/filter", json={}).text
        texts["Prefect logs"] = json.dumps(all_pages(api, "/logs/filter"))
        texts["Prefect artifacts"] = json.dumps(api.post("/artifacts/filter", json={}).json())
    assert runs and len(texts["Prefect logs"]) > 1000
    experiments = cluster_run.mlflow("experiments/search", max_results=100)["experiments"]
    found = local_cluster.http_json(
        f"{cluster_run.cluster.mlflow_url}/api/2.0/mlflow/runs/search",
        auth=cluster_run.mlflow_auth,
        data={"experiment_ids": [e["experiment_id"] for e in experiments], "max_results": 100},
    )
    texts["MLflow runs (params, tags, metrics)"] = json.dumps(found["runs"])
    texts["MLflow model versions"] = json.dumps(cluster_run.mlflow("model-versions/search", max_results=100))
    assert "ray_worker_nodes" in texts["MLflow runs (params, tags, metrics)"]
    # Every command line of the cluster's processes (what `ps` shows anyone on the machine).
    texts["command lines"] = "\n".join(
        " ".join(process.cmdline()) for process in local_cluster.running(root) if _alive(process)
    )
    folders = [root, cluster_run.workspace, Path(cluster_run.cluster.ray_temp_dir)]
    env_file = cluster_run.cluster.env_file
    for secret in cluster_run.secrets:
        assert len(secret) >= 24
        # The search finds a secret where one is: the environment file that holds them.
        assert found_in_files(secret, [root], set()) == [str(env_file)]
        leaked = [name for name, text in texts.items() if secret in text]
        leaked += found_in_files(secret, folders, {env_file})
        assert not leaked, f"a credential appears in: {leaked}"


def _alive(process: psutil.Process) -> bool:
    try:
        process.cmdline()
    except psutil.Error:
        return False
    return True


@pytest.mark.ends_fixture
def test_cluster_down_leaves_no_process_behind_and_a_start_again_in_its_folder_keeps_its_runs_and_its_mlflow_user(
    cluster_run: ClusterRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Path(cluster_run.cluster.root)
    assert len(local_cluster.running(root)) >= 10
    stopped = local_cluster.down(root)
    assert {"java", "raylet", "gcs_server", "postgres"} <= set(stopped), stopped
    # PostgreSQL went last, by a fast shutdown that wrote its checkpoint (no recovery on the next start).
    assert "database system is shut down" in (root / "logs" / "postgres.log").read_text()
    deadline = time.monotonic() + 30
    while local_cluster.running(root) and time.monotonic() < deadline:  # processes reaped as they exit
        time.sleep(0.1)
    assert local_cluster.running(root) == []
    ray_leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if cluster_run.cluster.ray_temp_dir in " ".join(p.info["cmdline"] or [])
    ]
    assert not ray_leftovers, ray_leftovers
    with pytest.raises(OSError):
        local_cluster.http_json(f"{cluster_run.cluster.spark_ui}/json/", timeout=2)

    # Started again in the same folder: the runs, the MLflow user and the database password are still there. The
    # MLflow server stalls for 7 s right after its first health answer, as on a machine busy with other work: the
    # calls that follow (its user's check) wait for it within the start's timeout.
    database_password = cluster_run.database_password
    stalled = stall_after_first_health(monkeypatch, seconds=7)
    again = local_cluster.up(root, local_cluster.Ports.free())
    try:
        assert stalled, "the MLflow server was stalled after its health check"
        credentials = again.credentials()
        assert credentials["MLFLOW_TRACKING_PASSWORD"] == cluster_run.credentials["MLFLOW_TRACKING_PASSWORD"]
        assert local_cluster.read_env_file(again.env_file)[local_cluster.POSTGRES_PASSWORD] == database_password
        auth = (credentials["MLFLOW_TRACKING_USERNAME"], credentials["MLFLOW_TRACKING_PASSWORD"])
        run = local_cluster.http_json(
            f"{again.mlflow_url}/api/2.0/mlflow/runs/get?run_id={cluster_run.summary['mlflow_run_id']}", auth=auth
        )
        assert run["run"]["info"]["status"] == "FINISHED"
        user, token = credentials["PREFECT_API_AUTH_STRING"].split(":", 1)
        with PatientClient(base_url=f"{again.prefect_url}/api", auth=(user, token), timeout=30) as api:
            flow_run = api.get(f"/flow_runs/{cluster_run.summary['flow_run_id']}")
        assert flow_run.json()["state_type"] == "COMPLETED"
    finally:
        local_cluster.down(root)
    assert local_cluster.running(root) == []


def stall_after_first_health(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[int]:
    """Stop the MLflow server's processes (SIGSTOP) for SECONDS once its health check first answers; the list returned
    gets the stopped process group."""
    answers = local_cluster._answers
    stalled: list[int] = []

    def stall_once(url: str) -> bool:
        ok = answers(url)
        if not ok or stalled or not url.endswith("/health"):
            return ok
        port = str(urlsplit(url).port)
        server = [p for p in psutil.process_iter(["cmdline"]) if {"--app-name", port} <= set(p.info["cmdline"] or [])]
        if server:  # the MLflow server's health (not the Prefect server's)
            group = os.getpgid(server[0].pid)
            os.killpg(group, signal.SIGSTOP)
            stalled.append(group)
            threading.Timer(seconds, os.killpg, (group, signal.SIGCONT)).start()
        return ok

    monkeypatch.setattr(local_cluster, "_answers", stall_once)
    return stalled


def http_status(
    url: str, method: str = "GET", headers: dict | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    """An HTTP request's status, headers (lower-case names) and body, error statuses included."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def check_ui_api_is_closed(prefect: str, auth_string: str, mlflow: str) -> None:
    """`make ui`'s Prefect API answers only with its auth string, takes state changes only with a CSRF token, and
    answers CORS requests from its own origin only; its MLflow server refuses requests from another origin."""
    import base64

    basic = {"Authorization": "Basic " + base64.b64encode(auth_string.encode()).decode()}
    json_body = {"Content-Type": "application/json"}
    assert http_status(f"{prefect}/api/admin/version")[0] == 401, "no auth string, no answer"
    assert (
        http_status(
            f"{prefect}/api/admin/version",
            headers={"Authorization": "Basic " + base64.b64encode(b"imagelake:guess").decode()},
        )[0]
        == 401
    )
    assert http_status(f"{prefect}/api/admin/version", headers=basic)[0] == 200
    assert http_status(f"{prefect}/api/flows/filter", "POST", {**basic, **json_body}, b"{}")[0] == 403, (
        "a state change needs a CSRF token"
    )
    status, _, token = http_status(f"{prefect}/api/csrf-token?client=ui-test", headers=basic)
    assert status == 200
    csrf = {"Prefect-Csrf-Token": json.loads(token)["token"], "Prefect-Csrf-Client": "ui-test"}
    assert http_status(f"{prefect}/api/flows/filter", "POST", {**basic, **json_body, **csrf}, b"{}")[0] == 200
    for origin, allowed in ((prefect, True), ("http://pages.example", False)):
        _, headers, _ = http_status(
            f"{prefect}/api/flows/filter", "OPTIONS", {"Origin": origin, "Access-Control-Request-Method": "POST"}
        )
        assert (headers.get("access-control-allow-origin") == origin) is allowed, (origin, headers)
    refused = http_status(
        f"{mlflow}/api/2.0/mlflow/experiments/create",
        "POST",
        {**json_body, "Origin": "http://pages.example"},
        b'{"name": "x"}',
    )
    assert refused[0] == 403, refused


def test_the_ui_servers_on_postgresql_keep_their_records_there_and_stop_with_it() -> None:
    """`make ui UI_DATABASE=postgres`: both servers on a PostgreSQL of their own, stopped after them on SIGTERM."""
    import signal

    import psycopg2

    from imagelake.infra.local import postgres, ui

    workspace = Path(tempfile.mkdtemp(prefix="imagelake-ui-"))
    os.chmod(workspace, 0o711)
    prefect_port, mlflow_port, database_port = local_cluster.free_ports(3)
    args = [
        "--workspace",
        str(workspace),
        "--database",
        "postgres",
        "--prefect-port",
        str(prefect_port),
        "--mlflow-port",
        str(mlflow_port),
        "--postgres-port",
        str(database_port),
    ]
    env = {name: value for name, value in cli_env().items() if not name.startswith(("PREFECT_", "MLFLOW_"))}
    env["PREFECT_HOME"] = str(workspace / "prefect-home")
    with (workspace / "ui.log").open("w") as log:
        served = subprocess.Popen(
            [sys.executable, "-m", "imagelake.infra.local.ui", *args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while not all(
            local_cluster._answers(url)
            for url in (f"http://127.0.0.1:{prefect_port}/api/health", f"http://127.0.0.1:{mlflow_port}/health")
        ):
            assert served.poll() is None and time.monotonic() < deadline, (workspace / "ui.log").read_text()[-3000:]
            time.sleep(1)
        made = local_cluster.http_json(
            f"http://127.0.0.1:{mlflow_port}/api/2.0/mlflow/experiments/create", data={"name": "kept-in-postgres"}
        )
        runners = mlflow_job_runners(psutil.Process(served.pid).children(recursive=True))
        assert not runners, f"the MLflow server runs no job runner: {runners}"
        secrets_found = local_cluster.read_env_file(workspace / "ui" / "ui.env")
        password, auth_string = secrets_found[ui.PASSWORD], secrets_found[ui.AUTH_STRING]
        assert oct((workspace / "ui" / "ui.env").stat().st_mode & 0o777) == "0o600"
        check_ui_api_is_closed(f"http://127.0.0.1:{prefect_port}", auth_string, f"http://127.0.0.1:{mlflow_port}")
        with psycopg2.connect(
            host="127.0.0.1", port=database_port, user=postgres.ROLE, password=password, dbname="mlflow"
        ) as db:
            with db.cursor() as cursor:
                cursor.execute("SELECT name FROM experiments WHERE experiment_id = %s", (int(made["experiment_id"]),))
                assert cursor.fetchall() == [("kept-in-postgres",)]
        with psycopg2.connect(
            host="127.0.0.1", port=database_port, user=postgres.ROLE, password=password, dbname="prefect"
        ) as db:
            with db.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM alembic_version")
                assert cursor.fetchone()[0] == 1, "the Prefect server made its tables in PostgreSQL"
        assert not (workspace / "mlflow.db").exists()
        os.kill(served.pid, signal.SIGTERM)
        assert served.wait(60) == 0
        assert postgres.postmaster_pid(workspace / "ui" / "postgres") is None
        assert "database system is shut down" in (workspace / "ui" / "postgres.log").read_text()
        assert password not in (workspace / "ui.log").read_text()
    finally:
        if served.poll() is None:
            os.killpg(served.pid, signal.SIGKILL)
        shutil.rmtree(workspace, ignore_errors=True)
