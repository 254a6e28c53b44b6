"""Tune: a hyperparameter search with Ray Tune over the cached splits, each trial the train stage's Ray Train run
(tasks/worker/trial.py), stopped early by ASHA on validation accuracy, within a time budget; MLflow holds the search as
a parent run and each trial as a child run."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
from prefect.artifacts import create_markdown_artifact

from imagelake.infra.prefect_env import one_at_a_time
from imagelake.infra.ray_runtime import connect_ray
from imagelake.infra.run_policy import ALLOWED_FROM_RUNS
from imagelake.infra.settings import Settings, stage_settings
from imagelake.infra.tracking import experiment_id, mlflow_client, run_url
from imagelake.tasks.code_graph import code_digest
from imagelake.tasks.data.cache_files import check_split, mark_read
from imagelake.tasks.progress import Every, stage_logger
from imagelake.tasks.results import CachedSplits, Searched
from imagelake.tasks.rules.training import TRAINING_SETTINGS
from imagelake.tasks.rules.tuning import TRIAL_DRIVER_CPUS, best_trial, concurrent_trials, search_table
from imagelake.tasks.stage import stage
from imagelake.tasks.worker import trainer
from imagelake.tasks.worker.trial import SEARCH_TAG, TRIAL_TAG, TrialJob, run_trial, stop_marker

if TYPE_CHECKING:  # Ray Tune and MLflow load in the functions that use them (start-up)
    from mlflow import MlflowClient
    from ray.tune import ResultGrid


@dataclass(frozen=True)
class Search:
    """What to search: SPACE (checked: tasks/rules/tuning.py:check_space), how many trials, and for how long."""

    space: dict[str, dict[str, list[Any]]]
    trials: int = 8
    time_budget_s: float | None = None
    seed: int = field(default=0)  # the sampler's: the same search draws the same trials


def search_name(cached: CachedSplits, settings: Settings, search: Search) -> str:
    """The search's Ray Tune experiment: the same for the same cache, training settings, search and code, so that a
    search killed mid-way and started again resumes it."""
    parts = [
        cached.key,
        *(getattr(settings, name) for name in TRAINING_SETTINGS),
        search.space,
        search.trials,
        search.seed,
        code_digest(__name__),
    ]
    return f"tune-{cached.key}-{hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:12]}"


def tune_space(space: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    """A checked space as Ray Tune's sampling domains."""
    from ray import tune

    kinds = {
        "choice": lambda values: tune.choice(values),
        "uniform": lambda bounds: tune.uniform(*bounds),
        "loguniform": lambda bounds: tune.loguniform(*bounds),
        "randint": lambda bounds: tune.randint(*bounds),
    }
    return {name: kinds[kind](values) for name, dimension in space.items() for kind, values in dimension.items()}


def search_run(client: MlflowClient, experiment: str, name: str, search: Search, cached: CachedSplits) -> str:
    """The search's MLflow run: the one an interrupted attempt left, else a new one with the search's parameters."""
    found = client.search_runs([experiment], filter_string=f"tags.{SEARCH_TAG} = '{name}'", max_results=20)
    parents = [run for run in found if TRIAL_TAG not in run.data.tags]
    if parents:
        client.update_run(parents[0].info.run_id, status="RUNNING")
        return parents[0].info.run_id
    run_id = client.create_run(
        experiment, run_name=f"search-{cached.key}", tags={SEARCH_TAG: name, "cache_key": cached.key}
    ).info.run_id
    client.log_param(run_id, "trials", search.trials)
    client.log_param(run_id, "time_budget_s", search.time_budget_s)
    client.log_dict(run_id, search.space, "search/space.json")
    return run_id


def run_search(job: TrialJob, search: Search, settings: Settings, concurrent: int) -> ResultGrid:
    """Ray Tune's search, resumed where an earlier attempt left its experiment (finished trials are not run again;
    a trial that failed stays failed)."""
    from ray import tune

    from imagelake.tasks.worker.search import BudgetedVariants, EpochEndASHA

    trainable = tune.with_resources(tune.with_parameters(run_trial, job=job), {"CPU": TRIAL_DRIVER_CPUS})
    path = f"{settings.ray_storage_path.rstrip('/')}/{job.search_name}"
    if tune.Tuner.can_restore(path):
        stage_logger().info(f"tune: resumes the search at {path}; its finished trials are kept")
        return tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=False).fit()
    # The budget counts from the search's first start: a resumed search keeps it.
    deadline = time.time() + search.time_budget_s if search.time_budget_s else None
    tuner = tune.Tuner(
        trainable,
        param_space=tune_space(search.space),
        tune_config=tune.TuneConfig(
            metric="val_acc",
            mode="max",
            num_samples=search.trials,
            scheduler=EpochEndASHA(
                settings.ray_storage_path,
                job.search_name,
                deadline,
                time_attr="training_iteration",
                max_t=settings.max_epochs,
                grace_period=1,
            ),
            # The sampler limits how many trials run at once (Tune's max_concurrent_trials is ignored beside it).
            search_alg=BudgetedVariants(deadline, random_state=search.seed, max_concurrent=concurrent),
        ),
        run_config=tune.RunConfig(
            name=job.search_name,
            storage_path=settings.ray_storage_path,
            failure_config=tune.FailureConfig(max_failures=0),
            verbose=0,
        ),
    )
    return tuner.fit()


def trial_rows(grid: ResultGrid, client: MlflowClient, job: TrialJob) -> list[dict[str, Any]]:
    """One row per trial: its settings, best validation accuracy, epochs, seconds, how it ended and its MLflow run.
    A trial that the scheduler stopped left its MLflow run running: it is closed here as KILLED."""
    runs = {
        run.data.tags[TRIAL_TAG]: run
        for run in client.search_runs(
            [job.experiment_id], filter_string=f"tags.{SEARCH_TAG} = '{job.search_name}'", max_results=1000
        )
        if TRIAL_TAG in run.data.tags
    }
    rows = []
    for index, result in enumerate(grid):
        trial = str((result.metrics or {}).get("trial_id") or f"#{index}")  # Tune's id, once the trial reported
        run = runs.get(trial)
        # Each epoch's validation accuracy as the trial's MLflow run holds it: a resumed search's Tune results do not
        # carry the history of the trials finished before it was interrupted.
        accuracies = (
            [metric.value for metric in client.get_metric_history(run.info.run_id, "val_acc")]
            if run is not None
            else []
        )
        marker = stop_marker(job.settings.ray_storage_path, job.search_name, trial)
        ended = ended_as(result, run, len(accuracies), job.settings.max_epochs, asked_why(marker))
        if run is not None and run.info.status == "RUNNING":  # a trial whose process ended before it could say
            client.set_terminated(run.info.run_id, status="KILLED")
        rows.append(
            {
                "trial": trial,
                "settings": {name: result.config[name] for name in sorted(result.config or {})},
                "val_acc": max(accuracies) if accuracies else None,
                "epochs": len(accuracies),
                "seconds": float((result.metrics or {}).get("time_total_s", 0.0)),
                "ended": ended,
                "mlflow_run_id": run.info.run_id if run is not None else None,
            }
        )
    return rows


def ended_as(result: Any, run: Any, epochs: int, max_epochs: int, asked: str | None) -> str:
    """How one trial ended, in words (ASKED: why the search asked it to stop, if it did)."""
    if result.error is not None:
        return f"failed: {type(result.error).__name__}: {str(result.error).strip().splitlines()[-1][:200]}"
    if run is None or epochs == 0:
        return "not run"
    if asked:
        return f"{asked} after {epochs} epoch(s)"
    return "finished" if epochs >= max_epochs else f"finished: early stopping after {epochs} epoch(s)"


def asked_why(marker: str) -> str | None:
    """Why the search asked a trial to stop (its stop marker's text), or None; the marker is removed once read."""
    fs, path = fsspec.core.url_to_fs(marker)
    if not fs.exists(path):
        return None
    why = fs.cat_file(path).decode()
    fs.rm(path)
    return why


def best_settings_file(settings: Settings, values: dict[str, Any], name: str) -> Path:
    """The best trial's training settings as a settings file (--config, config_file) in the workspace."""
    import yaml

    best = settings.model_copy(update=values).model_dump(mode="json")
    # What a run may set (so a deployment run can name the file too): where it tracks and stores is the worker's.
    recipe = {key: best[key] for key in TRAINING_SETTINGS if key in best and key in ALLOWED_FROM_RUNS}
    path = settings.workspace_dir / "searches" / f"{name}-best.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# The training settings of the best trial of search {name} (imagelake tune).\n"
        + yaml.safe_dump(recipe, sort_keys=True)
    )
    return path


def close_search(client: MlflowClient, run_id: str, rows: list[dict[str, Any]], path: Path) -> None:
    """The search's table, its best trial and its settings file on the parent run."""
    from mlflow.entities import Metric

    best = best_trial(rows)
    client.log_text(run_id, search_table(rows), "search/trials.md")
    client.log_dict(run_id, rows, "search/trials.json")
    client.log_artifact(run_id, str(path), "search")
    if best is not None:
        client.log_batch(run_id, metrics=[Metric("best_val_acc", best["val_acc"], int(time.time() * 1000), 0)])
        client.set_tag(run_id, "best_trial", best["trial"])
    client.set_terminated(run_id, status="FINISHED")


def search_hyperparameters(cached: CachedSplits, settings: Settings, search: Search) -> Searched:
    """Run (or resume) the search and return its trials and the best one's settings."""
    for split, uri in cached.splits.items():
        check_split(uri, split, cached.counts[split])
    mark_read(list(cached.splits.values()))  # in use from now: `maintain` keeps what a search reads
    resources = connect_ray(settings)
    client = mlflow_client(settings)
    experiment = experiment_id(client, settings)
    name = search_name(cached, settings, search)
    logger = stage_logger()
    started = time.monotonic()
    # Two runs of one search at once would write one Tune experiment: one searches, the other waits for it.
    with one_at_a_time(settings, name, timeout=settings.lock_wait_seconds("train")):
        parent = search_run(client, experiment, name, search, cached)
        job = TrialJob(cached, settings, client.tracking_uri, experiment, parent, name, tuple(trainer.WORKER_CALLBACKS))
        concurrent = concurrent_trials(
            resources, settings.num_workers, settings.cpus_per_worker, settings.use_gpu, settings.gpus_per_worker
        )
        budget = f", for at most {search.time_budget_s:g} s" if search.time_budget_s else ""
        logger.info(
            f"tune: {search.trials} trial(s) of up to {settings.max_epochs} epoch(s), {concurrent} at a time{budget}; "
            f"MLflow run {run_url(client, settings, parent)}"
        )
        try:
            with Every(lambda: logger.info(f"tune: {progress(client, job)}"), logger):
                grid = run_search(job, search, settings, concurrent)
        except BaseException:
            client.set_terminated(parent, status="FAILED")
            raise
        rows = trial_rows(grid, client, job)
        best = best_trial(rows)
        values = best["settings"] if best is not None else {}
        path = best_settings_file(settings, values, name)
        close_search(client, parent, rows, path)
    return Searched(
        search_name=name,
        mlflow_run_id=parent,
        trials=rows,
        best_settings=values,
        best_val_accuracy=best["val_acc"] if best is not None else None,
        settings_file=str(path),
        seconds=time.monotonic() - started,
    )


def progress(client: MlflowClient, job: TrialJob) -> str:
    """Where the search is: trials started and finished, and the best validation accuracy so far."""
    runs = client.search_runs(
        [job.experiment_id], filter_string=f"tags.{SEARCH_TAG} = '{job.search_name}'", max_results=1000
    )
    trials = [run for run in runs if TRIAL_TAG in run.data.tags]
    done = sum(run.info.status != "RUNNING" for run in trials)
    best = max((run.data.metrics.get("val_acc", -math.inf) for run in trials), default=-math.inf)
    shown = f", best val accuracy so far {best:.3f}" if best > -math.inf else ""
    return f"{len(trials)} trial(s) started, {done} ended{shown}"


@stage("tune", settings=stage_settings("tune"), retries=1)
def tune(cached: CachedSplits, settings: Settings, search: Search) -> Searched:
    """Prefect stage: the search, its table as an artifact of the flow run."""
    searched = search_hyperparameters(cached, settings, search)
    create_markdown_artifact(
        f"Search {searched.search_name}: {len(searched.trials)} trial(s) in {searched.seconds:.0f} s; best settings "
        f"in {searched.settings_file}\n\n{search_table(searched.trials)}",
        key="imagelake-search",
        description="The hyperparameter search's trials, best first",
    )
    return searched
