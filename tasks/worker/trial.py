"""One trial of a hyperparameter search, as Ray Tune runs it: the train stage's Ray Train run (tasks/worker/trainer.py)
with the trial's settings, its epochs reported to Tune (whose scheduler may stop it early) and logged to an MLflow run
of its own, a child of the search's run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from imagelake.infra.settings import Settings
from imagelake.tasks.results import CachedSplits
from imagelake.tasks.rules.training import logged_params
from imagelake.tasks.worker.trainer import torch_trainer, training_config


def stop_marker(ray_storage_path: str, search_name: str, trial_id: str) -> str:
    """The file whose presence asks the workers of one trial to stop at the end of their epoch (worker/search.py)."""
    return f"{ray_storage_path.rstrip('/')}/{search_name}-{trial_id}.stop"


TRIAL_TAG = "tune_trial"  # on a trial's MLflow run: Tune's trial id
SEARCH_TAG = "tune_search"  # on the search's run and its trials' runs: the search's name
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a child run under its parent


@dataclass(frozen=True)
class TrialJob:
    """What every trial of one search shares (handed to Tune once, through its object store)."""

    cached: CachedSplits
    settings: Settings  # the search's own; a trial's values go over them
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    search_name: str
    callbacks: tuple = ()  # the driver's trainer.WORKER_CALLBACKS


def run_trial(config: dict[str, Any], job: TrialJob) -> None:
    """Tune's trainable: train with CONFIG (the trial's values of the searched settings) over JOB's settings."""
    from mlflow import MlflowClient
    from mlflow.entities import Param
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    trial = tune.get_context().get_trial_id()
    settings = job.settings.model_copy(update=config)
    client = MlflowClient(job.tracking_uri)
    run_id = trial_run(client, job, trial)
    name = f"{job.search_name}-{trial}"
    train_config = {
        **training_config(job.cached, settings, job.tracking_uri, run_id, name),
        "stop_marker": stop_marker(settings.ray_storage_path, job.search_name, trial),
        "callbacks": list(job.callbacks),
    }
    if not client.get_run(run_id).data.params:  # a resumed trial logged them already
        params = {**logged_params(train_config, settings), TRIAL_TAG: trial}
        client.log_batch(run_id, params=[Param(key, value) for key, value in params.items()])
    started = time.monotonic()
    try:
        torch_trainer(train_config, settings, name, callbacks=[TuneReportCallback()]).fit()
    except BaseException:  # an error (the search goes on): the run says so
        client.set_terminated(run_id, status="FAILED")
        raise
    client.log_metric(run_id, "trial_seconds", time.monotonic() - started)
    client.set_terminated(run_id, status="FINISHED")


def trial_run(client: Any, job: TrialJob, trial: str) -> str:
    """The trial's MLflow run: the one an interrupted attempt of it left (a resumed search), else a new child run."""
    found = client.search_runs(
        [job.experiment_id],
        filter_string=f"tags.{SEARCH_TAG} = '{job.search_name}' and tags.{TRIAL_TAG} = '{trial}'",
        max_results=1,
    )
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return found[0].info.run_id
    tags = {PARENT_TAG: job.parent_run_id, SEARCH_TAG: job.search_name, TRIAL_TAG: trial}
    return client.create_run(job.experiment_id, run_name=f"trial-{trial}", tags=tags).info.run_id
