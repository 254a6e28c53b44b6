"""Training throughput and data wait: Ray Train's TorchTrainer (one worker) against plain single-process Lightning.

    .venv/bin/python bench/train.py [--images 2048] [--size 96] [--arch small_cnn] [--epochs 6] [--gpu]

Both train the same model on the same cached split through the same loader (ShardBatches) and
Lightning trainer settings; the only difference is Ray Train around it (RayDDPStrategy,
RayLightningEnvironment, prepare_trainer, the report callback and its checkpoints). Printed:
images/s over the training steps after the first epoch, the fraction of step time spent waiting
for the next batch, and wall-clock time including start-up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import ray
import ray.train
import torch
from loader import write_cache  # bench/loader.py, beside this file
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from ray.train.torch import TorchTrainer

from infra.settings import Settings
from infra.spark import spark_session
from tasks.worker.train_loop import DataWait, make_model, make_trainer, shard_loaders


class Steady(DataWait):
    """DataWait that starts counting after the first epoch (warm-up: reader start, allocator, first batches)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            self.wait = self.compute = 0.0
            self.images = 0
        super().on_train_epoch_start(trainer, pl_module)


def config_for(url: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_uri": url, "val_uri": url, "num_classes": 10, "image_size": args.size, "arch": args.arch, "batch_size": args.batch,
        "learning_rate": 1e-3, "max_epochs": args.epochs, "patience": args.epochs, "min_delta": 0.0, "seed": 0, "use_gpu": args.gpu,
        "loader_workers": args.loader_workers,
    }


def run_epochs(config: dict[str, Any], rank: int, world: int, distributed: bool) -> Steady:
    pl.seed_everything(0, workers=True)
    steady = Steady()
    train_batches, val_batches = shard_loaders(config, rank, world)
    extra: dict[str, Any] = {"accelerator": "gpu" if config["use_gpu"] else "cpu", "devices": 1}
    callbacks: list[pl.Callback] = [steady]
    if distributed:
        extra = {"accelerator": "auto", "devices": "auto", "strategy": RayDDPStrategy(), "plugins": [RayLightningEnvironment()]}
        callbacks.append(RayTrainReportCallback())
    # Validation is limited to one batch so that the measurement is about training steps.
    trainer = make_trainer(config, callbacks, len(train_batches), 1, **extra)
    if distributed:
        trainer = prepare_trainer(trainer)
    with train_batches, val_batches:
        trainer.fit(make_model(config), train_dataloaders=train_batches, val_dataloaders=val_batches)
    return steady


def ray_worker(config: dict[str, Any]) -> None:
    context = ray.train.get_context()
    steady = run_epochs(config, context.get_world_rank(), context.get_world_size(), distributed=True)
    # Results go through a file: RayTrainReportCallback owns ray.train.report in this loop.
    with open(config["result_file"], "w") as out:
        out.write(f"{steady.images} {steady.wait} {steady.compute} {torch.get_num_threads()}")


def report(label: str, images: int, wait: float, compute: float, wall: float) -> float:
    rate = images / max(wait + compute, 1e-9)
    print(f"{label:44} {rate:8.1f} images/s   data wait {wait / max(wait + compute, 1e-9):5.1%}   wall {wall:6.1f} s", flush=True)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--arch", default="small_cnn")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="train on one GPU (bf16 autocast, channels_last, pinned batches)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="imagelake-train-"))
    try:
        spark = spark_session(Settings(workspace=work / "ws"))
        url = write_cache(spark, work / "train", args.images, args.size, partitions=8)
        spark.stop()
        device = torch.cuda.get_device_name(0) if args.gpu else f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
        print(f"{args.images} images {args.size}x{args.size}, {args.arch}, batch {args.batch}, {args.epochs} epochs (the first is warm-up), {device}")
        config = config_for(url, args)

        started = time.perf_counter()
        plain = run_epochs(config, 0, 1, distributed=False)
        a = report("(a) plain Lightning, one process", plain.images, plain.wait, plain.compute, time.perf_counter() - started)

        cores = os.cpu_count() or 2
        # The worker gets every core, as the plain process has (Ray sets its torch threads from its CPUs); +1 for the controller.
        ray.init(num_cpus=cores + 1, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        config["result_file"] = str(work / "ray-result.txt")
        started = time.perf_counter()
        TorchTrainer(
            ray_worker,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=1, use_gpu=args.gpu, resources_per_worker={"CPU": cores}),
            run_config=RunConfig(name="bench", storage_path=str(work / "ray")),
        ).fit()
        images, wait, compute, threads = (float(x) for x in Path(config["result_file"]).read_text().split())
        b = report(f"(b) Ray Train TorchTrainer, one worker ({threads:.0f} threads)", int(images), wait, compute, time.perf_counter() - started)
        print(f"TorchTrainer / plain Lightning: {b / a:.2f}")
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
