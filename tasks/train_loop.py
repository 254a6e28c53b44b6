"""What each Ray Train worker runs: Lightning on its own Petastorm shard, DDP through Ray."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import ray.train
from mlflow import MlflowClient
from pytorch_lightning.callbacks import Callback, EarlyStopping
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

from tasks.loader import ShardBatches, steps_per_epoch
from tasks.model import ImageClassifier


class MlflowEpochMetrics(Callback):
    """Logs the epoch's metrics to one MLflow run; only rank 0 gets this callback."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, value in trainer.callback_metrics.items():
            self.client.log_metric(self.run_id, name, float(value), step=trainer.current_epoch)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Train the classifier on this worker's shard of the cached train and val splits."""
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    pl.seed_everything(config["seed"], workers=True)
    batch_size = config["batch_size"]
    train_steps = steps_per_epoch(config["train_rows"], batch_size, world)
    val_steps = steps_per_epoch(config["val_rows"], batch_size, world)
    callbacks: list[Callback] = [
        EarlyStopping(monitor="val_loss", mode="min", patience=config["patience"], min_delta=config["min_delta"]),
        RayTrainReportCallback(),
    ]
    if rank == 0 and config.get("mlflow_run_id"):
        callbacks.append(MlflowEpochMetrics(config["tracking_uri"], config["mlflow_run_id"]))
    trainer = pl.Trainer(
        max_epochs=config["max_epochs"],
        accelerator="auto",
        devices="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=train_steps,
        limit_val_batches=val_steps,
        use_distributed_sampler=False,
    )
    trainer = prepare_trainer(trainer)
    model = ImageClassifier(config["num_classes"], config["learning_rate"], config["arch"])
    shard = dict(shard=rank, shard_count=world, batch_size=batch_size, image_size=config["image_size"], seed=config["seed"])
    with ShardBatches(config["train_uri"], steps=train_steps, shuffle=True, **shard) as train_batches, ShardBatches(
        config["val_uri"], steps=val_steps, shuffle=False, **shard
    ) as val_batches:
        trainer.fit(model, train_dataloaders=train_batches, val_dataloaders=val_batches)
