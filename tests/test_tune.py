"""Hyperparameter search (`imagelake tune`): the space and its checks, and searches on real Ray Tune, Ray Train, MLflow
and Prefect over a small cache: trials as child runs, a failed trial reported, the best settings promoted through the
gate, a killed search resumed, a time budget."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imagelake.infra.settings import SettingsError, load_settings
from imagelake.tasks.rules.tuning import (
    DEFAULT_SPACE,
    SpaceError,
    best_trial,
    check_space,
    concurrent_trials,
    read_space,
    search_table,
    space_from_text,
)
from tests.conftest import DIGITS, REPO
from tests.faults import KillWorkerOnce, inject
from tests.lake import copy_digits

WHERE = "the test's space"


def test_the_default_space_searches_the_fine_tuning_settings_and_passes_its_own_checks() -> None:
    assert set(DEFAULT_SPACE) == {"base_lr", "backbone_lr_factor", "weight_decay", "augment", "label_smoothing"}
    assert check_space(DEFAULT_SPACE, 160, WHERE) == DEFAULT_SPACE


@pytest.mark.parametrize(
    ("space", "named"),
    [
        ({"batch_size": {"choice": [32, 4096]}}, "batch_size=4096"),  # past the run policy's cap
        ({"workspace": {"choice": ["/elsewhere"]}}, "workspace in the test's space is not a training setting"),
        ({"mlflow_experiment": {"choice": ["other"]}}, "mlflow_experiment"),  # a training setting runs may not set
        ({"learning_rate": {"uniform": [0.1, 0.2]}}, "learning_rate in the test's space is no setting"),
        ({"augment": {"choice": ["heavy"]}}, "augment='heavy'"),
        ({"base_lr": {"loguniform": [0, 0.1]}}, "base_lr in the test's space: loguniform needs low < high and low"),
        ({"base_lr": {"normal": [0, 1]}}, "base_lr in the test's space must be one of"),
        ({"batch_size": {"randint": [16.5, 64]}}, "randint takes two integers"),
        ({"image_size": {"choice": [160, 224]}}, "the cache holds images of 160 px only"),
    ],
)
def test_a_space_a_run_may_not_set_is_refused_naming_the_setting(space: dict, named: str) -> None:
    with pytest.raises(SettingsError, match=named.replace("(", r"\(").replace("[", r"\[")):
        check_space(space, 160, WHERE)


def test_a_space_file_is_read_and_a_missing_or_empty_one_is_named(tmp_path: Path) -> None:
    good = tmp_path / "space.yaml"
    good.write_text("base_lr: {loguniform: [0.0001, 0.01]}\naugment: {choice: [none, light]}\n")
    assert check_space(read_space(good), 160, WHERE) == {
        "base_lr": {"loguniform": [0.0001, 0.01]},
        "augment": {"choice": ["none", "light"]},
    }
    with pytest.raises(SpaceError, match="missing.yaml does not exist"):
        read_space(tmp_path / "missing.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(SpaceError, match="empty.yaml holds no mapping"):
        read_space(tmp_path / "empty.yaml")


@pytest.mark.parametrize(
    ("cluster", "workers", "gpu", "gpus_per_worker", "expected"),
    [
        ({"CPU": 3}, 2, False, 1.0, 1),  # this 2-core machine's local Ray, two workers: one trial at a time
        ({"CPU": 2}, 1, False, 1.0, 1),  # one worker
        ({"CPU": 16, "GPU": 1}, 1, True, 1.0, 1),  # one GPU, a whole GPU per trial
        ({"CPU": 16, "GPU": 1}, 1, True, 0.25, 4),  # a GPU node shared by four trials
        ({"CPU": 64, "GPU": 8}, 2, True, 1.0, 4),  # eight GPUs, two per trial
    ],
)
def test_trials_run_side_by_side_as_far_as_the_cluster_holds_them(
    cluster: dict, workers: int, gpu: bool, gpus_per_worker: float, expected: int
) -> None:
    assert concurrent_trials(cluster, workers, 1.0, gpu, gpus_per_worker) == expected


def test_the_search_table_puts_the_best_trial_first_and_trials_without_a_result_last() -> None:
    rows = [
        {"trial": "a", "settings": {"base_lr": 0.001}, "val_acc": 0.5, "epochs": 2, "seconds": 30.0, "ended": "x"},
        {"trial": "b", "settings": {"base_lr": 0.003}, "val_acc": None, "epochs": 0, "seconds": 1.0, "ended": "y"},
        {"trial": "c", "settings": {"base_lr": 0.01}, "val_acc": 0.75, "epochs": 1, "seconds": 20.0, "ended": "z"},
    ]
    table = search_table(rows).splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["c", "a", "b"]
    assert "| c | base_lr=0.01 | 0.750 | 1 | 20 | z |" in table
    assert best_trial(rows)["trial"] == "c"
    assert best_trial([rows[1]]) is None


def test_the_tune_flow_s_form_refuses_a_search_of_no_trials_before_any_work() -> None:
    from prefect.exceptions import ParameterTypeError

    from imagelake.flows.tune import tune_flow

    with pytest.raises(ParameterTypeError, match="trials"):
        tune_flow.validate_parameters({"source": "x", "trials": 0})


def test_the_tune_deployment_s_form_is_typed_and_takes_the_space_as_text() -> None:
    """The Prefect UI has no input for a free-form mapping: the form's space is YAML or JSON text, read by the flow;
    the search's fields are tune_flow's own (types, defaults, limits), the run's settings the ad-hoc form's."""
    from prefect.exceptions import ParameterTypeError

    from imagelake.flows.pipeline import RunParameters
    from imagelake.flows.tune import TuneParameters, tune_adhoc

    fields = tune_adhoc.parameters.model_dump()["definitions"]["TuneParameters"]["properties"]
    assert (
        fields["trials"]["type"] == "integer" and fields["trials"]["default"] == 8 and fields["trials"]["minimum"] == 1
    )
    assert fields["space"]["type"] == "string" and fields["promote"]["type"] == "boolean"
    assert set(RunParameters.model_fields) < set(TuneParameters.model_fields)
    with pytest.raises(ParameterTypeError, match="trials"):
        tune_adhoc.validate_parameters({"params": {"source": "x", "trials": 0}})
    text = "{base_lr: {loguniform: [0.0001, 0.01]}, augment: {choice: [none, light]}}"
    assert space_from_text(text, WHERE) == space_from_text(
        json.dumps({"base_lr": {"loguniform": [0.0001, 0.01]}, "augment": {"choice": ["none", "light"]}}), WHERE
    )
    with pytest.raises(SpaceError, match="the test's space is not YAML"):
        space_from_text("{base_lr: [", WHERE)
    with pytest.raises(SpaceError, match="the test's space holds no mapping of settings to dimensions: write it as"):
        space_from_text("0.001", WHERE)


def child_runs(tracking_uri: str, parent: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    return client.search_runs(
        [client.get_run(parent).info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'"
    )


@pytest.mark.slow
def test_a_search_logs_each_trial_as_a_child_run_reports_a_failed_one_and_promotes_the_best(
    spark, ray_local, prefect_api: str, digits_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Two trials of one epoch: the first loses its worker (max_failures=0: it fails), the second trains. The failure
    is a row of the search's table, not the search's end; the best settings are saved as a settings file and, with
    promote, trained and registered through the gate."""
    from mlflow import MlflowClient

    from imagelake.flows.tune import tune_flow

    copy_digits(digits_dir, tmp_path / "src", labels=DIGITS, per_label=10)
    inject(monkeypatch, KillWorkerOnce(0, 0, str(tmp_path / "killed")))
    overrides = {
        "workspace": str(tmp_path / "ws"),
        "image_size": 24,
        "max_epochs": 1,
        "num_workers": 1,
        "max_failures": 0,
        "model_name": "tune-test",
    }
    space = {"base_lr": {"choice": [0.002, 0.004]}, "label_smoothing": {"uniform": [0.0, 0.1]}}
    summary = tune_flow(source=str(tmp_path / "src"), trials=2, space=space, promote=True, overrides=overrides)

    settings = load_settings(overrides=overrides)
    failed = [row for row in summary["trials"] if row["ended"].startswith("failed")]
    trained = [row for row in summary["trials"] if row["val_acc"] is not None]
    assert len(summary["trials"]) == 2 and len(failed) == 1 and len(trained) == 1, summary["trials"]
    runs = {run.data.tags["tune_trial"]: run for run in child_runs(settings.tracking_uri, summary["mlflow_run_id"])}
    assert set(runs) == {row["trial"] for row in summary["trials"]}
    assert runs[failed[0]["trial"]].info.status == "FAILED"
    best = runs[trained[0]["trial"]]
    client = MlflowClient(settings.tracking_uri)
    assert [m.step for m in client.get_metric_history(best.info.run_id, "val_acc")] == [0], "its curve, per epoch"
    assert float(best.data.params["base_lr"]) == trained[0]["settings"]["base_lr"]
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["best_val_acc"] == trained[0]["val_acc"]
    assert "search/trials.md" in [a.path for a in client.list_artifacts(parent.info.run_id, "search")]
    saved = load_settings(summary["settings_file"])
    assert saved.base_lr == trained[0]["settings"]["base_lr"] and saved.max_epochs == 1
    promoted = summary["promoted"]
    assert promoted["model_name"] == "tune-test" and promoted["model_version"] == "1", promoted
    version = client.get_model_version("tune-test", "1")
    assert float(client.get_run(version.run_id).data.params["base_lr"]) == trained[0]["settings"]["base_lr"]


RESUMED_SEARCH = """
import json, sys
from imagelake.infra.settings import load_settings
from imagelake.tasks.results import CachedSplits
from imagelake.tasks.stages.tune import Search, search_hyperparameters

cached, overrides, space = (json.loads(arg) for arg in sys.argv[1:4])
search = Search(space=space, trials=2)
searched = search_hyperparameters(CachedSplits(**cached), load_settings(overrides=overrides), search)
print(json.dumps(searched.model_dump()))
"""


@pytest.mark.slow
def test_a_search_killed_mid_way_resumes_without_running_its_finished_trials_again(
    digits_cached, settings, ray_local, tmp_path: Path
) -> None:
    """A search of two trials is killed once its first trial has finished; started again, it runs the other one
    only: the first trial's run is not repeated (one run, one epoch logged)."""
    from mlflow import MlflowClient

    overrides = {"workspace": str(settings.workspace), "image_size": 24, "max_epochs": 1, "num_workers": 1}
    space = {"base_lr": {"choice": [0.001, 0.004]}}
    cached = {**digits_cached.model_dump(mode="json"), "reused": False}
    script = [sys.executable, "-c", RESUMED_SEARCH, json.dumps(cached), json.dumps(overrides), json.dumps(space)]
    searching = subprocess.Popen(script, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE, text=True)
    client = MlflowClient(load_settings(overrides=overrides).tracking_uri)
    try:
        finished = []
        while not finished:
            assert searching.poll() is None, "the search ended before it was killed"
            time.sleep(2)
            finished = [run for run in trial_runs(client, settings.mlflow_experiment) if run.info.status == "FINISHED"]
    finally:
        os.killpg(searching.pid, signal.SIGKILL)
        searching.wait()
    done_first = finished[0].data.tags["tune_trial"]

    from imagelake.tasks.stages.tune import Search, search_hyperparameters

    resumed = search_hyperparameters(digits_cached, load_settings(overrides=overrides), Search(space=space, trials=2))
    assert len(resumed.trials) == 2 and all(row["epochs"] == 1 for row in resumed.trials), resumed.trials
    runs = child_runs(load_settings(overrides=overrides).tracking_uri, resumed.mlflow_run_id)
    assert sorted(run.data.tags["tune_trial"] for run in runs) == sorted(row["trial"] for row in resumed.trials)
    first = [run for run in runs if run.data.tags["tune_trial"] == done_first]
    assert len(first) == 1 and first[0].info.run_id == finished[0].info.run_id
    assert len(client.get_metric_history(first[0].info.run_id, "val_acc")) == 1, "the finished trial ran once"


def trial_runs(client, experiment_name: str) -> list:
    """The trials' MLflow runs so far, none while the searching process is still creating the store."""
    try:
        experiment = client.get_experiment_by_name(experiment_name)
    except Exception:  # noqa: BLE001 - the store is being created by the other process
        return []
    return [] if experiment is None else client.search_runs([experiment.experiment_id], "tags.tune_trial != ''")


@pytest.mark.slow
def test_the_time_budget_ends_a_search_before_all_its_trials_ran(digits_cached, settings, ray_local) -> None:
    from imagelake.tasks.stages.tune import Search, search_hyperparameters

    budgeted = settings.model_copy(update={"image_size": 24, "max_epochs": 1, "num_workers": 1})
    searched = search_hyperparameters(
        digits_cached, budgeted, Search(space={"base_lr": {"choice": [0.001, 0.002]}}, trials=3, time_budget_s=1)
    )
    assert len(searched.trials) < 3, searched.trials
    assert Path(searched.settings_file).is_file()
