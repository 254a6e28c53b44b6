"""The driver's side of one Ray Train run: the workers' config as plain values, and the TorchTrainer that runs
train_loop_per_worker with it. The train stage and every trial of a search (tasks/worker/trial.py) build their run here,
so a trial trains exactly as the train stage does.

Light to import: Ray Train, torch and Lightning load in `torch_trainer`, where a run is built (start-up)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from imagelake.infra.settings import Settings
from imagelake.tasks.results import CachedSplits
from imagelake.tasks.rules.training import scaled_learning_rate

if TYPE_CHECKING:
    from ray.train.torch import TorchTrainer

# Extra Lightning callbacks that every worker of every training (a stage's, a search's trials) adds to its trainer,
# shipped in the workers' config: a plugin's, or the faults a test injects (tests/faults.py). Empty in a run.
WORKER_CALLBACKS: list[Any] = []


def training_config(
    cached: CachedSplits,
    settings: Settings,
    tracking_uri: str,
    run_id: str,
    name: str,
    warm_start_weights: str | None = None,
) -> dict:
    """Everything a worker needs, as plain values; `warm_start_weights` is a state dict file the model starts from."""
    return {
        "train_uri": cached.splits["train"],
        "val_uri": cached.splits["val"],
        "train_rows": cached.counts["train"],
        "val_rows": cached.counts["val"],
        "num_classes": len(cached.labels),
        "image_size": cached.image_size,
        "arch": settings.model_arch,
        "pretrained": settings.pretrained,
        "freeze_backbone": settings.freeze_backbone,
        "backbone_lr_factor": settings.backbone_lr_factor,
        "augment": settings.augment,
        "augment_flip": settings.augment_flip,
        "label_smoothing": settings.label_smoothing,
        "weight_decay": settings.weight_decay,
        "class_weights": settings.class_weights,
        "loss_weights": balanced_weights(cached) if settings.class_weights == "balanced" else None,
        "max_train_minutes": settings.max_train_minutes,
        "warm_start_weights": warm_start_weights,
        "batch_size": settings.batch_size,
        "learning_rate": scaled_learning_rate(settings.base_lr, settings.num_workers, settings.lr_scaling),
        "lr_scaling": settings.lr_scaling,
        "max_epochs": settings.max_epochs,
        "patience": settings.patience,
        "min_delta": settings.early_stopping_min_delta,
        "stopping_threshold": settings.early_stopping_threshold,
        "seed": settings.seed,
        "use_gpu": settings.use_gpu,
        "bf16": settings.bf16,
        "channels_last": settings.channels_last,
        "pin_memory": settings.pin_memory,
        "compile": settings.compile,
        "compile_mode": settings.compile_mode,
        "loader_workers": settings.loader_workers,
        "loader_processes": settings.loader_processes,
        "jpeg_decode": settings.jpeg_decode,
        "shuffle_buffer_batches": settings.shuffle_buffer_batches,
        "tracking_uri": tracking_uri,
        "mlflow_run_id": run_id,
        "run_path": f"{settings.ray_storage_path.rstrip('/')}/{name}",
        "callbacks": list(WORKER_CALLBACKS),
    }


def balanced_weights(cached: CachedSplits) -> list[float]:
    """Each label's weight in the training loss: the inverse of its share of the train split (1 for every label of a
    balanced one). A label with no training image gets 0: it never appears in the loss."""
    counts = [cached.label_counts.get("train", {}).get(label, 0) for label in cached.labels]
    total, present = sum(counts), sum(1 for count in counts if count)
    return [total / (present * count) if count else 0.0 for count in counts]


def torch_trainer(config: dict[str, Any], settings: Settings, name: str, callbacks: Sequence[Any] = ()) -> TorchTrainer:
    """The TorchTrainer of Ray run NAME: SETTINGS' workers, each running train_loop_per_worker on CONFIG; the best two
    checkpoints by validation loss kept. CALLBACKS are Ray Train's (a search's trial adds Tune's report callback).

    Ray Train resumes a run whose (storage_path, name) already holds checkpoints: a retried task, a re-run after a
    crash or a search's interrupted trial continues from the latest checkpoint instead of starting over."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from imagelake.tasks.worker.train_loop import LightningMismatch, ray_lightning_problem, train_loop_per_worker

    problem = ray_lightning_problem()
    if problem:  # every worker would fail on it, after Ray's start-up
        raise LightningMismatch(problem)
    run_config = RunConfig(
        name=name,
        storage_path=settings.ray_storage_path,
        failure_config=FailureConfig(max_failures=settings.max_failures),
        checkpoint_config=CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute="val_loss", checkpoint_score_order="min"
        ),
        callbacks=list(callbacks),
    )
    scaling = ScalingConfig(
        num_workers=settings.num_workers,
        use_gpu=settings.use_gpu,
        resources_per_worker={
            "CPU": settings.cpus_per_worker,
            **({"GPU": settings.gpus_per_worker} if settings.use_gpu else {}),
        },
        placement_strategy=settings.ray_placement_strategy,
    )
    return TorchTrainer(train_loop_per_worker, train_loop_config=config, scaling_config=scaling, run_config=run_config)
