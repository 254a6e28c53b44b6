"""The whole pipeline through the `imagelake` command on real Spark, Delta, Ray, MLflow and a Prefect server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from deltalake import DeltaTable
from mlflow import MlflowClient
from PIL import Image, ImageOps

from imagelake.flows.demo_data import write_digits
from imagelake.infra.weights import KNOWN
from imagelake.tasks.data.cache_files import split_files
from imagelake.tasks.rules.images import resize_image
from imagelake.tasks.rules.markdown import markdown_text
from imagelake.tasks.rules.report import margin
from imagelake.tasks.stages.promote import load_trained_model
from tests.conftest import cli_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("e2e")]  # one process runs the shared first run

IMAGELAKE = str(Path(sys.executable).parent / "imagelake")
MODEL = "digits-e2e"


def run_cli(args: list[str], env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([IMAGELAKE, *args], env=env, capture_output=True, text=True, timeout=timeout)


PREFECT_SERVER = "prefect.server.api.server:create_app"  # what both Prefect's temporary server and imagelake's run


def run_cli_counting_servers(
    args: list[str], env: dict[str, str], timeout: int = 900
) -> tuple[subprocess.CompletedProcess, set[int]]:
    """run_cli, and the Prefect server processes the command started meanwhile (looked for twice a second). A process
    whose parent is such a server is not another one: a server's fork for a moment, before it runs a command of its own
    (ctypes looking for a library runs ldconfig), shows the server's command line."""
    import psutil

    command = subprocess.Popen([IMAGELAKE, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    servers: set[int] = set()
    out: list[str] = []

    def read() -> None:
        out.extend(command.communicate(timeout=timeout))

    reader = threading.Thread(target=read)
    reader.start()
    parent = psutil.Process(command.pid)
    while reader.is_alive():
        seen: dict[int, int] = {}  # server-like process -> its parent, in this look
        try:
            for child in parent.children(recursive=True):
                try:
                    if any(PREFECT_SERVER in part for part in child.cmdline()):
                        seen[child.pid] = child.ppid()
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        servers.update(pid for pid, ppid in seen.items() if ppid not in seen and ppid not in servers)
        reader.join(0.5)
    return subprocess.CompletedProcess([IMAGELAKE, *args], command.returncode, out[0], out[1]), servers


def run_here(args: list[str]) -> subprocess.CompletedProcess:
    """The `imagelake` command's app in this process (the registry commands, which start no Spark or Ray: a process of
    their own would add only its start-up), answered as run_cli answers; the Prefect API is the session's, as in
    run_cli's environment."""
    from typer.testing import CliRunner

    from imagelake.flows.cli import app

    done = CliRunner().invoke(app, args)
    return subprocess.CompletedProcess(["imagelake", *args], done.exit_code, done.stdout, done.stderr)


def run_pipeline(
    source: Path, workspace: Path, env: dict[str, str], *extra: str, output: list[str] | None = None
) -> tuple[dict, float]:
    settings = [
        "workspace=" + str(workspace),
        "image_size=64",  # the digits as written: a pretrained network needs more than 32 px to see them
        "max_epochs=4",
        "num_workers=2",
        "batch_size=8",  # 15 steps an epoch on each worker: fine-tuning needs steps more than epochs
        f"model_name={MODEL}",
        # The default model (the rest of the suite trains the small CNN): MobileNetV2 from ImageNet weights.
        "model_arch=mobilenet_v2",
        "pretrained=IMAGENET1K_V1",
        "shuffle_buffer_batches=1",  # not the default: retrain must set it again (test_a_weaker_model...)
        *extra,
    ]
    started = time.monotonic()
    done = run_cli(["run", "--source", str(source), "--json", *[arg for s in settings for arg in ("--set", s)]], env)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    if output is not None:
        output.append(done.stdout + done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1]), elapsed


def flow_logs(flow_run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(flow_run_id)])),
                limit=200,
                offset=len(messages),
            )
            messages += [log.message for log in page]
            if len(page) < 200:
                return messages


STAGES = ("ingest", "resize", "write", "split", "cache", "train", "promote")


def assert_shows_what_it_does(summary: dict, console: str, logs: list[str]) -> None:
    """Stage start and end lines with durations, epoch lines, the MLflow run's URL before the first epoch, no noise."""
    assert list(summary["stage_seconds"]) == sorted(STAGES) and all(s >= 0 for s in summary["stage_seconds"].values())
    assert summary["stage_seconds"]["train"] > 1
    for text in (console, "\n".join(logs)):
        for stage in STAGES:
            assert f"{stage}: started" in text and re.search(rf"{stage}: (done|result reused) in \d+\.\d s", text), (
                stage
            )
        epochs = re.findall(
            r"train: epoch (\d+) of 4, train loss \d\.\d+, val loss \d\.\d+, val accuracy \d\.\d+", text
        )
        assert [int(e) for e in epochs] == list(range(1, summary["epochs_run"] + 1))
        assert text.index("train: MLflow run http://127.0.0.1:5000/#/experiments/") < text.index("train: epoch 1 of 4")
        assert re.search(r"resize: 300 of 300 files \(100%\), \d+ files/s", text)
    for noise in (
        "Recovering rowgroup information",
        "Failed loading Unischema",
        "Reporting training result",
        "Checkpoint successfully created",
    ):
        assert noise not in console, noise
    assert "stage times   ingest " in console
    # On a Prefect server, the flow run's page: in the first lines, and in the summary.
    assert summary["flow_run_url"].endswith(f"/runs/flow-run/{summary['flow_run_id']}") and console.index(
        "View at http"
    ) < console.index("ingest: started")


def task_states(flow_run_id: str) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])))
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


def flow_artifact(flow_run_id: str, key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[uuid.UUID(flow_run_id)])
            )
        )
    assert len(found) == 1, f"{key}: {found}"
    return found[0]


def quarantine_artifact(flow_run_id: str) -> list[dict]:
    found = flow_artifact(flow_run_id, "imagelake-quarantine")
    return json.loads(found.data) if isinstance(found.data, str) else found.data


def assert_knows_the_data_and_the_model(summary: dict, client: MlflowClient, description: str) -> None:
    """The dataset card (Prefect and MLflow) counts what the cache holds; per-class test metrics add up; the model
    card."""
    run_id, labels = summary["mlflow_run_id"], summary["labels"]
    card = json.loads(
        Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="dataset/card.json")).read_text()
    )
    for split in ("train", "val", "test"):
        manifest = Path(summary["cache_dir"].removeprefix("file://")) / f"{split}-v{summary['delta_version']}.json"
        cached = pq.read_table(split_files(str(manifest))[1], columns=["label"]).column("label").to_numpy()
        assert card["images_per_label"][split] == {name: int((cached == i).sum()) for i, name in enumerate(labels)}
    assert card == summary["dataset_card"] and card["images_per_split"] == summary["split_counts"]
    assert {"dataset/card.md", "dataset/samples.png"} <= {a.path for a in client.list_artifacts(run_id, "dataset")}
    markdown = flow_artifact(summary["flow_run_id"], "imagelake-dataset-card").data
    assert "| **all** | " in markdown and "samples.png" in markdown
    per_class = json.loads(
        Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="test_per_class.json")).read_text()
    )
    matrix = per_class["confusion_matrix"]
    assert [row["support"] for row in per_class["per_class"]] == [sum(r) for r in matrix]
    assert sum(row["correct"] for row in per_class["per_class"]) / summary["split_counts"]["test"] == pytest.approx(
        summary["test_accuracy"]
    )
    metrics = client.get_run(run_id).data.metrics
    assert all(f"test_{name}_{label}" in metrics for label in labels for name in ("precision", "recall", "f1"))
    assert "Per class on the test split" in flow_artifact(summary["flow_run_id"], "imagelake-promotion").data
    for expected in (
        f"# {MODEL} v{summary['model_version']}",
        f"version {summary['delta_version']}",
        "## Training settings",
        "| max_epochs | 4 |",
        "**champion**",
    ):
        assert expected in description, expected
    # The run's floor: the plain baseline on the same split, logged, and the model's margin over it in the card.
    baseline = summary["baseline_accuracy"]
    assert 0.3 < baseline <= 1 and metrics["baseline_test_accuracy"] == pytest.approx(baseline), "chance is 0.1"
    assert f"| margin over the baseline | {summary['test_accuracy'] - baseline:+.4f} |" in description


def assert_started_from_the_imagenet_weights_and_serves_as_trained(summary: dict, console: str, champion) -> None:
    """The default model's weights, by name and digest, in the version's lineage, its card, the summary and the
    console; and the served pyfunc (decoding and normalising inside it) answers the trained model's labels and
    probabilities."""
    weights, digest = "MobileNet_V2_Weights.IMAGENET1K_V1", KNOWN[0].sha256
    assert (champion.tags["pretrained_weights"], champion.tags["pretrained_sha256"]) == (weights, digest)
    assert (summary["pretrained_weights"], summary["pretrained_sha256"]) == (weights, digest)
    started = f"from {weights} (sha256 {digest[:16]})"
    assert f"Weights: {markdown_text(started)}." in champion.description and started in console
    files = sorted(SOURCE_OF[summary["flow_run_id"]].glob("*/*.png"))[::25]
    data = [path.read_bytes() for path in files]
    served = mlflow.pyfunc.load_model(f"models:/{MODEL}/{champion.version}").predict(pd.DataFrame({"image": data}))
    model = load_trained_model(summary["checkpoint"])
    with torch.no_grad():
        decoded = torch.from_numpy(
            np.stack([resize_image(blob, summary["dataset_card"]["image_size"])[0] for blob in data])
        )
        probabilities = torch.softmax(model(decoded), dim=1)
    best = probabilities.max(dim=1)
    assert list(served["label"]) == [summary["labels"][i] for i in best.indices.tolist()]
    assert list(served["probability"]) == pytest.approx(best.values.tolist(), abs=1e-5)


SOURCE_OF: dict[str, Path] = {}  # a run's source folder, by its flow run id


@dataclass
class FirstRun:
    """The module's first run: the summary, console output and time of a run on a copy of the digits."""

    source: Path
    workspace: Path
    env: dict[str, str]
    summary: dict
    console: str
    seconds: float


@pytest.fixture(scope="module")
def first_run(digits_dir: Path, tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> FirstRun:
    """One whole run, shared: the first test checks it and runs it again on the same data; the second (last) adds
    images to its source and trains a weaker model on top of it."""
    root = tmp_path_factory.mktemp("e2e")
    source, workspace = root / "src", root / "ws"
    shutil.copytree(digits_dir, source)  # the session's digits stay as they are: the tests change these files
    env = cli_env({"PREFECT_API_URL": prefect_api})
    output: list[str] = []
    summary, seconds = run_pipeline(source, workspace, env, output=output)
    SOURCE_OF[summary["flow_run_id"]] = source
    return FirstRun(source, workspace, env, summary, output[0], seconds)


def test_pipeline_end_to_end_then_everything_is_cached(first_run: FirstRun) -> None:
    source, workspace, env, first, first_seconds = (
        first_run.source,
        first_run.workspace,
        first_run.env,
        first_run.summary,
        first_run.seconds,
    )
    assert_shows_what_it_does(first, first_run.console, flow_logs(first["flow_run_id"]))
    assert (
        f"{margin(first['test_accuracy'], first['baseline_accuracy'])} over its baseline's "
        f"{first['baseline_accuracy']:.3f}" in first_run.console
    )

    # Delta: one version holding every image.
    table = DeltaTable(first["delta_table"])
    assert first["delta_version"] == table.version() == 0
    assert first["rows"] == table.to_pyarrow_dataset().count_rows() == 300
    assert (
        first["delta_engine"] == "delta-rs"
    )  # auto, on an embedded Spark (Spark's Delta is forced in tests/test_delta_engines.py)

    # Cache: a manifest per split naming its files, complete.
    cache_dir = Path(first["cache_dir"].removeprefix("file://"))
    for split in ("train", "val", "test"):
        assert split_files(str(cache_dir / f"{split}-v0.json"))[1], split
    assert sum(first["split_counts"].values()) == 300

    # Ray: a checkpoint written under the run's storage path.
    checkpoint = Path(first["checkpoint"])
    assert checkpoint.is_file() and (workspace / "ray_results") in checkpoint.parents

    # MLflow: a registered champion with lineage tags, metrics logged once per epoch (rank 0 only).
    # Both URIs explicitly: MLflow's registry URI is process-global, and other tests point it elsewhere.
    store = f"sqlite:///{workspace / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    mlflow.set_registry_uri(store)
    client = MlflowClient(store, store)
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert str(champion.version) == first["model_version"] == first["champion_version"] == "1"
    assert champion.tags["delta_table"] == first["delta_table"]
    assert champion.tags["delta_version"] == "0"
    assert champion.tags["prefect_flow_run_id"] == first["flow_run_id"]
    assert champion.tags["mlflow_run_id"] == first["mlflow_run_id"]
    logged = mlflow.models.get_model_info(f"models:/{MODEL}/1")
    assert logged.signature is not None and logged.saved_input_example_info is not None
    history = client.get_metric_history(first["mlflow_run_id"], "val_loss")
    assert sorted(m.step for m in history) == list(range(first["epochs_run"]))
    assert client.get_run(first["mlflow_run_id"]).data.params["learning_rate"] == str(2e-3)  # 1e-3 x 2 workers
    assert first["test_accuracy"] > 0.5, f"chance is 0.1; got {first['test_accuracy']}"
    assert {"learning_curves.png", "confusion_matrix.png"} <= {
        a.path for a in client.list_artifacts(first["mlflow_run_id"])
    }
    # Prefect links the flow run to its MLflow run.
    assert f"/runs/{first['mlflow_run_id']}" in flow_artifact(first["flow_run_id"], "imagelake-mlflow-run").data
    assert_knows_the_data_and_the_model(first, client, champion.description)
    assert_started_from_the_imagenet_weights_and_serves_as_trained(first, first_run.console, champion)

    # Second run on unchanged data: every stage reuses its stored result; no new Delta version, no new model version.
    second, second_seconds = run_pipeline(source, workspace, env)
    print(f"first run {first_seconds:.0f} s, cached run {second_seconds:.0f} s")
    assert DeltaTable(first["delta_table"]).version() == 0
    assert (second["delta_version"], second["model_version"], second["mlflow_run_id"]) == (
        0,
        "1",
        first["mlflow_run_id"],
    )
    assert len(client.search_model_versions(f"name='{MODEL}'")) == 1
    # The data stages look again (the table has a version now) but find nothing to decode or write.
    assert (second["files_decoded"], second["rows_added"]) == (0, 0)
    states = task_states(second["flow_run_id"])
    assert {stage: states[stage] for stage in ("split", "cache", "train", "promote")} == {
        stage: "Cached" for stage in ("split", "cache", "train", "promote")
    }
    assert len(list((workspace / "ray_results").iterdir())) == 1, "no second Ray run"

    # A file touched but not changed: it is read and hashed again, but not decoded, and nothing downstream runs.
    touched = sorted((source / "4").glob("*.png"))[0]
    touched.touch()
    third, _ = run_pipeline(source, workspace, env)
    states = task_states(third["flow_run_id"])
    assert states["ingest"] == "Completed" and third["files_decoded"] == 0 and third["files_known"] == 1
    assert {states[stage] for stage in ("split", "cache", "train", "promote")} == {"Cached"}
    assert (third["delta_version"], third["model_version"]) == (0, "1")


@pytest.mark.ends_fixture  # it adds images to the first run's source and versions to its table and model
def test_a_weaker_model_stays_challenger_and_new_images_make_a_new_version(
    first_run: FirstRun, digits_dir: Path, tmp_path: Path, ray_local
) -> None:
    source, workspace, env, first = first_run.source, first_run.workspace, first_run.env, first_run.summary
    assert first["model_alias"] == "champion"

    # New files: ingest onward runs again, the table gets a new version, and a one-epoch model must not win.
    pngs = sorted((source / "7").glob("*.png"))
    for png in pngs[:3]:
        shutil.copy(png, png.with_name("copy-" + png.name))  # known content: not written twice
    for png in pngs[3:5]:
        ImageOps.mirror(Image.open(png)).save(png.with_name("mirrored-" + png.name))  # new content
    (source / "7" / "notes.png").write_text("not an image")
    # This run joins the test process's Ray (as a run on a cluster does) instead of starting a Ray of its own: the
    # first run and the retrain below start theirs as a user's command does.
    import ray

    joined = {**env, "IMAGELAKE_RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    second, _ = run_pipeline(source, workspace, joined, "max_epochs=1", "base_lr=0.00001", "promotion_margin=0.05")
    assert (second["delta_version"], second["rows_added"], second["rows"]) == (1, 2, 302)
    assert second["quarantined"] == {"not_an_image": 1}
    assert quarantine_artifact(second["flow_run_id"]) == [{"reason": "not_an_image", "files": 1}]
    assert second["model_version"] == "2" and second["model_alias"] == "challenger"
    assert second["champion_version"] == "1"
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}", f"sqlite:///{workspace / 'mlflow.db'}")
    tags = client.get_model_version(MODEL, "2").tags
    assert tags["promotion_decision"] == "not promoted" and "does not beat champion" in tags["promotion_reason"]
    assert (tags["compared_with_version"], tags["delta_version"], tags["promotion_metric"]) == ("1", "1", "accuracy")
    assert tags["git_commit"] and json.loads(tags["split_counts"]) == second["split_counts"]
    assert "challenger" in flow_artifact(second["flow_run_id"], "imagelake-promotion").data

    # Operators: lineage, retraining on exactly v1's data, predictions, a forced promotion, a rollback, the history.
    ws = ["--set", f"workspace={workspace}"]
    lineage = run_here(["lineage", MODEL, "1", *ws])
    assert (
        lineage.returncode == 0
        and "delta_version        0" in lineage.stdout
        and f"imagelake retrain --model {MODEL} --version 1" in lineage.stdout
    )
    # As a user runs it: no Prefect API and a Prefect home of its own. Its command starts one Prefect server, which
    # every thread it starts (the progress reports, the lease keeper) reaches; the console shows no error.
    bare = {key: value for key, value in env.items() if not key.startswith("PREFECT_")}
    bare["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    again, servers = run_cli_counting_servers(
        [
            "retrain",
            "--model",
            MODEL,
            "--version",
            "1",
            "--json",
            *ws,
            "--set",
            "max_epochs=1",
            "--set",
            f"model_name={MODEL}",
            "--set",
            "promotion_margin=1",
        ],
        bare,
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    retrain_console = again.stdout + again.stderr
    assert len(servers) == 1, f"Prefect servers started by one command: {sorted(servers)}\n{retrain_console[-4000:]}"
    # Training's reporting thread logged (the Ray workers take longer to start than its first report waits).
    assert "train: waiting for the first epoch" in retrain_console
    for noise in ("Traceback", "ERROR", "database is locked", "WARN", "Starting temporary server"):
        assert noise not in retrain_console, f"{noise!r} on the console:\n{retrain_console[-6000:]}"
    retrained = json.loads(again.stdout.strip().splitlines()[-1])
    assert (retrained["delta_version"], retrained["split_counts"], retrained["model_version"]) == (
        0,
        first["split_counts"],
        "3",
    )
    # Trained as v1 was: each setting v1's run logged is set again, those the command line did not set anew.
    retrained_params = client.get_run(retrained["mlflow_run_id"]).data.params
    first_params = client.get_run(first["mlflow_run_id"]).data.params
    assert retrained_params["shuffle_buffer_batches"] == "1"
    assert {name: value for name, value in retrained_params.items() if name not in ("max_epochs",)} == {
        name: value for name, value in first_params.items() if name not in ("max_epochs",)
    }

    held_out = tmp_path / "held-out"
    write_digits(held_out, size=64, per_label=40)
    for png in digits_dir.rglob("*.png"):  # the first 30 of each digit were in the training data
        (held_out / png.parent.name / png.name).unlink()
    predicted = run_cli(["predict", "--model", f"{MODEL}@champion", "--source", str(held_out), "--json", *ws], env, 300)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = [json.loads(line) for line in predicted.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 100 and all(0 <= row["probability"] <= 1 for row in rows)
    right = sum(row["label"] == Path(row["path"]).parent.name for row in rows)
    assert right > 50, f"{right} of 100 held-out digits right (chance is 10)"

    nothing = run_here(["rollback", "--model", MODEL, *ws])
    assert nothing.returncode == 2 and "nothing to roll back to" in nothing.stderr
    assert run_here(["promote", "--model", MODEL, "--version", "2", "--reason", "e2e check", *ws]).returncode == 0
    back = run_here(["rollback", "--model", MODEL, "--reason", "v2 is worse", *ws])
    assert back.returncode == 0 and "champion v2 -> v1" in back.stdout
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) == "1"
    moves = run_here(["history", "--model", MODEL, *ws]).stdout
    assert "[manual] e2e check" in moves and "[rollback] v2 is worse" in moves and "[gate]" in moves
    unknown = run_here(["promote", "--model", MODEL, "--version", "99", "--reason", "typo", *ws])
    assert unknown.returncode == 2 and "no version '99'" in unknown.stderr


@pytest.mark.xdist_group("e2e-refusal")  # needs no first run: free to run in another process
def test_a_missing_source_fails_with_a_clear_message_and_writes_nothing(tmp_path: Path, prefect_api: str) -> None:
    workspace = tmp_path / "ws"
    done = run_cli(
        ["run", "--source", str(tmp_path / "nowhere"), "--set", f"workspace={workspace}"],
        cli_env({"PREFECT_API_URL": prefect_api}),
    )
    assert done.returncode == 2
    assert "nowhere" in done.stderr and "is not a folder" in done.stderr
    assert not (workspace / "tables").exists()
    # The stage's failure shows as lines, not tracebacks: those are in the command's log file, which the console names.
    (log,) = (workspace / "logs").glob("imagelake-pipeline-*.log")
    assert "Traceback" not in done.stdout + done.stderr and f"(traceback in {log})" in done.stderr, done.stderr
    assert "Traceback" in log.read_text() and "SourceError" in log.read_text()


@pytest.mark.xdist_group("e2e-doctor")  # needs no first run: free to run in another process
def test_doctor_reports_this_machine_and_names_what_is_missing(tmp_path: Path) -> None:
    env = cli_env()
    found = run_cli(["doctor", "--set", f"workspace={tmp_path / 'ws'}"], env, timeout=300)
    assert found.returncode == 0, found.stdout + found.stderr
    lines = {line.split()[1]: line for line in found.stdout.splitlines() if len(line.split()) > 1}
    assert lines["java"].startswith("ok") and "version" in lines["java"]
    assert lines["delta"].startswith("ok") and "delta_writer=auto gives delta-rs" in lines["delta"]
    jars = [line for line in found.stdout.splitlines() if line.split()[1:2] == ["jar"]]
    assert len(jars) == 4 and all(line.startswith("ok") and "SHA-256 as installed" in line for line in jars), jars
    assert lines["gpu"].startswith("absent") and "none" in lines["gpu"]
    assert lines["class"].startswith("ok") and "each driver maps the classes" in lines["class"], lines["class"]
    assert lines["ray"].startswith("ok") and lines["pyarrow"].startswith("ok")
    assert lines["lightning"].startswith("ok") and "pytorch_lightning" in lines["lightning"]
    # What Spark and Ray say as the checks start them goes to the log file the last check line names, not the console.
    console = found.stdout + found.stderr
    for noise in ("WARN", "INFO", "Setting default log level", "Started a local Ray instance"):
        assert noise not in console, f"{noise!r} on the doctor's console:\n{console}"
    log = Path(next(line for line in found.stdout.splitlines() if line.startswith("log ")).split()[1])
    assert log.parent == tmp_path / "ws" / "logs" and "Started a local Ray instance" in log.read_text()

    # A jar whose bytes differ from those installed is named; Spark's Delta forced on it fails the doctor. The doctor
    # checks only Spark from here on (`--only spark`).
    spark_only = ["doctor", "--only", "spark", "--set", f"workspace={tmp_path / 'ws'}"]
    from imagelake.infra.jars import SUMS, jar_folder, runtime_jars

    tampered = tmp_path / "jars"
    tampered.mkdir()
    for jar in runtime_jars():
        (tampered / Path(jar).name).symlink_to(jar)
    sums = (jar_folder() / SUMS).read_text().splitlines()
    sums[0] = "0" * 64 + sums[0][64:]
    (tampered / SUMS).write_text("\n".join(sums) + "\n")
    found = run_cli(
        [*spark_only, "--set", "delta_writer=spark"], {**env, "IMAGELAKE_JARS_DIR": str(tampered)}, timeout=300
    )
    assert found.returncode == 1 and "differs from the SHA-256 recorded at install" in found.stdout, found.stdout
    assert [line.split()[1] for line in found.stdout.splitlines()][:3] == ["spark", "delta", "jar"], found.stdout
    assert " ray " not in found.stdout and " mlflow " not in found.stdout

    # Without the jars (no mvn at install): delta-rs, said so; Spark's Delta forced is an error naming what to do.
    bare = {**env, "IMAGELAKE_JARS_DIR": str(tmp_path / "no-jars")}
    found = run_cli(spark_only, bare, timeout=300)
    assert (
        found.returncode == 0 and "absent: format('delta') is unavailable; Delta tables use delta-rs" in found.stdout
    ), found.stdout
    assert "everything checked is here" in found.stdout
    archive = [line for line in found.stdout.splitlines() if line.split()[1:3] == ["class", "archive"]]
    assert archive and archive[0].startswith("absent"), f"kept with the jars, so none in an empty jar folder: {archive}"
    forced = run_cli([*spark_only, "--set", "delta_writer=spark"], bare, timeout=300)
    assert forced.returncode == 1
    assert "missing: delta jars" in forced.stderr and "make install" in forced.stdout
