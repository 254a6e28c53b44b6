"""Train: Ray Train's TorchTrainer over the cached splits, with MLflow tracking from rank 0."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import fsspec
from prefect.artifacts import create_link_artifact
from prefect.runtime import flow_run
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE

from imagelake.infra.deadline import sigint_handler_kept
from imagelake.infra.lease import LeaseLost
from imagelake.infra.prefect_env import fence, lease_watch, one_at_a_time
from imagelake.infra.ray_runtime import connect_ray
from imagelake.infra.settings import Settings, stage_settings
from imagelake.infra.tracking import experiment_id, mlflow_client, run_url
from imagelake.tasks.code_graph import code_digest
from imagelake.tasks.data.cache_files import check_split, label_samples, mark_read
from imagelake.tasks.progress import Every, stage_logger
from imagelake.tasks.results import CachedSplits, Trained
from imagelake.tasks.rules.promotion import BASELINE
from imagelake.tasks.rules.training import TRAINING_SETTINGS, logged_params
from imagelake.tasks.rules.warm_start import WarmStart, WeightsShape, decide_warm_start
from imagelake.tasks.stage import stage
from imagelake.tasks.worker.trainer import torch_trainer, training_config

if TYPE_CHECKING:  # torch, Lightning, Ray Train, MLflow and matplotlib load in the functions that use them (start-up)
    from matplotlib.figure import Figure
    from mlflow import MlflowClient
    from ray.train import Result


def run_name(cached: CachedSplits, settings: Settings, fresh: str | None = None, warm_from: str | None = None) -> str:
    """The Ray run's name: the same for the same data, training settings and code, so a retried task resumes that run.

    `fresh` (a refreshed flow run's id) makes a new run: a refresh trains from scratch, its retries resume it.
    `warm_from` (the champion version a warm start begins from) makes a new run when the champion changes.
    """
    code = code_digest(__name__)  # the stage's own code key: every file of imagelake the train stage reaches
    parts = [
        cached.key,
        *(getattr(settings, f) for f in TRAINING_SETTINGS),
        code,
        fresh,
        *([warm_from] if warm_from else []),
    ]
    digest = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:12]
    return f"train-{cached.key}-{digest}"


def warm_start_of(client: MlflowClient, settings: Settings, cached: CachedSplits) -> WarmStart:
    """Where this run's weights start: the champion's if warm_start is on and it was trained for this data's shape."""
    from imagelake.tasks.registry.gate import champion_of

    if not settings.warm_start:
        return WarmStart(None, "warm_start is off")
    wanted = WeightsShape(tuple(cached.labels), cached.image_size, settings.model_arch, settings.resize_mode)
    return decide_warm_start(wanted, champion_of(client, settings.model_name))


def warm_start_key(inputs: dict[str, Any]) -> dict[str, str]:
    """Key part for train with warm_start on: the champion version it would start from, so a new champion trains
    anew."""
    settings: Settings = inputs["settings"]
    if not settings.warm_start:
        return {}
    return {"warm start from": warm_start_of(mlflow_client(settings), settings, inputs["cached"]).source}


def staged_champion_weights(client: MlflowClient, settings: Settings, version: str) -> str:
    """The champion's weights as a state dict file in staging, which every Ray worker reads (as it reads the cache)."""
    import torch

    from imagelake.tasks.registry.loading import champion_state_dict

    uri = f"{settings.staging_uri}/warm-start/{re.sub(r'[^A-Za-z0-9._-]', '_', settings.model_name)}-v{version}.pt"
    fs, path = fsspec.core.url_to_fs(uri)
    if fs.exists(path):  # a registered version's weights never change
        return uri
    buffer = io.BytesIO()
    torch.save(champion_state_dict(client, settings.model_name, version, settings.allow_pickle_models), buffer)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    # Written aside and moved into place: a run beside this one never reads half a file.
    aside = f"{path}.{uuid.uuid4().hex}"
    fs.pipe_file(aside, buffer.getvalue())
    fs.mv(aside, path)
    return uri


def storage_uri(filesystem, path: str) -> str:
    """A path in Ray's storage filesystem (pyarrow) as a URI that fsspec opens: as it is locally, s3://... on S3."""
    kind = getattr(filesystem, "type_name", "local")
    return path if kind == "local" else f"{kind}://{path}"


def ask_workers_to_stop(marker: str, reason: str) -> None:
    from imagelake.tasks.worker.train_loop import ask_to_stop

    ask_to_stop(marker, f"the train lock was lost: {reason}")


def forget_stop_marker(marker: str) -> None:
    from imagelake.tasks.worker.train_loop import forget_stop

    forget_stop(marker)


def fit(
    cached: CachedSplits,
    settings: Settings,
    client: MlflowClient,
    run_id: str,
    name: str,
    warm: WarmStart,
    stop_marker: str | None = None,
) -> Trained:
    """Run the TorchTrainer and return the best checkpoint by validation loss; the workers stop at the end of an
    epoch once STOP_MARKER exists."""
    from mlflow.entities import Param

    from imagelake.tasks.worker.model import pretrained_source

    weights = staged_champion_weights(client, settings, warm.version) if warm.version else None
    config = {
        **training_config(cached, settings, client.tracking_uri, run_id, name, weights),
        "stop_marker": stop_marker,
    }
    pretrained, digest = pretrained_source(settings.model_arch, settings.pretrained)
    params = {
        **logged_params(config, settings),
        "warm_started_from": warm.source,
        "pretrained_weights": pretrained,
        "pretrained_sha256": digest or "none",
    }
    client.log_batch(run_id, params=[Param(key, value) for key, value in params.items()])
    client.set_tag(run_id, "warm_start_reason", warm.reason)
    trainer = torch_trainer(config, settings, name)
    with sigint_handler_kept():  # fit() leaves a SIGINT handler of its own behind: later interrupts must not reach it
        result = trainer.fit()
    return trained_of(result, settings, client, run_id, name, config["learning_rate"], warm)


def trained_of(
    result: Result,
    settings: Settings,
    client: MlflowClient,
    run_id: str,
    name: str,
    learning_rate: float,
    warm: WarmStart,
) -> Trained:
    """A Ray Train result as the stage's result: its best checkpoint by validation loss, and what rank 0 logged."""
    from ray.train.lightning import RayTrainReportCallback

    from imagelake.tasks.worker.train_loop import FIT_SECONDS, STEP_PATH_TAG, WORKER_NODES_TAG

    checkpoint, metrics = min(result.best_checkpoints, key=lambda pair: pair[1]["val_loss"])
    recorded = client.get_run(run_id).data  # what rank 0 logged: its Ray node ids and its fit time
    return Trained(
        checkpoint_path=storage_uri(
            checkpoint.filesystem, os.path.join(checkpoint.path, RayTrainReportCallback.CHECKPOINT_NAME)
        ),
        ray_run_path=storage_uri(result.filesystem, result.path),
        mlflow_run_id=run_id,
        num_workers=settings.num_workers,
        learning_rate=learning_rate,
        run_name=name,
        epochs_run=int((result.metrics or metrics)["epoch"]) + 1,
        best_val_loss=float(metrics["val_loss"]),
        val_accuracy=float(metrics["val_acc"]),
        worker_nodes=json.loads(recorded.tags.get(WORKER_NODES_TAG, "[]")),
        baseline_accuracy=recorded.metrics.get(BASELINE_METRIC),
        fit_seconds=recorded.metrics.get(FIT_SECONDS, 0.0),
        warm_started_from=warm.source,
        pretrained_weights=recorded.params.get("pretrained_weights", "none"),
        pretrained_sha256=recorded.params.get("pretrained_sha256", "none").replace("none", ""),
        step_path=recorded.tags.get(STEP_PATH_TAG, ""),
    )


def finished_training(client: MlflowClient, settings: Settings, name: str, warm: WarmStart) -> Trained | None:
    """The result of Ray run NAME if a run with the same key has finished it (its MLflow run FINISHED, its best
    checkpoint
    still there), else None."""
    from ray.train import Result

    found = client.search_runs(
        [experiment_id(client, settings)],
        filter_string=f"tags.ray_run = '{name}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not found:
        return None
    try:
        trained = trained_of(
            Result.from_path(f"{settings.ray_storage_path}/{name}"),
            settings,
            client,
            found[0].info.run_id,
            name,
            float(found[0].data.params["learning_rate"]),
            warm,
        )
    except (OSError, ValueError, KeyError, RuntimeError):  # its folder or checkpoints are gone: train again
        return None
    fs, path = fsspec.core.url_to_fs(trained.checkpoint_path)
    return trained if fs.exists(path) else None


def training_run(client: MlflowClient, settings: Settings, cached: CachedSplits, name: str) -> str:
    """The MLflow run of Ray run NAME: an unfinished one (a retry resumes both), else a new one."""
    experiment = experiment_id(client, settings)
    for run in client.search_runs(
        [experiment], filter_string=f"tags.ray_run = '{name}'", order_by=["attributes.start_time DESC"], max_results=5
    ):
        if run.info.status != "FINISHED":
            client.update_run(run.info.run_id, status="RUNNING")
            return run.info.run_id
    return client.create_run(
        experiment, run_name=f"train-{cached.key}", tags={"cache_key": cached.key, "ray_run": name}
    ).info.run_id


def learning_curves(client: MlflowClient, run_id: str) -> Figure:
    """Loss and accuracy per epoch, train and validation, from the run's own metric history."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 3.5))
    for axis, metric in zip(figure.subplots(1, 2), ("loss", "acc"), strict=True):
        for split in ("train", "val"):
            history = sorted(client.get_metric_history(run_id, f"{split}_{metric}"), key=lambda m: m.step)
            axis.plot([m.step for m in history], [m.value for m in history], marker="o", label=split)
        axis.set_xlabel("epoch")
        axis.set_title(metric)
        axis.legend()
    figure.tight_layout()
    return figure


class EpochReport:
    """Progress lines for a training run, read from the metrics rank 0 logs to MLflow after every epoch."""

    def __init__(self, client: MlflowClient, run_id: str, max_epochs: int) -> None:
        self.client, self.run_id, self.max_epochs = client, run_id, max_epochs
        self.shown: set[int] = set()
        self.resume_shown = False
        self.started = time.monotonic()

    def lines(self) -> list[str]:
        out = []
        resumed = self.client.get_run(self.run_id).data.tags.get("resumed_after_epoch")
        if resumed is not None and not self.resume_shown:
            self.resume_shown = True
            out.append(
                f"train: resumes after epoch {int(resumed) + 1} of {self.max_epochs} from the interrupted "
                "run's checkpoint"
            )
        history = {
            name: {m.step: m.value for m in self.client.get_metric_history(self.run_id, name)}
            for name in ("train_loss", "val_loss", "val_acc")
        }
        for epoch in sorted(set(history["val_acc"]) - self.shown):
            if all(epoch in values for values in history.values()):
                self.shown.add(epoch)
                out.append(
                    f"train: epoch {epoch + 1} of {self.max_epochs}, train loss {history['train_loss'][epoch]:.3f}, "
                    f"val loss {history['val_loss'][epoch]:.3f}, val accuracy {history['val_acc'][epoch]:.3f}"
                )
        return out

    def show(self, logger, waiting: bool = False) -> None:
        """Log the epochs not shown yet; WAITING: say so when no epoch has ended yet (the Ray workers start, load the
        model and open the loader first: tens of seconds on a small machine)."""
        lines = self.lines()
        if waiting and not lines and not self.shown:
            lines = [f"train: waiting for the first epoch ({time.monotonic() - self.started:.0f} s)"]
        for line in lines:
            logger.info(line)


def log_dataset_card(client: MlflowClient, run_id: str, cached: CachedSplits) -> dict:
    """The data this run trains on, as MLflow artifacts: dataset/card.json, card.md and samples.png."""
    from imagelake.tasks.registry.cards import dataset_card_markdown, dataset_card_of, sample_grid

    card = dataset_card_of(cached)
    client.log_dict(run_id, card, "dataset/card.json")
    client.log_text(run_id, dataset_card_markdown(card, "samples.png"), "dataset/card.md")
    client.log_figure(
        run_id,
        sample_grid(label_samples(cached.splits["train"], cached.image_size, cached.labels)),
        "dataset/samples.png",
    )
    return card


BASELINE_METRIC = "baseline_test_accuracy"


def log_baseline(client: MlflowClient, run_id: str, cached: CachedSplits, settings: Settings) -> None:
    """Fit the run's plain baseline on the same split and log its test accuracy (once: a resumed run has it)."""
    from mlflow.entities import Metric, Param

    from imagelake.tasks.registry.baseline import fit_baseline

    if BASELINE_METRIC in client.get_run(run_id).data.metrics:
        return
    found = fit_baseline(cached.splits["train"], cached.splits["test"], cached.image_size, cached.counts, settings.seed)
    if found is None:
        stage_logger().info(
            "train: no baseline: the train split holds fewer than two labels, or the test split is empty"
        )
        return
    client.log_batch(
        run_id,
        metrics=[Metric(BASELINE_METRIC, found.accuracy, int(time.time() * 1000), 0)],
        params=[
            Param("baseline", BASELINE),
            Param("baseline_rows", f"{found.train_rows} train, {found.test_rows} test"),
        ],
    )
    stage_logger().info(
        f"train: baseline ({BASELINE}, {found.train_rows} training rows): test accuracy {found.accuracy:.3f} "
        f"in {found.seconds:.1f} s"
    )


def train_model(
    cached: CachedSplits, settings: Settings, fresh: str | None = None, on_start: Callable[[str], None] | None = None
) -> Trained:
    """One MLflow run per training: created here (or resumed), filled by rank 0, closed with the outcome.

    `on_start` gets the MLflow run id as soon as the run exists, before any worker starts.
    """
    for split, uri in cached.splits.items():
        check_split(uri, split, cached.counts[split])
    mark_read(list(cached.splits.values()))  # in use from now: `maintain` keeps what a training reads
    connect_ray(settings)
    client = mlflow_client(settings)
    warm = warm_start_of(client, settings, cached)
    name = run_name(cached, settings, fresh, warm.version)
    logger = stage_logger()
    # Two runs of one key at once (a nightly run and an ad-hoc one on the same data) would train into one Ray run and
    # one MLflow run: one trains, and the other waits and takes its result (or, after train_lock_wait_minutes, fails
    # naming the first).
    with one_at_a_time(settings, f"train-{name}", timeout=settings.lock_wait_seconds("train")):
        done = finished_training(client, settings, name, warm)
        if done is not None:
            logger.info(
                f"train: Ray run {name} was trained by another run of the same data, settings and code: its "
                "result is used"
            )
            return done
        return train_in(cached, settings, client, name, warm, on_start)


def train_in(
    cached: CachedSplits,
    settings: Settings,
    client: MlflowClient,
    name: str,
    warm: WarmStart,
    on_start: Callable[[str], None] | None,
) -> Trained:
    """Train as Ray run NAME (resuming it, and its MLflow run, where an earlier attempt left them unfinished)."""
    logger = stage_logger()
    run_id = training_run(client, settings, cached, name)
    logger.info(
        f"train: MLflow run {run_url(client, settings, run_id)} ({settings.num_workers} Ray worker(s), up to "
        f"{settings.max_epochs} epochs)"
    )
    if settings.warm_start:
        logger.info(
            f"train: warm start from {settings.model_name} v{warm.version} ({warm.reason})"
            if warm.version
            else f"train: warm_start is on, but trains from scratch: {warm.reason}"
        )
    report = EpochReport(client, run_id, settings.max_epochs)
    try:
        if on_start is not None:
            on_start(run_id)
        log_dataset_card(client, run_id, cached)
        log_baseline(client, run_id, cached, settings)
        # The train lock is checked as the epochs are reported: a lease lost on the way is said at once, and the
        # result is fenced before it is published (another run of the same training may have entered meanwhile).
        # A lost lease also asks the workers to stop at the end of their epoch: the run's result cannot be used.
        stop = f"{settings.ray_storage_path}/{name}.stop-{uuid.uuid4().hex}"
        watch = lease_watch(f"train-{name}", logger, on_lost=lambda exc: ask_workers_to_stop(stop, str(exc)))
        try:
            with Every(lambda: (report.show(logger, waiting=True), watch()), logger):
                trained = fit(cached, settings, client, run_id, name, warm, stop)
        finally:
            forget_stop_marker(stop)
        report.show(logger)
        fence(f"train-{name}")
        client.log_figure(run_id, learning_curves(client, run_id), "learning_curves.png")
    except LeaseLost:
        raise  # the MLflow run may be another holder's now: left as it is
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FINISHED")
    return trained


@stage(
    "train",
    settings=stage_settings("train"),
    facts=warm_start_key,
    retries=1,
    needs=lambda trained: [trained.checkpoint_path],
)
def train(cached: CachedSplits, settings: Settings) -> Trained:
    """Prefect stage: distributed training on Ray, linked from the flow run to its MLflow run."""

    # A refresh trains from scratch: the flow run's id gives it a Ray run of its own (its retries resume that one).
    def link(run_id: str) -> None:
        create_link_artifact(
            run_url(mlflow_client(settings), settings, run_id),
            link_text=f"MLflow run {run_id}",
            key="imagelake-mlflow-run",
            description=f"Training run (tracking store {settings.tracking_uri}), linked when training starts",
        )

    return train_model(
        cached, settings, fresh=str(flow_run.id) if PREFECT_TASKS_REFRESH_CACHE.value() else None, on_start=link
    )
