"""What each Ray Train worker runs: Lightning on its own Petastorm shard, DDP through Ray, resuming from the last
checkpoint."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import ray.train
import torch
from pyarrow.fs import FileType
from pytorch_lightning.callbacks import Callback, EarlyStopping, Timer
from ray.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)

from imagelake.infra.compat import report_callback_staging
from imagelake.infra.errors import PermanentError
from imagelake.tasks.data.cache_files import split_format
from imagelake.tasks.rules.training import step_path
from imagelake.tasks.worker.loader import ShardBatches
from imagelake.tasks.worker.model import ImageClassifier, load_state_dict

CHECKPOINT_FILE = RayTrainReportCallback.CHECKPOINT_NAME
WORKER_NODES_TAG = "ray_worker_nodes"  # the Ray node id of each rank, in rank order
STEP_PATH_TAG = "step_path"  # how rank 0 stepped the model (eager or a compiled mode) and why
FIT_SECONDS = "fit_seconds"  # rank 0's seconds in Lightning's fit, logged to the MLflow run


class LightningMismatch(PermanentError, RuntimeError):
    """Ray Train's Lightning integration is built on another Lightning package than imagelake's trainer."""


def ray_lightning_problem(strategy: type = RayDDPStrategy) -> str | None:
    """Why Ray Train's Lightning classes cannot drive imagelake's `pytorch_lightning` Trainer, or None if they can.

    Ray's integration builds on `lightning.pytorch` whenever the `lightning` package is importable, and on
    `pytorch_lightning` only otherwise: with both installed, its strategy is not one of this Trainer's.
    """
    if issubclass(strategy, pl.strategies.Strategy):
        return None
    return (
        f"Ray Train's {strategy.__name__} comes from {strategy.__mro__[1].__module__.split('.')[0]}, not "
        "pytorch_lightning: the `lightning` "
        "package is installed beside `pytorch-lightning`, and Ray's Lightning integration then uses it. "
        "imagelake trains with "
        "pytorch_lightning: uninstall `lightning` (pip uninstall lightning) where the driver and the Ray workers run"
    )


class CheckpointUnusable(PermanentError, RuntimeError):
    """No checkpoint of an interrupted run can be read: resuming would silently start over."""


def checkpoint_epoch(path: str) -> int | None:
    """The epoch a Lightning checkpoint file was saved at, or None if it does not load or lacks weights and an epoch."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values: never code
    except Exception:  # a truncated or garbled file raises any of several errors
        return None
    return int(state["epoch"]) if isinstance(state, dict) and "state_dict" in state and "epoch" in state else None


def resume_checkpoint(latest: str | None, run_path: str | None) -> str | None:
    """The checkpoint file to resume from (see resume_point)."""
    return resume_point(latest, run_path)[0]


def resume_point(latest: str | None, run_path: str | None) -> tuple[str | None, int]:
    """The checkpoint file to resume from and its epoch: Ray's latest if it reads, else the newest older one that does.

    (None, -1) means there is nothing to resume (a fresh run). A run that has checkpoints, none of which
    read, fails with CheckpointUnusable rather than starting again from scratch.
    """
    if latest is None:
        return None, -1
    candidates = [os.path.join(latest, CHECKPOINT_FILE)]
    if run_path:
        older = sorted(
            glob.glob(os.path.join(run_path, "**", "checkpoint_*", CHECKPOINT_FILE), recursive=True), reverse=True
        )
        candidates += [path for path in older if os.path.dirname(path) != os.path.normpath(latest)]
    for path in candidates:
        epoch = checkpoint_epoch(path) if os.path.exists(path) else None
        if epoch is not None:
            return path, epoch
    raise CheckpointUnusable(
        f"the run at {run_path or latest} was interrupted, but none of its checkpoints can be read "
        f"({', '.join(candidates)}); "
        "delete that folder to train from scratch on purpose"
    )


class MlflowEpochMetrics(Callback):
    """Logs the epoch's metrics to one MLflow run; only rank 0 gets this callback."""

    def __init__(self, tracking_uri: str, run_id: str, after_epoch: int = -1) -> None:
        from mlflow import MlflowClient  # here, not at the top: a worker that logs nothing needs no MLflow

        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id
        self.after_epoch = after_epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed from an end-of-epoch checkpoint replays that epoch's end: it was logged already.
        if trainer.current_epoch <= self.after_epoch:
            return
        for name, value in trainer.callback_metrics.items():
            self.client.log_metric(self.run_id, name, float(value), step=trainer.current_epoch)


def _storage(uri: str) -> tuple[Any, str]:
    """The pyarrow filesystem of a path in Ray's storage (a local folder or a URI such as s3://) and the path in it."""
    from pyarrow import fs

    if "://" not in uri:
        return fs.LocalFileSystem(), os.path.abspath(uri)
    return fs.FileSystem.from_uri(uri)


def ask_to_stop(marker: str, reason: str) -> None:
    """Ask the workers given MARKER (`stop_marker` in their config) to stop at the end of the epoch they are in."""
    filesystem, path = _storage(marker)
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with filesystem.open_output_stream(path) as out:
        out.write(reason.encode())


def asked_to_stop(marker: str) -> bool:
    filesystem, path = _storage(marker)
    return filesystem.get_file_info(path).type != FileType.NotFound


def forget_stop(marker: str) -> None:
    """Remove MARKER if it was written; storage that cannot be reached now leaves it (the run's own error counts)."""
    try:
        filesystem, path = _storage(marker)
        if filesystem.get_file_info(path).type != FileType.NotFound:
            filesystem.delete_file(path)
    except OSError:
        pass


class StopWhenAsked(Callback):
    """Ends training at the end of an epoch once the driver has written the run's stop marker (its lock was lost:
    another run may be doing the same work). Every rank takes the same decision, so DDP ranks stop together."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        asked = trainer.strategy.reduce_boolean_decision(asked_to_stop(self.marker), all=False)
        if asked:
            trainer.should_stop = True
            if trainer.is_global_zero:
                print(f"imagelake: stopped after epoch {trainer.current_epoch}: the driver asked ({self.marker})")


class DataWait(Callback):
    """Measures how much of each training step was spent waiting for the next batch."""

    def __init__(self) -> None:
        self.wait = self.compute = 0.0
        self.images = 0
        self._previous_end: float | None = None
        self._start = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._previous_end = time.perf_counter()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()
        if self._previous_end is not None:
            self.wait += self._start - self._previous_end
        self.images += len(batch[1])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._previous_end = time.perf_counter()
        self.compute += self._previous_end - self._start

    @property
    def wait_fraction(self) -> float:
        return self.wait / max(self.wait + self.compute, 1e-9)


def make_trainer(
    config: dict[str, Any], callbacks: list[Callback], train_steps: int, val_steps: int, **kwargs: Any
) -> pl.Trainer:
    """The Lightning trainer both the distributed loop and the single-process baseline use."""
    gpu = config.get("use_gpu", False) and torch.cuda.is_available()
    stopping = EarlyStopping(
        monitor="val_loss",
        mode="min",
        patience=config["patience"],
        min_delta=config["min_delta"],
        stopping_threshold=config.get("stopping_threshold"),
    )
    if config.get("max_train_minutes"):
        # Checked at the end of each epoch (Lightning's max_time stops mid-epoch, before the epoch's checkpoint).
        callbacks = [Timer(timedelta(minutes=config["max_train_minutes"]), interval="epoch"), *callbacks]
    if config.get("stop_marker"):
        callbacks = [StopWhenAsked(config["stop_marker"]), *callbacks]
    return pl.Trainer(
        max_epochs=config["max_epochs"],
        precision="bf16-mixed" if gpu and config.get("bf16", True) else "32-true",
        callbacks=[stopping, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=train_steps,
        limit_val_batches=val_steps,
        use_distributed_sampler=False,
        # Batches have one or two shapes (sizes differ by at most one): cuDNN's fastest kernels are found once.
        benchmark=True if gpu else None,
        **kwargs,
    )


def on_gpu(config: dict[str, Any]) -> bool:
    return bool(config.get("use_gpu")) and torch.cuda.is_available()


def compile_mode(config: dict[str, Any]) -> str | None:
    """torch.compile's mode for the training steps, or None for eager (tasks/rules/training.py:step_path)."""
    return step_path_of(config)[0]


def step_path_of(config: dict[str, Any]) -> tuple[str | None, str]:
    """How this worker steps the model, and why: config's `compile` (True, False or "off", a mode, or None: the faster
    way measured for the model on a GPU, eager on a CPU) and `compile_mode`."""
    return step_path(config["arch"], config.get("compile"), config.get("compile_mode", "default"), on_gpu(config))


def make_model(config: dict[str, Any], steps_per_epoch: int = 0) -> ImageClassifier:
    """The classifier; with `steps_per_epoch`, its learning rate warms up over the first epoch and decays to 0 by the
    last."""
    total = steps_per_epoch * config["max_epochs"]
    model = ImageClassifier(
        config["num_classes"],
        config["learning_rate"],
        config["arch"],
        config.get("pretrained"),
        config.get("freeze_backbone", False),
        total_steps=total,
        warmup_steps=min(steps_per_epoch, total // 2),
        compile_mode=compile_mode(config),
        image_size=config["image_size"],
        augment=config.get("augment", "none"),
        augment_flip=config.get("augment_flip", False),
        seed=config["seed"],
        label_smoothing=config.get("label_smoothing", 0.0),
        class_weights=config.get("loss_weights"),
        # A lower rate for the backbone only when it starts from pretrained weights: from scratch, all layers learn
        # alike.
        backbone_lr_factor=config.get("backbone_lr_factor", 1.0) if config.get("pretrained") else 1.0,
        weight_decay=config.get("weight_decay", 0.01),
    )
    if config.get("warm_start_weights"):  # the champion's weights, over the fresh (or pretrained) ones
        model.model.load_weights(load_state_dict(config["warm_start_weights"], "warm start weights"))
    if config.get("use_gpu") and torch.cuda.is_available() and config.get("channels_last", True):
        model.model.channels_last = True
        model = model.to(memory_format=torch.channels_last)
    return model


def ddp_strategy(config: dict[str, Any]) -> RayDDPStrategy:
    """Ray's DDP strategy; on a GPU, DDP's static graph (the same parameters get gradients at every step) and gradients
    kept in the all-reduce buckets (no copy between them)."""
    if on_gpu(config):
        return RayDDPStrategy(static_graph=True, gradient_as_bucket_view=True)
    return RayDDPStrategy()


def ray_trainer(
    config: dict[str, Any], callbacks: list[Callback], train_steps: int, val_steps: int, world: int
) -> pl.Trainer:
    """The trainer of one Ray Train worker. With several workers, DDP through Ray's strategy; alone, the model is not
    wrapped in DDP: there is nothing to all-reduce, and DDP would split a compiled model's graph at its gradient buckets
    (measured on one H100 with ResNet-50, compiled: 0.84 of the compiled limit under DDP against 0.90 without)."""
    trainer = make_trainer(
        config,
        callbacks,
        train_steps,
        val_steps,
        accelerator="auto",
        devices="auto",
        strategy=ddp_strategy(config) if world > 1 else "auto",
        plugins=[RayLightningEnvironment()],
        # Per-GPU batches are small: batch-norm statistics over all ranks' samples (gloo on CPU has no SyncBatchNorm).
        sync_batchnorm=on_gpu(config) and world > 1,
    )
    return prepare_trainer(trainer) if world > 1 else trainer  # prepare_trainer checks for one of Ray's strategies


def jpeg_decode_device(config: dict[str, Any]) -> str | None:
    """Where the loader has torchvision decode a JPEG cache's batches ("cuda" or "cpu"), or None: the loader decodes
    each row group as it arrives (a raw cache has nothing to decode). `jpeg_decode: auto` decodes on the GPU when
    training on one."""
    wanted = config.get("jpeg_decode") or "auto"
    if split_format(config["train_uri"]) != "jpeg" or wanted == "loader" or (wanted == "auto" and not on_gpu(config)):
        return None
    return "cuda" if on_gpu(config) else "cpu"


def shard_loaders(config: dict[str, Any], rank: int, world: int) -> tuple[ShardBatches, ShardBatches]:
    pin = on_gpu(config) and bool(config.get("pin_memory", True))
    processes = config.get("loader_processes")
    decode_device = jpeg_decode_device(config)
    if processes is None:  # a loader process frees the GPU's training thread of the reading (and decoding) it does
        processes = int(on_gpu(config) and decode_device is None)
    shard = dict(
        shard=rank,
        shard_count=world,
        batch_size=config["batch_size"],
        image_size=config["image_size"],
        seed=config["seed"],
        workers=config.get("loader_workers", 2),
        pin_memory=pin,
        processes=processes,
        next_epoch_ahead=config.get("next_epoch_ahead"),
        decode_device=decode_device,
    )
    train = ShardBatches(
        config["train_uri"], shuffle=True, buffer_batches=config.get("shuffle_buffer_batches", 4), **shard
    )
    val = ShardBatches(config["val_uri"], shuffle=False, **shard)
    return train, val


def worker_nodes(world: int) -> list[str]:
    """The Ray node each rank runs on, gathered from all ranks (every rank calls this at the same point)."""
    import torch.distributed as dist

    node = ray.get_runtime_context().get_node_id()
    if world == 1:
        return [node]
    if not dist.is_initialized():
        raise RuntimeError(
            f"rank of {world} workers without a process group: Ray Train did not set up torch.distributed"
        )
    gathered: list[Any] = [None] * world
    # Objects travel over gloo: the default group when it is gloo (CPU), else a short-lived one beside NCCL.
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        dist.all_gather_object(gathered, node, group=group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    return [str(item) for item in gathered]


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Train the classifier on this worker's shard of the cached train and val splits, resuming if Ray restarted us."""
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    pl.seed_everything(config["seed"], workers=True)
    checkpoint = ray.train.get_checkpoint()
    resume, resumed_epoch = resume_point(checkpoint.path if checkpoint else None, config.get("run_path"))
    report = RayTrainReportCallback()
    callbacks: list[Callback] = [report]
    nodes = worker_nodes(world)
    if rank == 0 and config.get("mlflow_run_id"):
        from mlflow import MlflowClient

        MlflowClient(config["tracking_uri"]).set_tag(config["mlflow_run_id"], WORKER_NODES_TAG, json.dumps(nodes))
        MlflowClient(config["tracking_uri"]).set_tag(config["mlflow_run_id"], STEP_PATH_TAG, step_path_of(config)[1])
        callbacks.append(MlflowEpochMetrics(config["tracking_uri"], config["mlflow_run_id"], resumed_epoch))
        if resume:
            MlflowClient(config["tracking_uri"]).set_tag(
                config["mlflow_run_id"], "resumed_after_epoch", str(resumed_epoch)
            )
    callbacks += config.get("callbacks") or []  # trainer.py:WORKER_CALLBACKS
    train_batches, val_batches = shard_loaders(config, rank, world)
    trainer = ray_trainer(config, callbacks, len(train_batches), len(val_batches), world)
    if resume:
        # Reshuffle as the interrupted run would have: the epoch to come is the checkpoint's plus one.
        train_batches.epoch = resumed_epoch + 1
        print(f"imagelake: rank {rank} resumes after epoch {resumed_epoch} from {resume}", flush=True)
    started = time.perf_counter()
    with train_batches, val_batches:
        try:
            trainer.fit(
                make_model(config, len(train_batches)),
                train_dataloaders=train_batches,
                val_dataloaders=val_batches,
                ckpt_path=resume,
                weights_only=True,  # a checkpoint on shared storage is read as data, never unpickled as code
            )
        finally:
            # Ray's callback stages each epoch's checkpoint in a folder of the system's temporary folder and removes
            # the epoch's files once reported, never that folder: without this, every run left one behind. Another
            # rank of this machine may still be reporting into it: then the folder is not empty yet and stays for it.
            with contextlib.suppress(OSError):
                report_callback_staging(report).rmdir()
    if rank == 0 and config.get("mlflow_run_id"):
        from mlflow import MlflowClient

        # The fitting alone (this attempt's epochs), apart from Ray's start-up and the driver's MLflow work.
        MlflowClient(config["tracking_uri"]).log_metric(
            config["mlflow_run_id"], FIT_SECONDS, time.perf_counter() - started
        )
