"""The shared servers under load: a backfill, the nightly deployment twice and ad-hoc runs from the API, all at once.

    .venv/bin/python bench/load.py [--scenario full|small] [--database postgres sqlite] [--keep DIR]

For each database: the servers of `make cluster-up` (infra/local/cluster.py: the MLflow tracking server with basic
authentication and the Prefect server, on PostgreSQL or on SQLite files; each run brings its own Spark and Ray, as
a run of `make run` does), the deployments of prefect.yaml, one process worker, and a landing folder of
YYYY-MM-DD date folders of random images (so that no image repeats another's content). Then, at once: a backfill of
every date (its max_concurrency), the nightly deployment triggered N times, and M custom runs of the adhoc
deployment, each POSTed as the Prefect UI's form does; all on 32 px images, 1 epoch.

A client here does what Prefect's own client does with a busy answer (503, 429): tries again with a growing pause;
what still fails counts as an error. A probe asks the API for flow runs every half second throughout; its latencies
give p50 and p95. Checked and reported: every run's end state (and, for a run that did not complete, whether the
server being busy was the reason), flow runs per minute (subflow runs included), every image of the landing folder
in the table exactly once, one champion with a history row for each move and no half-done move, and no process of
a run left once all ended. The databases' reports are printed side by side, then as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # bench/figures.py, also when imported as bench.load

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from figures import add_record_option, invoked, record  # noqa: E402 - bench/figures.py
from PIL import Image  # noqa: E402

from imagelake.infra.lifecycle import processes_with  # noqa: E402
from imagelake.infra.local import cluster as servers  # noqa: E402
from tests.servers import custom_run_body, form_defaults, stop_group  # noqa: E402

BIN = Path(sys.executable).parent
POOL = "imagelake-process"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
MESSAGE_TAIL = 1500  # characters of each log message a failed run's report keeps: its end, where an exception is
BUSY_STATUSES = {429, 503}
BUSY_WORDS = (
    "database is locked",
    "503 Service Unavailable",
    "Service Unavailable",
    "too many clients",
    "QueuePool limit",
)
SMALL = {"image_size": 32, "max_epochs": 1, "batch_size": 16, "num_workers": 1}


@dataclass(frozen=True)
class Scenario:
    dates: int
    max_concurrency: int
    nightly: int
    adhoc: int
    labels: int = 4
    per_label: int = 3


SCENARIOS = {
    "full": Scenario(dates=20, max_concurrency=4, nightly=2, adhoc=3),
    "small": Scenario(dates=3, max_concurrency=2, nightly=2, adhoc=1),
}


@dataclass
class Report:
    database: str
    scenario: str
    runs: list[dict] = field(
        default_factory=list
    )  # the runs created here: name, end state, seconds, busy (failed for it)
    flow_runs_completed: int = 0  # subflow runs included
    minutes: float = 0.0
    runs_per_minute: float = 0.0
    api_requests: int = 0
    api_p50_ms: float = 0.0
    api_p95_ms: float = 0.0
    busy_answers: int = 0  # 503/429 answers our clients got and retried
    errors: int = 0  # requests that failed after the retries: what a user would have seen
    busy_in_server_log: int = 0  # retryable database errors the Prefect server logged
    images_expected: int = 0
    images_in_table: int = 0
    duplicate_rows: int = 0
    champion: str | None = None
    champion_moves: int = 0
    history_chain_whole: bool = False
    pending_move: bool = False
    left_running: list[str] = field(default_factory=list)

    @property
    def failed_from_busy(self) -> list[str]:
        return [run["name"] for run in self.runs if run["busy"]]

    @property
    def not_completed(self) -> list[str]:
        return [
            f"{run['name']} {run['state']}: {run.get('why', '')}" for run in self.runs if run["state"] != "COMPLETED"
        ]


class Api:
    """The Prefect API as a patient client uses it: a busy answer (503, 429) is tried again after 0.5, 1, 2, 4, 8 s."""

    def __init__(self, url: str, auth: tuple[str, str]) -> None:
        self.http = httpx.Client(base_url=url, auth=auth, timeout=60)
        self.busy = self.errors = 0
        self.lock = threading.Lock()

    def call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        for pause in (0.5, 1, 2, 4, 8, None):
            try:
                response = self.http.request(method, path, json=body)
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code not in BUSY_STATUSES:
                if response.status_code >= 400:
                    self._count(errors=1)
                return response
            self._count(busy=1)
            if pause is None:
                break
            time.sleep(pause)
        self._count(errors=1)
        if response is None:
            raise RuntimeError(f"{method} {path}: no answer after retries")
        return response

    def _count(self, busy: int = 0, errors: int = 0) -> None:
        with self.lock:
            self.busy += busy
            self.errors += errors

    def close(self) -> None:
        self.http.close()


class Probe(threading.Thread):
    """Asks for the latest flow runs every half second; keeps each answer's latency."""

    def __init__(self, api: Api) -> None:
        super().__init__(daemon=True)
        self.api, self.latencies, self.stopped = api, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            started = time.perf_counter()
            response = self.api.call("POST", "/flow_runs/filter", {"limit": 10, "sort": "EXPECTED_START_TIME_DESC"})
            if response.status_code == 200:
                self.latencies.append((time.perf_counter() - started) * 1000)


def write_landing(folder: Path, scenario: Scenario, seed: int = 11) -> int:
    """Random images in folder/date=YYYY-MM-DD/<label>/; return how many."""
    noise, count = np.random.default_rng(seed), 0
    for day in dates(scenario):
        for label in range(scenario.labels):
            target = folder / f"date={day}" / str(label)
            target.mkdir(parents=True, exist_ok=True)
            for number in range(scenario.per_label):
                Image.fromarray(noise.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(target / f"{number}.png")
                count += 1
    return count


def dates(scenario: Scenario) -> list[str]:
    return [f"2024-03-{day:02d}" for day in range(1, scenario.dates + 1)]


def prefect_cli(env: dict[str, str], *args: str) -> None:
    done = subprocess.run(
        [str(BIN / "prefect"), "--no-prompt", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"prefect {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


def run_load(root: Path, database: str, scenario_name: str = "small") -> Report:
    """The scenario on servers started in ROOT with DATABASE; everything it started is stopped before it returns."""
    scenario = SCENARIOS[scenario_name]
    report = Report(database, scenario_name)
    landing, workspace, home = root / "landing", root / "workspace", root / "prefect-home"
    report.images_expected = write_landing(landing, scenario)
    cluster = servers.up(root / "cluster", servers.Ports.free(), database=database, compute=False)
    worker = None
    try:
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("IMAGELAKE_", "PREFECT_", "MLFLOW_"))
        }
        env.update(
            cluster.client_env(),
            PREFECT_HOME=str(home),
            IMAGELAKE_HOME=str(REPO),
            IMAGELAKE_WORKSPACE=str(workspace),
            PREFECT_WORKER_QUERY_SECONDS="5",
        )
        prefect_cli(env, "work-pool", "create", POOL, "--type", "process")
        prefect_cli(env, "deploy", "--all")
        with (root / "worker.log").open("w") as log:
            worker = subprocess.Popen(
                [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process"],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        user, token = env["PREFECT_API_AUTH_STRING"].split(":", 1)
        api = Api(f"{cluster.prefect_url}/api", (user, token))
        probe = Probe(api)
        try:
            probe.start()
            started = time.monotonic()
            created = create_runs(api, landing, scenario)
            ended = wait_until_ended(
                api, created, timeout=600 + 240 * (scenario.dates + scenario.nightly + scenario.adhoc)
            )
            report.minutes = (time.monotonic() - started) / 60
        finally:
            probe.stopped.set()
            probe.join()
        everything = api.call("POST", "/flow_runs/filter", {"limit": 200}).json()
        report.flow_runs_completed = sum(run["state_type"] == "COMPLETED" for run in everything)
        report.runs_per_minute = report.flow_runs_completed / report.minutes
        for run in ended:
            said = (
                run_logs(api, run["id"]) + ((run.get("state") or {}).get("message") or "")
                if run["state_type"] != "COMPLETED"
                else ""
            )
            busy = any(word in said for word in BUSY_WORDS)
            report.runs.append(
                {
                    "name": run["name"],
                    "state": run["state_type"],
                    "seconds": round(run["total_run_time"]),
                    "busy": busy,
                    **({"why": said[:4000]} if said else {}),
                }
            )  # the newest lines first
        report.api_requests = len(probe.latencies)
        if probe.latencies:
            report.api_p50_ms = round(statistics.median(probe.latencies), 1)
            report.api_p95_ms = (
                round(statistics.quantiles(probe.latencies, n=20)[18], 1)
                if len(probe.latencies) >= 20
                else max(probe.latencies)
            )
        report.busy_answers, report.errors = api.busy, api.errors
        api.close()
        check_table(report, workspace, landing)
        check_registry(report, workspace, cluster)
        report.left_running = leftovers(home, worker)
    finally:
        if worker is not None:
            stop_group(worker)
        servers.down(Path(cluster.root))
    log = Path(cluster.root) / "logs" / "prefect.log"
    report.busy_in_server_log = (
        log.read_text(errors="replace").count("Encountered retryable exception") if log.exists() else 0
    )
    return report


def create_runs(api: Api, landing: Path, scenario: Scenario) -> list[str]:
    """The backfill, the nightly runs and the ad-hoc runs, POSTed one after another without waiting."""
    deployment = {
        name: api.call("GET", f"/deployments/name/{flow}/{name}").json()
        for flow, name in (
            ("imagelake-backfill", "backfill"),
            ("imagelake-pipeline", "nightly"),
            ("imagelake-adhoc", "adhoc"),
        )
    }
    bodies = [
        (
            "backfill",
            custom_run_body(
                deployment["backfill"],
                {
                    "source": str(landing),
                    "start_date": dates(scenario)[0],
                    "end_date": dates(scenario)[-1],
                    "max_concurrency": scenario.max_concurrency,
                    "dry_run": False,
                    "overrides": SMALL,
                },
                "load-backfill",
            ),
        )
    ]
    bodies += [
        (
            "nightly",
            custom_run_body(deployment["nightly"], {"source": str(landing), "overrides": SMALL}, f"load-nightly-{n}"),
        )
        for n in range(1, scenario.nightly + 1)
    ]
    adhoc = {**form_defaults(deployment["adhoc"]), **SMALL, "source": str(landing)}
    bodies += [
        ("adhoc", custom_run_body(deployment["adhoc"], {"params": adhoc}, f"load-adhoc-{n}"))
        for n in range(1, scenario.adhoc + 1)
    ]
    ids = []
    for name, body in bodies:
        response = api.call("POST", f"/deployments/{deployment[name]['id']}/create_flow_run", body)
        if response.status_code != 201:
            raise RuntimeError(f"creating {body['name']} answered {response.status_code}: {response.text[:500]}")
        ids.append(response.json()["id"])
    return ids


def wait_until_ended(api: Api, ids: list[str], timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        runs = api.call("POST", "/flow_runs/filter", {"flow_runs": {"id": {"any_": ids}}}).json()
        if all(run["state_type"] in TERMINAL for run in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(3)


def run_logs(api: Api, flow_run_id: str) -> str:
    children = api.call(
        "POST", "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}}
    ).json()
    ids = [flow_run_id, *(child["id"] for child in children)]
    logs = api.call(
        "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": ids}}, "limit": 200, "sort": "TIMESTAMP_DESC"}
    ).json()
    # A traceback's last lines name what failed: each message keeps its end, so that the newest ones, a failed run's
    # traceback first, fit in the report without hiding the exception behind the frames above it.
    return "\n".join(log["message"][-MESSAGE_TAIL:] for log in logs)


def check_table(report: Report, workspace: Path, landing: Path) -> None:
    from imagelake.infra.delta import column_values

    table = workspace / "tables" / "images"
    paths = column_values(str(table), "path") if table.exists() else []  # a table merged by delta-rs as well
    landed = [path for path in paths if f"{landing}/" in path]
    report.images_in_table = len(set(landed))
    report.duplicate_rows = len(landed) - len(set(landed))


def check_registry(report: Report, workspace: Path, cluster: servers.Cluster) -> None:
    from imagelake.infra.settings import load_settings
    from imagelake.infra.tracking import mlflow_client
    from imagelake.tasks.registry.aliases import alias_version
    from imagelake.tasks.registry.moves import PENDING_MOVE
    from imagelake.tasks.rules.promotion import CHAMPION

    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    os.environ.update(servers.read_env_file(cluster.env_file, only=tuple(saved)))
    try:
        settings = load_settings(overrides={"workspace": str(workspace), "mlflow_tracking_uri": cluster.mlflow_url})
        client = mlflow_client(settings)
        report.champion = alias_version(client, settings.model_name, CHAMPION)
        report.pending_move = PENDING_MOVE in client.get_registered_model(settings.model_name).tags
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    from deltalake import DeltaTable

    rows = (
        DeltaTable(settings.history_uri)
        .to_pyarrow_table(columns=["alias", "from_version", "to_version", "at"])
        .to_pylist()
    )
    chain = sorted((row for row in rows if row["alias"] == CHAMPION), key=lambda row: row["at"])
    report.champion_moves = len(chain)
    report.history_chain_whole = (
        bool(chain)
        and chain[-1]["to_version"] == report.champion
        and all(before["to_version"] == after["from_version"] for before, after in zip(chain, chain[1:], strict=False))
    )


def leftovers(home: Path, worker: subprocess.Popen | None, grace: float = 60) -> list[str]:
    """Processes of the runs (they inherit the worker's PREFECT_HOME) still alive GRACE s after every run ended."""
    import psutil

    deadline = time.monotonic() + grace
    while True:
        alive = [
            process
            for process in processes_with("PREFECT_HOME", str(home))
            if worker is None or process.pid != worker.pid
        ]
        alive = [process for process in alive if process.is_running() and process.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return [f"{process.pid} {' '.join(process.cmdline())[:120]}" for process in alive]
        time.sleep(2)


def table(reports: list[Report]) -> str:
    rows = [
        ("runs created", lambda r: str(len(r.runs))),
        ("runs completed", lambda r: str(sum(run["state"] == "COMPLETED" for run in r.runs))),
        ("failed from a busy server", lambda r: str(len(r.failed_from_busy))),
        ("flow runs completed (subflows too)", lambda r: str(r.flow_runs_completed)),
        ("minutes, first POST to last end", lambda r: f"{r.minutes:.1f}"),
        ("flow runs per minute", lambda r: f"{r.runs_per_minute:.2f}"),
        ("API p50 / p95 ms (flow run filter)", lambda r: f"{r.api_p50_ms:.0f} / {r.api_p95_ms:.0f}"),
        ("API requests probed", lambda r: str(r.api_requests)),
        ("busy answers retried", lambda r: str(r.busy_answers)),
        ("errors after retries", lambda r: str(r.errors)),
        ("busy database errors in server log", lambda r: str(r.busy_in_server_log)),
        ("images in table / expected", lambda r: f"{r.images_in_table} / {r.images_expected}"),
        ("duplicate rows", lambda r: str(r.duplicate_rows)),
        ("champion, moves, chain whole", lambda r: f"v{r.champion}, {r.champion_moves}, {r.history_chain_whole}"),
        ("processes left", lambda r: str(len(r.left_running))),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{r.database:>12}" for r in reports)]
    lines += [f"{name:{width}}  " + "  ".join(f"{value(r):>12}" for r in reports) for name, value in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="full")
    parser.add_argument("--database", nargs="+", choices=servers.DATABASES, default=["sqlite", "postgres"])
    parser.add_argument("--keep", type=Path, help="keep the folders here (default: a temporary folder, removed)")
    add_record_option(parser)
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="imagelake-load-"))
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o711)  # run by root, PostgreSQL runs as `postgres`, which must be able to enter its data folder
    reports = []
    try:
        for database in args.database:
            folder = base / database
            folder.mkdir(parents=True)
            os.chmod(folder, 0o711)
            print(f"{database}: scenario {args.scenario} {SCENARIOS[args.scenario]} in {folder}", flush=True)
            reports.append(run_load(folder, database, args.scenario))
            print(json.dumps(asdict(reports[-1])), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    print(table(reports))
    if not args.no_record and args.scenario == "full":
        figures: dict[str, float | int | str] = {}
        for report in reports:
            figures |= {
                f"{report.database}_runs_completed": report.flow_runs_completed,
                f"{report.database}_minutes": round(report.minutes, 1),
                f"{report.database}_flow_runs_per_min": round(report.runs_per_minute, 2),
                f"{report.database}_api_p50_ms": round(report.api_p50_ms),
                f"{report.database}_api_p95_ms": round(report.api_p95_ms),
            }
        figures |= {
            "retried_busy_answers": sum(r.busy_answers for r in reports),
            "errors_after_retries": sum(r.errors for r in reports),
        }
        record("load", f"many runs at once against the cluster's servers: {SCENARIOS['full']}", invoked(), figures)
    return 0 if all(not r.failed_from_busy and not r.duplicate_rows and not r.left_running for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
