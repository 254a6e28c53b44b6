"""The deployments of prefect.yaml on a real `prefect server start` with a process worker: custom runs the way the UI
makes them, in the UI itself, and the nightly schedule."""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import psutil
import pytest

from imagelake.infra.lifecycle import processes_with
from tests.servers import PatientClient, PrefectServer, custom_run_body, form_defaults
from tests.test_summary import report_facts

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("prefect-server")]

POOL = "imagelake-process"
SUMMARY_KEY = "imagelake-run-summary"
CHROMIUM = Path("/usr/bin/chromium")
# Debian's Chromium, not a Playwright download: flags that keep it off the network and out of a sandbox it cannot have
# here.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
RUN_TIMEOUT = 900  # seconds; a 1-epoch run on 32 px images takes one to two minutes on two cores


@dataclass
class Deployed:
    """A running server with prefect.yaml deployed and a worker whose runs write into `workspace`."""

    server: PrefectServer
    api: httpx.Client
    workspace: Path
    source: Path
    worker_log: Path

    def deployment(self, flow: str, name: str) -> dict:
        found = self.api.get(f"/deployments/name/{flow}/{name}")
        assert found.status_code == 200, found.text
        return found.json()

    def create_run(self, deployment: dict, body: dict) -> httpx.Response:
        """POST a custom run (the client asks again while SQLite is busy with another writer)."""
        return self.api.post(f"/deployments/{deployment['id']}/create_flow_run", json=body)

    def flow_runs(self, body: dict) -> list[dict]:
        found = self.api.post("/flow_runs/filter", json=body)
        assert found.status_code == 200, found.text
        return found.json()

    def logs(self, flow_run_ids: list[str]) -> str:
        found = self.api.post(
            "/logs/filter",
            json={"logs": {"flow_run_id": {"any_": flow_run_ids}}, "sort": "TIMESTAMP_ASC", "limit": 200},
        )
        return "\n".join(f"{log['level']} {log['message']}" for log in found.json())

    def family(self, flow_run_id: str) -> list[str]:
        """The run and its subflow runs (the adhoc flow runs the pipeline as a subflow, which publishes the
        artifacts)."""
        ids, frontier = [flow_run_id], [flow_run_id]
        while frontier:
            children = self.flow_runs({"flow_runs": {"parent_flow_run_id": {"any_": frontier}}})
            frontier = [run["id"] for run in children]
            ids += frontier
        return ids

    def wait_for_run(self, flow_run_id: str, timeout: float = RUN_TIMEOUT, ends: str = "COMPLETED") -> dict:
        """Poll the run until it is in a terminal state; fail with its logs and the worker's if it is not in ENDS."""
        started = time.monotonic()
        while True:
            run = self.api.get(f"/flow_runs/{flow_run_id}").json()
            if run["state_type"] in TERMINAL or time.monotonic() - started > timeout:
                break
            time.sleep(2)
        print(
            f"flow run {run['name']} {run['state_type']} after {time.monotonic() - started:.0f} s (run time "
            f"{run['total_run_time']:.0f} s)"
        )
        assert run["state_type"] == ends, (
            f"flow run {run['name']} is {run['state_name']} after {time.monotonic() - started:.0f} s\n"
            f"--- run logs ---\n{self.logs(self.family(flow_run_id))[-6000:]}\n--- worker log "
            f"---\n{self.worker_log.read_text()[-4000:]}"
        )
        return run

    def stages(self, flow_run_id: str) -> list[dict]:
        """The task runs of the run and its subflow runs, less those that only stand for a subflow run in its parent."""
        family = self.family(flow_run_id)
        subflows = {run["parent_task_run_id"] for run in self.flow_runs({"flow_runs": {"id": {"any_": family}}})}
        found = self.api.post("/task_runs/filter", json={"task_runs": {"flow_run_id": {"any_": family}}, "limit": 200})
        assert found.status_code == 200, found.text
        return [task for task in found.json() if task["id"] not in subflows]

    def summary_artifacts(self, flow_run_id: str) -> list[dict]:
        body = {"artifacts": {"key": {"any_": [SUMMARY_KEY]}, "flow_run_id": {"any_": self.family(flow_run_id)}}}
        found = self.api.post("/artifacts/filter", json=body)
        assert found.status_code == 200, found.text
        return found.json()


def ran(record: dict) -> tuple[datetime, datetime] | None:
    """When a flow or task run ran, from its API record; None if it never ran (its result reused) or has not ended."""
    if not record.get("start_time") or not record.get("end_time"):
        return None
    start, end = (datetime.fromisoformat(record[key].replace("Z", "+00:00")) for key in ("start_time", "end_time"))
    return start, end


def overlapping(first: list[dict], second: list[dict]) -> list[tuple[str, str]]:
    """The names of the pairs of runs, one of FIRST and one of SECOND, that were running at the same moment."""
    pairs = []
    for one in first:
        for other in second:
            a, b = ran(one), ran(other)
            if a and b and a[0] < b[1] and b[0] < a[1]:
                pairs.append((one["name"], other["name"]))
    return pairs


def ran_at_once(deployed: Deployed, first: str, second: str) -> list[tuple[str, str]]:
    """Check that two flow runs ran at the same time, not one after the other as a worker taking one run at a time
    would run them: the runs overlap, and so do stages of theirs (task runs of each run and its subflow runs, which
    the server records from the runs' events, possibly a little after the run ends). The overlapping stages."""
    runs = [deployed.api.get(f"/flow_runs/{flow_run_id}").json() for flow_run_id in (first, second)]
    assert overlapping(runs[:1], runs[1:]), (
        f"the flow runs ran one after the other: {[(run['name'], ran(run)) for run in runs]}"
    )
    deadline = time.monotonic() + 60
    while not (stages := overlapping(deployed.stages(first), deployed.stages(second))) and time.monotonic() < deadline:
        time.sleep(2)
    times = {task["name"]: ran(task) for flow_run_id in (first, second) for task in deployed.stages(flow_run_id)}
    assert stages, f"no stage of one run ran while a stage of the other did: {times}"
    return stages


def run_params(deployment: dict, source: Path, **changed) -> dict:
    """Every field of the adhoc form, as the UI sends them: the defaults, small settings, then CHANGED."""
    small = {"source": str(source), "image_size": 32, "max_epochs": 1, "batch_size": 16, "num_workers": 2}
    return {**form_defaults(deployment), **small, **changed}


def processes_of(prefect_home: Path) -> list[psutil.Process]:
    """Every live process started for this server: they all inherit its PREFECT_HOME."""
    return processes_with("PREFECT_HOME", str(prefect_home))


def flow_run_processes(prefect_home: Path) -> list[psutil.Process]:
    """The flow-run processes (`python -m prefect.engine`) among those of this server."""
    found = []
    for process in processes_of(prefect_home):
        try:
            if "prefect.engine" in process.cmdline():
                found.append(process)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path, ray_local):
    """`prefect server start`, the imagelake-process pool, `prefect deploy --all` and one process worker; all stopped
    afterwards. The worker's runs join this process's Ray (IMAGELAKE_RAY_ADDRESS, as a deployment's worker joins its
    cluster) rather than each starting a Ray of its own."""
    import ray

    root = tmp_path_factory.mktemp("prefect-server")
    server = PrefectServer(root)
    api = PatientClient(base_url=server.api_url, timeout=30)
    try:
        started = time.monotonic()
        with pytest.MonkeyPatch.context() as env:
            # A retryable database error (SQLite busy) reaches clients as a bare 503; the server's log should say which.
            env.setenv("PREFECT_API_LOG_RETRYABLE_ERRORS", "true")
            server.start()
        server.create_pool(POOL)
        server.prefect("deploy", "--all")
        workspace = root / "workspace"
        worker_log = root / "worker.log"
        ray_address = ray.get_runtime_context().gcs_address
        server.start_worker(
            POOL, worker_log, {"IMAGELAKE_WORKSPACE": str(workspace), "IMAGELAKE_RAY_ADDRESS": ray_address}
        )
        print(f"server up, deployed, worker started in {time.monotonic() - started:.0f} s")
        yield Deployed(server, api, workspace, digits_dir, worker_log)
    finally:
        api.close()
        # A flow run that has ended still stops its Spark and Ray and sends its last logs before its process exits; on a
        # loaded machine that took longer than the 15 s below. It is waited for here, with the server up to answer it.
        psutil.wait_procs(flow_run_processes(server.root / "prefect-home"), timeout=180)
        server.stop()
        # Flow runs (and the Spark and Ray processes they start) may live in sessions of their own, out of reach of the
        # process-group kills in stop(): anything still carrying this server's PREFECT_HOME leaked.
        leftovers = processes_of(server.root / "prefect-home")
        _, alive = psutil.wait_procs(leftovers, timeout=15)
        described = [f"{p.pid} {' '.join(p.cmdline())[:160]}" for p in alive if p.is_running()]
        for process in alive:
            process.kill()
        assert not described, "processes left running after the server and worker were stopped:\n" + "\n".join(
            described
        )


def test_the_nightly_deployment_is_scheduled_for_two_in_the_morning_utc(deployed: Deployed) -> None:
    nightly = deployed.deployment("imagelake-pipeline", "nightly")
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"], s["active"]) for s in nightly["schedules"]] == [
        ("0 2 * * *", "UTC", True)
    ]
    assert not nightly["paused"]

    # The server's scheduler service creates the upcoming runs a few seconds after the deployment appears.
    body = {
        "deployments": {"id": {"any_": [nightly["id"]]}},
        "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}},
        "sort": "EXPECTED_START_TIME_ASC",
        "limit": 5,
    }
    deadline = time.monotonic() + 120
    scheduled = deployed.flow_runs(body)
    while not scheduled and time.monotonic() < deadline:
        time.sleep(2)
        scheduled = deployed.flow_runs(body)
    assert scheduled, (
        f"no scheduled runs of the nightly deployment after 120 s:\n{deployed.server.log.read_text()[-4000:]}"
    )
    first = datetime.fromisoformat(scheduled[0]["expected_start_time"].replace("Z", "+00:00"))
    now = datetime.now(UTC)
    assert (first.astimezone(UTC).hour, first.minute, first.second) == (2, 0, 0), first
    assert now < first <= now + timedelta(days=1), f"the next run should be the next 02:00 UTC, not {first}"
    assert scheduled[0]["parameters"] == {"source": ".imagelake/demo-digits", "overrides": {"max_epochs": 8}}


def test_invalid_custom_run_parameters_are_refused_before_any_run_exists(deployed: Deployed) -> None:
    adhoc = deployed.deployment("imagelake-adhoc", "adhoc")
    runs_of_adhoc = {"deployments": {"id": {"any_": [adhoc["id"]]}}}
    before = deployed.flow_runs(runs_of_adhoc)

    body = custom_run_body(adhoc, {"params": run_params(adhoc, deployed.source, image_size=0)}, "refused-image-size")
    refused = deployed.create_run(adhoc, body)
    assert refused.status_code == 409, refused.text
    assert "params.image_size" in refused.json()["detail"] and "minimum of 8" in refused.json()["detail"]

    body = custom_run_body(
        adhoc, {"params": run_params(adhoc, deployed.source, model_arch="vgg")}, "refused-model-arch"
    )
    refused = deployed.create_run(adhoc, body)
    assert refused.status_code == 409 and "params.model_arch" in refused.json()["detail"], refused.text

    assert deployed.flow_runs(runs_of_adhoc) == before, "a refused run must not exist, not even as a failed one"


def refused(deployed: Deployed, deployment: dict, parameters: dict, name: str, expect: str) -> str:
    """Start a run of DEPLOYMENT with PARAMETERS; it must fail before any work: its logs, once they hold EXPECT (the
    flow-run process's last lines can reach the server after its Failed state) or a minute after it failed."""
    created = deployed.create_run(deployment, custom_run_body(deployment, parameters, name))
    assert created.status_code == 201, created.text
    started = time.monotonic()
    while (run := deployed.api.get(f"/flow_runs/{created.json()['id']}").json())[
        "state_type"
    ] not in TERMINAL and time.monotonic() - started < 300:
        time.sleep(2)
    failed = time.monotonic()
    while expect not in (logs := deployed.logs(deployed.family(run["id"]))) and time.monotonic() - failed < 60:
        time.sleep(1)
    assert run["state_type"] == "FAILED", f"{run['state_name']}\n{logs[-3000:]}"
    return logs


@pytest.mark.parametrize(
    "unsafe",
    [{"spark_conf": {"spark.driver.extraJavaOptions": "-javaagent:/tmp/agent.jar"}}, {"allow_pickle_models": True}],
)
def test_a_deployment_run_may_not_set_what_runs_code_or_loads_pickles(deployed: Deployed, unsafe: dict) -> None:
    nightly = deployed.deployment("imagelake-pipeline", "nightly")
    expected = f"{next(iter(unsafe))} cannot be set from the parameters of a deployment run"
    logs = refused(
        deployed,
        nightly,
        {"source": str(deployed.source), "overrides": {"max_epochs": 1, **unsafe}},
        f"unsafe-{next(iter(unsafe))}",
        expected,
    )
    assert expected in logs and "IMAGELAKE_ALLOW_FROM_RUNS" in logs, logs[-3000:]


def test_nor_through_a_settings_file_it_names_outside_the_code(deployed: Deployed, tmp_path: Path) -> None:
    planted = tmp_path / "planted.yaml"
    planted.write_text("allow_pickle_models: true\nmax_epochs: 1\nimage_size: 32\n")
    expected = (
        f"allow_pickle_models cannot be set from the settings file {planted}, named by the parameters of a "
        "deployment run"
    )
    nightly = deployed.deployment("imagelake-pipeline", "nightly")
    logs = refused(
        deployed,
        nightly,
        {"source": str(deployed.source), "config_file": str(planted)},
        "planted-settings-nightly",
        expected,
    )
    assert expected in logs, logs[-3000:]
    # The UI's form has a settings file field too.
    adhoc = deployed.deployment("imagelake-adhoc", "adhoc")
    logs = refused(
        deployed,
        adhoc,
        {"params": run_params(adhoc, deployed.source, config_file=str(planted))},
        "planted-settings-adhoc",
        expected,
    )
    assert expected in logs, logs[-3000:]


def test_a_run_may_not_bring_its_own_command_working_folder_or_environment(deployed: Deployed) -> None:
    """The worker lays a run's job variables over the deployment's: an `env` of IMAGELAKE_* would pass no run policy,
    PYTHONPATH or a `command` would run other code. imagelake's pool (infra/clusters/process-pool.json) refuses them
    when the run is asked for, so no run exists, not even a failed one."""
    nightly = deployed.deployment("imagelake-pipeline", "nightly")
    runs_of_nightly = {"flow_runs": {"deployment_id": {"any_": [nightly["id"]]}}}
    before = deployed.flow_runs(runs_of_nightly)
    for variables in (
        {"command": "sh -c id"},
        {"working_dir": "/tmp"},
        {"env": {"IMAGELAKE_ALLOW_PICKLE_MODELS": "true"}},
        {"env": {"IMAGELAKE_ALLOW_FROM_RUNS": "allow_pickle_models"}},
        {"env": {"PYTHONPATH": "/tmp/planted"}},
    ):
        body = {
            **custom_run_body(nightly, {"source": str(deployed.source)}, "job-variables"),
            "job_variables": variables,
        }
        refused = deployed.create_run(nightly, body)
        assert refused.status_code == 422, (variables, refused.status_code, refused.text)
    assert deployed.flow_runs(runs_of_nightly) == before


def test_on_imagelake_s_kubernetes_pool_a_run_may_not_bring_its_own_image_command_namespace_or_environment(
    deployed: Deployed,
) -> None:
    """The same refusal on the Kubernetes pool's template (infra/clusters/kubernetes-pool.json, rendered for a cluster
    as `make kubernetes-pool` does): the API answers 422 for the image, the command, the namespace, the service
    account and IMAGELAKE_* variables, before any job exists; a name, labels and timeouts stay a run's to set."""
    from imagelake.infra.pools import kubernetes_template

    template = kubernetes_template("registry.example/imagelake:1", "ml", "imagelake-runs")
    pool = "imagelake-kubernetes-check"
    created = deployed.api.post(
        "/work_pools/", json={"name": pool, "type": "kubernetes", "base_job_template": template}
    )
    assert created.status_code == 201, created.text
    nightly = deployed.deployment("imagelake-pipeline", "nightly")
    made = deployed.api.post(
        "/deployments/",
        json={
            "name": "kubernetes-check",
            "flow_id": nightly["flow_id"],
            "entrypoint": nightly["entrypoint"],
            "work_pool_name": pool,
            "paused": True,
        },
    )
    assert made.status_code in (200, 201), made.text
    deployment = made.json()
    try:
        for variables in (
            {"image": "attacker/imagelake:evil"},
            {"command": "sh -c id"},
            {"namespace": "kube-system"},
            {"service_account_name": "cluster-admin"},
            {"cluster_config": {"config": {}, "context_name": "other"}},
            {"env": {"IMAGELAKE_ALLOW_PICKLE_MODELS": "true"}},
            {"env": {"PYTHONPATH": "/tmp/planted"}},
            {"name": "Not A DNS Name; rm -rf"},
        ):
            body = {**custom_run_body(deployment, {}, "kubernetes-job-variables"), "job_variables": variables}
            refused = deployed.create_run(deployment, body)
            assert refused.status_code == 422, (variables, refused.status_code, refused.text)
        allowed = {
            "name": "nightly-rerun",
            "labels": {"team": "vision"},
            "finished_job_ttl": 3600,
            "env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"},
        }
        body = {**custom_run_body(deployment, {}, "kubernetes-allowed"), "job_variables": allowed}
        accepted = deployed.create_run(deployment, body)
        assert accepted.status_code == 201, accepted.text
        assert deployed.api.delete(f"/flow_runs/{accepted.json()['id']}").status_code == 204
        job = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
        assert (job["containers"][0]["image"], job["serviceAccountName"]) == (
            "registry.example/imagelake:1",
            "imagelake-runs",
        )
        assert "args" not in job["containers"][0], "the worker's own command (prefect flow-run execute) runs"
    finally:
        deployed.api.delete(f"/deployments/{deployment['id']}")
        deployed.api.delete(f"/work_pools/{pool}")


@pytest.fixture(scope="module")
def chromium() -> Path:
    """Debian's Chromium; its absence fails the test (before any server starts) unless IMAGELAKE_SKIP_BROWSER=1."""
    if not CHROMIUM.exists():
        if os.environ.get("IMAGELAKE_SKIP_BROWSER") == "1":
            pytest.skip(f"IMAGELAKE_SKIP_BROWSER=1 and no {CHROMIUM}")
        pytest.fail(
            f"no {CHROMIUM}: run `make browser` (installs Debian's chromium and chromium-driver), or set "
            "IMAGELAKE_SKIP_BROWSER=1 to skip this test"
        )
    return CHROMIUM


@pytest.mark.browser
def test_a_custom_run_from_the_prefect_ui_form(chromium: Path, deployed: Deployed, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    url = deployed.server.url
    adhoc = deployed.deployment("imagelake-adhoc", "adhoc")
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # The UI asks for fonts and news from the internet; only the server under test may answer.
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(url) else route.abort())
            page.set_default_timeout(30_000)

            page.goto(url)
            page.get_by_role("link", name="Deployments").click()
            page.get_by_role("link", name="adhoc", exact=True).click()
            expect(page).to_have_url(re.compile(f"^{re.escape(url)}/v2/deployments/deployment/{adhoc['id']}"))
            page.get_by_role("button", name="Run").click()
            page.get_by_role("menuitem", name="Custom run").click()

            # The form starts from the deployment's parameters and the schema's defaults.
            expect(page.get_by_label("Source")).to_have_value(adhoc["parameters"]["params"]["source"])
            expect(page.get_by_label("Max Epochs")).to_have_value(str(form_defaults(adhoc)["max_epochs"]))
            page.get_by_label("Source").fill(str(deployed.source))
            page.get_by_label("Image Size").fill("32")
            page.get_by_label("Max Epochs").fill("2")
            page.get_by_label("Batch Size").fill("16")
            page.get_by_label("Num Workers").fill("1")
            page.screenshot(path=shots / "1-custom-run-form.png", full_page=True)
            # SQLite answers 503 while another writer holds it; the UI then shows an error and keeps the form, and its
            # user submits again.
            for attempt in range(1, 6):
                with page.expect_response(
                    lambda r: r.url.endswith("/create_flow_run") and r.request.method == "POST"
                ) as response:
                    page.get_by_role("button", name="Submit").click()
                if response.value.status != 503:
                    break
                print(f"the UI's create_flow_run answered 503 (attempt {attempt}): submitting again")
                time.sleep(attempt)
            assert response.value.status == 201, (
                f"{response.value.status} {response.value.text()}\n{deployed.server.log.read_text()[-4000:]}"
            )
            sent = response.value.request.post_data_json
            flow_run_id = response.value.json()["id"]

            page.get_by_role("link", name="View run").click()
            expect(page).to_have_url(re.compile(f"^{re.escape(url)}/v2/runs/flow-run/{flow_run_id}"))
            deployed.wait_for_run(flow_run_id)
            # The open run page polls the server: it must show the final state by itself, without a reload.
            expect(page.get_by_text("Completed", exact=True).first).to_be_visible(timeout=60_000)
            # A fresh load for the picture: the "scheduled" toast stays up while the pointer rests on it.
            with page.expect_response(lambda r: r.url.endswith(f"/flow_runs/{flow_run_id}/graph-v2")):
                page.reload()
            expect(page.get_by_text("Completed", exact=True).first).to_be_visible()
            page.get_by_role("tab", name="Parameters").click()
            expect(page.get_by_role("tabpanel")).to_contain_text("max_epochs")
            page.wait_for_timeout(
                1_000
            )  # the run graph is painted on a canvas after its data arrives: nothing in the DOM says when
            page.screenshot(path=shots / "2-completed-run.png")
            tune_run = submit_tune_form(page, deployed, shots)
        finally:
            browser.close()

    run = deployed.api.get(f"/flow_runs/{flow_run_id}").json()
    assert run["parameters"] == {"params": run_params(adhoc, deployed.source, max_epochs=2, num_workers=1)}
    assert run["deployment_id"] == adhoc["id"]
    # The other tests' ad-hoc runs (through the API) build their requests the way this form does: nothing but the
    # run's name and parameters may differ.
    expected = custom_run_body(adhoc, run["parameters"], sent["name"])
    assert sent == expected
    artifacts = deployed.summary_artifacts(flow_run_id)
    assert len(artifacts) == 1, artifacts
    summary = report_facts(artifacts[0]["data"])
    assert summary["epochs_run"] == "2", artifacts[0]["data"]
    # The table the run wrote holds every image of its source once. (Other tests of this file land images of their own
    # in the same workspace, before or after this one: the table's total depends on the order.)
    from imagelake.infra.delta import column_values

    paths = column_values(str(deployed.workspace / "tables" / "images"), "path", int(summary["delta_version"]))
    mine = [path for path in paths if f"{deployed.source}/" in path]
    assert len(mine) == len(set(mine)) == 300, (len(mine), len(set(mine)), summary)
    # The worker's IMAGELAKE_WORKSPACE took the run's output, not the repository's .imagelake.
    assert str(deployed.workspace) in artifacts[0]["data"] and (deployed.workspace / "mlflow.db").is_file()

    # The search's form: its space, typed as text, reached the flow, which read it and refused a value no run may set
    # before any stage ran, naming the setting.
    assert tune_run["deployment_id"] == deployed.deployment("imagelake-tune-adhoc", "tune")["id"], tune_run
    logs = deployed.logs(deployed.family(tune_run["id"]))
    assert "batch_size=100000 (a run may set at most 1024)" in logs and "the run's `space` parameter" in logs, logs[
        -3000:
    ]
    assert "ingest: started" not in logs, logs[-3000:]

    published = os.environ.get("IMAGELAKE_SCREENSHOT_DIR")
    if published:
        Path(published).mkdir(parents=True, exist_ok=True)
        shutil.copy(shots / "2-completed-run.png", Path(published) / "prefect-ui-custom-run.png")


# A space a run may not set: the flow refuses it before any stage, so the form's run ends in seconds.
TUNE_SPACE = "{batch_size: {choice: [16, 100000]}, augment: {choice: [none, light]}}"


def submit_tune_form(page, deployed: Deployed, shots: Path) -> dict:
    """The tune deployment's custom run from its form: typed fields and the space as text; the run, once ended."""
    from playwright.sync_api import expect

    tune = deployed.deployment("imagelake-tune-adhoc", "tune")
    page.goto(deployed.server.url)
    page.get_by_role("link", name="Deployments").click()
    page.get_by_role("link", name="tune", exact=True).click()
    page.get_by_role("button", name="Run").click()
    page.get_by_role("menuitem", name="Custom run").click()
    expect(page.get_by_label("Trials")).to_have_value(str(tune["parameters"]["params"]["trials"]))
    page.get_by_label("Source").fill(str(deployed.source))
    page.get_by_label("Trials").fill("2")
    page.get_by_label(re.compile(r"^Space(?! File)")).fill(TUNE_SPACE)  # "Space", not "Space File"
    page.get_by_label("Max Epochs").fill("1")
    page.get_by_label("Num Workers").fill("1")
    page.screenshot(path=shots / "3-tune-form.png", full_page=True)
    for attempt in range(1, 6):  # SQLite's 503 under another writer, as for the ad-hoc form
        with page.expect_response(lambda r: r.url.endswith("/create_flow_run") and r.request.method == "POST") as sent:
            page.get_by_role("button", name="Submit").click()
        if sent.value.status != 503:
            break
        time.sleep(attempt)
    assert sent.value.status == 201, f"{sent.value.status} {sent.value.text()}"
    params = sent.value.request.post_data_json["parameters"]["params"]
    assert (params["space"], params["trials"], params["max_epochs"], params["promote"]) == (TUNE_SPACE, 2, 1, False)
    return deployed.wait_for_run(sent.value.json()["id"], ends="FAILED")


def test_a_backfill_and_the_nightly_run_at_once_count_every_image_once_and_leave_one_champion(
    spark, deployed: Deployed, tmp_path: Path
) -> None:
    import numpy as np
    from PIL import Image

    from imagelake.infra.delta import Table, read_version
    from imagelake.infra.settings import load_settings
    from imagelake.infra.tracking import mlflow_client
    from imagelake.tasks.registry.aliases import alias_version
    from imagelake.tasks.registry.moves import PENDING_MOVE
    from imagelake.tasks.rules.promotion import CHAMPION

    landing, noise = tmp_path / "landing", np.random.default_rng(7)
    # Two dates, which the backfill runs at once (max_concurrency=2) beside the nightly run: three runs, each its own
    # process of the worker. Images of their own: content the table holds elsewhere would be left out.
    for day in ("2024-03-01", "2024-03-02"):
        for label in ("0", "1", "2", "3"):
            (landing / f"date={day}" / label).mkdir(parents=True)
            for n in range(5):
                Image.fromarray(noise.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(
                    landing / f"date={day}" / label / f"{n}.png"
                )
    small = {"image_size": 32, "max_epochs": 1, "batch_size": 16, "num_workers": 1}
    nightly, backfill = (
        deployed.deployment("imagelake-pipeline", "nightly"),
        deployed.deployment("imagelake-backfill", "backfill"),
    )
    runs = [
        deployed.create_run(
            nightly, custom_run_body(nightly, {"source": str(landing), "overrides": small}, "nightly-beside-a-backfill")
        ),
        deployed.create_run(
            backfill,
            custom_run_body(
                backfill,
                {
                    "source": str(landing),
                    "start_date": "2024-03-01",
                    "end_date": "2024-03-02",
                    "max_concurrency": 2,
                    "dry_run": False,
                    "overrides": small,
                },
                "backfill-beside-the-nightly",
            ),
        ),
    ]
    assert [created.status_code for created in runs] == [201, 201], [created.text for created in runs]
    for created in runs:
        deployed.wait_for_run(created.json()["id"], timeout=2 * RUN_TIMEOUT)
    stages = ran_at_once(deployed, *(created.json()["id"] for created in runs))
    print(f"{len(stages)} pairs of stages ran at once, e.g. {stages[:3]}")

    table = str(deployed.workspace / "tables" / "images")
    paths = [
        row["path"] for row in read_version(spark, table, Table(table).version(), "delta-rs").select("path").collect()
    ]
    landed = [path for path in paths if f"{landing}/" in path]
    assert len(landed) == len(set(landed)) == 40, "every image of the landing folder once"
    settings = load_settings(overrides={"workspace": str(deployed.workspace)})
    client = mlflow_client(settings)
    assert alias_version(client, settings.model_name, CHAMPION) is not None
    assert PENDING_MOVE not in client.get_registered_model(settings.model_name).tags, "no alias move left half done"
    crowned = [
        row
        for row in Table(settings.history_uri, spark).read(["alias", "from_version", "to_version", "at"]).to_pylist()
        if row["alias"] == CHAMPION
    ]
    chain = sorted(crowned, key=lambda row: row["at"])
    assert all(
        before["to_version"] == after["from_version"] for before, after in zip(chain, chain[1:], strict=False)
    ), "each crowning replaced the champion before it"
    assert chain[-1]["to_version"] == alias_version(client, settings.model_name, CHAMPION)


def test_a_nightly_and_an_ad_hoc_run_of_the_same_data_at_once_train_once_and_never_mix(
    spark, deployed: Deployed, tmp_path: Path
) -> None:
    """Two whole flows with the same stage keys (one source, the same settings), each in its own process of the
    worker."""
    import numpy as np
    from PIL import Image

    from imagelake.infra.delta import Table, read_version
    from imagelake.infra.settings import load_settings
    from imagelake.infra.tracking import mlflow_client

    landing, noise = tmp_path / "landing", np.random.default_rng(11)
    for label in (
        "0",
        "1",
        "2",
    ):  # images of their own, at a size no other test of this server uses: every stage is new
        (landing / label).mkdir(parents=True)
        for n in range(12):
            Image.fromarray(noise.integers(0, 256, (30, 30, 3), dtype=np.uint8)).save(landing / label / f"{n}.png")
    # The same model on both: the ad-hoc form sends its model_arch (the default), the nightly the worker's (the suite's
    # small CNN, tests/conftest.py).
    small = {"image_size": 20, "max_epochs": 2, "batch_size": 16, "num_workers": 1, "model_arch": "small_cnn"}
    nightly, adhoc = (
        deployed.deployment("imagelake-pipeline", "nightly"),
        deployed.deployment("imagelake-adhoc", "adhoc"),
    )
    runs = [
        deployed.create_run(
            nightly,
            custom_run_body(nightly, {"source": str(landing), "overrides": small}, "nightly-beside-an-ad-hoc-run"),
        ),
        deployed.create_run(
            adhoc, custom_run_body(adhoc, {"params": run_params(adhoc, landing, **small)}, "ad-hoc-beside-the-nightly")
        ),
    ]
    assert [created.status_code for created in runs] == [201, 201], [created.text for created in runs]
    summaries = []
    for created in runs:
        deployed.wait_for_run(created.json()["id"], timeout=2 * RUN_TIMEOUT)
        [artifact] = deployed.summary_artifacts(created.json()["id"])
        summaries.append(report_facts(artifact["data"]))
    # The ad-hoc run is the one the UI's custom-run call makes (the browser test checks the request is the form's).
    ad_hoc = deployed.api.get(f"/flow_runs/{runs[1].json()['id']}").json()
    assert ad_hoc["deployment_id"] == adhoc["id"] and ad_hoc["parameters"] == {
        "params": run_params(adhoc, landing, **small)
    }
    assert [summary["epochs_run"] for summary in summaries] == ["2", "2"], summaries
    stages = ran_at_once(deployed, *(created.json()["id"] for created in runs))
    print(f"{len(stages)} pairs of stages ran at once, e.g. {stages[:3]}")
    first, second = summaries
    assert first["mlflow_run_id"] == second["mlflow_run_id"] and first["model_version"] == second["model_version"], (
        "one trained, the other took its result"
    )

    table = str(deployed.workspace / "tables" / "images")
    rows = (
        read_version(spark, table, Table(table).version(), "delta-rs").where("image_size = 20").select("path").collect()
    )
    landed = [row["path"] for row in rows if f"{landing}/" in row["path"]]
    assert len(landed) == len(set(landed)) == 36, "every image once"
    client = mlflow_client(load_settings(overrides={"workspace": str(deployed.workspace)}))
    run_id = first["mlflow_run_id"]
    assert [str(v.version) for v in client.search_model_versions(f"run_id = '{run_id}'")] == [first["model_version"]], (
        "one model version"
    )
    steps = sorted(m.step for m in client.get_metric_history(run_id, "val_loss"))
    assert steps == list(range(int(first["epochs_run"]))), f"one training's epochs in the run, not two mixed: {steps}"
