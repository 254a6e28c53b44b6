"""Train: Ray Train's TorchTrainer over the cached splits, with MLflow tracking from rank 0."""

from __future__ import annotations

import os

from mlflow import MlflowClient
from mlflow.entities import Param
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.lightning import RayTrainReportCallback
from ray.train.torch import TorchTrainer

from infra.ray_runtime import connect_ray
from infra.settings import Settings
from infra.tracking import experiment_id, mlflow_client
from tasks.results import CachedSplits, Trained
from tasks.stage import stage
from tasks.train_loop import train_loop_per_worker


def scaled_learning_rate(base_lr: float, num_workers: int) -> float:
    """Linear scaling: the global batch grows with the workers, so does the step size."""
    return base_lr * num_workers


def training_config(cached: CachedSplits, settings: Settings, tracking_uri: str, run_id: str) -> dict:
    """Everything a worker needs, as plain values."""
    return {
        "train_uri": cached.splits["train"],
        "val_uri": cached.splits["val"],
        "train_rows": cached.counts["train"],
        "val_rows": cached.counts["val"],
        "num_classes": len(cached.labels),
        "image_size": cached.image_size,
        "arch": settings.model_arch,
        "batch_size": settings.batch_size,
        "learning_rate": scaled_learning_rate(settings.base_lr, settings.num_workers),
        "max_epochs": settings.max_epochs,
        "patience": settings.early_stopping_patience,
        "min_delta": settings.early_stopping_min_delta,
        "seed": settings.seed,
        "tracking_uri": tracking_uri,
        "mlflow_run_id": run_id,
    }


def fit(cached: CachedSplits, settings: Settings, client: MlflowClient, run_id: str) -> Trained:
    """Run the TorchTrainer and return the best checkpoint by validation loss."""
    config = training_config(cached, settings, client.tracking_uri, run_id)
    logged = ("num_classes", "image_size", "arch", "batch_size", "learning_rate", "max_epochs", "patience", "min_delta", "seed")
    params = [Param(name, str(config[name])) for name in logged]
    params += [Param("num_workers", str(settings.num_workers)), Param("base_lr", str(settings.base_lr))]
    client.log_batch(run_id, params=params)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=settings.num_workers,
            use_gpu=settings.use_gpu,
            resources_per_worker={"CPU": settings.cpus_per_worker, **({"GPU": 1} if settings.use_gpu else {})},
        ),
        run_config=RunConfig(
            name=f"train-{cached.key}-{run_id[:8]}",
            storage_path=settings.ray_storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="val_loss", checkpoint_score_order="min"
            ),
        ),
    )
    result = trainer.fit()
    checkpoint, metrics = min(result.best_checkpoints, key=lambda pair: pair[1]["val_loss"])
    return Trained(
        checkpoint_path=os.path.join(checkpoint.path, RayTrainReportCallback.CHECKPOINT_NAME),
        ray_run_path=result.path,
        mlflow_run_id=run_id,
        num_workers=settings.num_workers,
        learning_rate=config["learning_rate"],
        epochs_run=int(result.metrics["epoch"]) + 1,
        best_val_loss=float(metrics["val_loss"]),
        val_accuracy=float(metrics["val_acc"]),
    )


def train_model(cached: CachedSplits, settings: Settings) -> Trained:
    """One MLflow run per training: created here, filled by rank 0, closed with the outcome."""
    connect_ray(settings)
    client = mlflow_client(settings)
    run = client.create_run(experiment_id(client, settings), run_name=f"train-{cached.key}", tags={"cache_key": cached.key})
    try:
        trained = fit(cached, settings, client, run.info.run_id)
    except BaseException:
        client.set_terminated(run.info.run_id, status="FAILED")
        raise
    client.set_terminated(run.info.run_id, status="FINISHED")
    return trained


@stage("train", retries=1)
def train(cached: CachedSplits, settings: Settings) -> Trained:
    """Prefect stage: distributed training on Ray."""
    return train_model(cached, settings)
