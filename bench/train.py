"""Training throughput: the model's own limit, and imagelake's loader path in plain Lightning and in Ray Train.

    .venv/bin/python bench/train.py                 # CPU: plain Lightning against TorchTrainer (small_cnn, 96 px)
    .venv/bin/python bench/train.py --host          # CPU: the host's time per Lightning step (tiny batches)
    python3 bench/train.py --gpu [--json FILE]      # one GPU: the table below (224 px), --sections to choose
    .venv/bin/python bench/train.py --dry-run       # no GPU: every section of that table on the CPU, tiny sizes

Every path trains on the same cached split (Parquet in the cache's layout: raw uint8 pixels,
label, sha256, position; 8 MB row groups), through the training code's own ShardBatches loader,
make_trainer and make_model; the Ray rows run the same epochs inside Ray Train's TorchTrainer,
through the training stage's own ray_trainer (one worker: no DDP) and the report callback.
The default section, goals, runs the rows that have goals, most wanted first: the default model as a
run trains it (pretrained MobileNetV2 at the settings' image size), the frozen ResNet-50 and the small CNN
against their limits, EfficientNet-B0, then JPEG photos decoded on the GPU; each path with the training
path's GPU defaults (the model's faster step path, eager or compiled, as tasks/rules/training.py chooses
it; a loader process; the next epoch ahead). Every rate is a share of the faster of the model's limits.
Each section is a function (section_<name>) of one GpuRun; SECTIONS lists them in the order they run.

With --gpu, side by side in one run (--sections picks parts):
  limit       the model alone on random uint8 batches already on the GPU: the same ImageModel
              (normalised on the GPU), bf16 autocast, channels-last, AdamW; what the GPU can do
  Lightning   plain Lightning, one process, fed by ShardBatches from the cache
  Ray Train   TorchTrainer with one GPU worker, the same epochs (ResNet-50; --ray-everywhere for all)
for ResNet-50 (all layers, and a frozen backbone with 2 and 4 reader threads), ResNet-18 and the
small CNN; then ResNet-50 in Lightning under torch.profiler (gpu-profile.txt beside --json) and
the limit with torch.compile. Printed per row:
images/s over the steps after the first epoch, that rate over the limit, the share of step time
spent waiting for the next batch, the GPU's utilisation (NVML, sampled every 0.2 s over those
steps), the peak GPU memory and the CPU time the training process spent per image.

Imports stay within torch, Lightning, Ray, Petastorm and pyarrow (no Spark, MLflow or Prefect),
so the script runs on a bare GPU machine with bench/gpu/run.sh.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkout  # bench/checkout.py: the repository's code under the name imagelake
import figures  # bench/figures.py: the records of bench/results/
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytorch_lightning as pl
import ray
import ray.train
import torch
import torch.nn.functional as F
from ray.train import RunConfig, ScalingConfig
from ray.train.lightning import RayTrainReportCallback
from ray.train.torch import TorchTrainer

if importlib.util.find_spec("imagelake") is None:  # `python3 bench/train.py` without an install: the repository's
    checkout.use(Path(__file__).resolve().parent.parent)  # code as imagelake, here and in Ray's workers

from imagelake.infra.settings import Settings  # noqa: E402
from imagelake.tasks.rules.training import step_path  # noqa: E402
from imagelake.tasks.worker.loader import ShardBatches  # noqa: E402
from imagelake.tasks.worker.model import (  # noqa: E402
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageModel,
    weights_file,
    weights_of,
)
from imagelake.tasks.worker.model import compiled as compiled_model  # noqa: E402
from imagelake.tasks.worker.train_loop import DataWait, make_model, make_trainer, ray_trainer, shard_loaders  # noqa: E402

ROW_GROUP_BYTES = 8 * 1024 * 1024  # as the cache stage writes (parquet.block.size)
# A dry run steps every row at batches of at most this many images (the rows keep their GPU batch as a label): a
# ResNet-50 step of 256 images takes tens of seconds on a 2-core CPU, and the dry run checks the code, not speed.
DRY_RUN_BATCH: int | None = None


def write_part(out: Path, file: int, rows: np.ndarray, images: pa.Array, labels: np.ndarray, group_rows: int) -> str:
    """One Parquet file of a split in the cache's layout (image, label, sha256, and Spark's position ids: file in the
    high bits, row in the low 33) in row groups of `group_rows`; its name."""
    table = pa.table(
        {
            "image": images,
            "label": pa.array(labels, pa.int64()),
            "sha256": pa.array([f"{i:064x}" for i in rows.tolist()]),
            "position": pa.array((file << 33) + np.arange(len(rows), dtype=np.int64)),
        }
    )
    name = f"part-{file:05d}.parquet"
    pq.write_table(table, out / name, row_group_size=group_rows)
    return name


def write_cache(out: Path, images: int, size: int, files: int, seed: int = 0) -> str:
    """A split in the cache's layout, written with pyarrow: random pixels (they do not compress, as photos barely do
    after decoding) and labels 0-9."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    pixels = size * size * 3
    for file, rows in enumerate(np.array_split(np.arange(images), files)):
        data = rng.integers(0, 256, len(rows) * pixels, dtype=np.uint8)
        offsets = pa.array(np.arange(len(rows) + 1, dtype=np.int32) * pixels)
        column = pa.BinaryArray.from_buffers(pa.binary(), len(rows), [None, offsets.buffers()[1], pa.py_buffer(data)])
        write_part(out, file, rows, column, rng.integers(0, 10, len(rows)), max(1, ROW_GROUP_BYTES // pixels))
    return f"file://{out}"


def write_photo_caches(work: Path, images: int, size: int, files: int, quality: int = 95) -> dict[str, str]:
    """The same `images` crops of real photographs (4,096 at most, repeated) in the cache's layout twice, raw pixels and
    JPEG of `quality` (the cache stage's own encoding), each with a manifest recording its format as the cache stage's
    do: {format: the manifest's URI}."""
    from imagelake.tasks.data.cache_files import encode_jpeg

    crops, _ = photo_crops(min(images, 4096), size)
    pixels = np.stack([np.asarray(crop).reshape(-1) for crop in crops])
    labels = np.random.default_rng(0).integers(0, 10, images)
    manifests = {}
    for image_format in ("raw", "jpeg"):
        out = work / f"photos-{image_format}"
        out.mkdir(parents=True)
        names = []
        for file, rows in enumerate(np.array_split(np.arange(images), files)):
            column = pa.array([pixels[row % len(pixels)].tobytes() for row in rows.tolist()], pa.binary())
            if image_format == "jpeg":
                column = encode_jpeg(column, size, quality)
            per_row = max(1, column.nbytes // max(1, len(rows)))
            names.append(write_part(out, file, rows, column, labels[rows], max(1, ROW_GROUP_BYTES // per_row)))
        manifest = out / "train-v0.json"
        manifest.write_text(json.dumps({"files": names, "cached": {"image_format": image_format}}))
        manifests[image_format] = f"file://{manifest}"
    return manifests


class Steady(DataWait):
    """DataWait counting from the second epoch on (the first is warm-up: reader start, cuDNN's algorithm search,
    the allocator); also the process's CPU time, the GPU's utilisation and its peak memory over those epochs."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu = 0.0
        self.utilisation: list[float] = []
        self.peak_gib: float | None = None
        self._sampling: threading.Event | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            self.wait = self.compute = 0.0
            self.images = 0
            self.cpu = -cpu_seconds()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
                self._sampling = sample_utilisation(self.utilisation)
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.cpu += cpu_seconds()
        if self._sampling is not None:
            self._sampling.set()
            self.peak_gib = torch.cuda.max_memory_allocated() / 2**30

    def result(self) -> dict[str, Any]:
        steps = self.wait + self.compute
        return {
            "images": self.images,
            "rate": self.images / max(steps, 1e-9),
            "wait": self.wait / max(steps, 1e-9),
            "utilisation": float(np.mean(self.utilisation)) if self.utilisation else None,
            "peak_gib": self.peak_gib,
            "cpu_ms_per_image": 1000 * self.cpu / max(self.images, 1),
            "threads": torch.get_num_threads(),
        }


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sample_utilisation(into: list[float], every: float = 0.2) -> threading.Event:
    """NVML's GPU utilisation (the share of time a kernel ran), sampled in a thread until the event is set."""
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every):
            try:
                into.append(float(torch.cuda.utilization()))
            except Exception:  # no NVML bindings: the column stays empty
                return

    threading.Thread(target=sample, daemon=True).start()
    return stop


class Profile(pl.Callback):
    """torch.profiler over `steps` training steps of the second epoch: what the training process spends its time
    on, host and GPU, and how long the GPU's kernels ran in that window (the profiler adds some host time)."""

    def __init__(self, out: Path | None, first: int = 5, steps: int = 20) -> None:
        self.out, self.first, self.steps = out, first, steps
        self.profiler: torch.profiler.profile | None = None
        self.started = 0.0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == 1 and batch_idx == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.profiler is None or (
            batch_idx != self.first + self.steps - 1 and batch_idx != trainer.num_training_batches - 1
        ):
            return  # ends after `steps` steps, or at the epoch's last (a profiler left open breaks torch.compile later)
        self.steps = batch_idx - self.first + 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        self.profiler.__exit__(None, None, None)
        events = self.profiler.key_averages()
        text = (
            f"{self.steps} steps in {wall:.3f} s ({wall / self.steps * 1000:.1f} ms a step); the tables' "
            "'Self CUDA time total' "
            "is the GPU's busy time in that window\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
            + "\n"
            + events.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=48)
        )
        print(text, flush=True)
        if self.out:
            self.out.write_text(text)
        self.profiler = None


class SyncWatch(pl.Callback):
    """Every operation that makes the host wait for the GPU during `steps` training steps of the second epoch
    (torch.cuda's sync debug mode), printed once per call site with how often it came."""

    def __init__(self, first: int = 5, steps: int = 10) -> None:
        self.first, self.steps = first, steps
        self.sites: dict[str, int] = {}
        self._restore: Callable[[], None] | None = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch != 1 or batch_idx != self.first or not torch.cuda.is_available():
            return  # the sync debug mode is CUDA's: on a CPU (a dry run) nothing waits for a device
        caught = warnings.catch_warnings()
        caught.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            site = f"{str(message).splitlines()[0][:120]}\n" + "".join(traceback.format_stack(limit=16)[:-2])
            self.sites[site] = self.sites.get(site, 0) + 1

        def restore() -> None:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
            caught.__exit__(None, None, None)

        warnings.showwarning = show
        self._restore = restore
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._restore is None or batch_idx != self.first + self.steps - 1:
            return
        self._restore()
        self._restore = None
        print(
            f"synchronising operations in {self.steps} steps: {sum(self.sites.values())} at "
            f"{len(self.sites)} call sites",
            flush=True,
        )
        for site, count in sorted(self.sites.items(), key=lambda item: -item[1]):
            print(f"--- {count} times: {site}", flush=True)


class OnGpu:
    """`steps` batches already on the GPU (one random batch handed out again and again): Lightning's loop and the
    model without any loader."""

    def __init__(self, steps: int, batch: int, size: int) -> None:
        self.steps = steps
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device=device)
        self.labels = torch.randint(0, 10, (batch,), device=device)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Any:
        return iter([(self.images, self.labels)] * self.steps)

    def __enter__(self) -> OnGpu:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class LogEveryStep(pl.Callback):
    """The classifier as it was before: its loss and accuracy objects handed to self.log at every step, not once an
    epoch."""

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        module._logged.clear()

    def on_validation_batch_start(
        self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int, loader: int = 0
    ) -> None:
        module._logged.clear()


def checked_metrics(model: pl.LightningModule) -> None:
    """The metrics as the classifier had them before: torchmetrics' default argument and NaN checks, each of which
    reads a value back from the GPU at every step."""
    from torchmetrics import MeanMetric
    from torchmetrics.classification import MulticlassAccuracy

    classes = model.hparams.num_classes
    for name in list(model.metrics):
        model.metrics[name] = MulticlassAccuracy(classes, average="micro") if name.endswith("acc") else MeanMetric()


def run_epochs(config: dict[str, Any], rank: int = 0, world: int = 1, distributed: bool = False) -> dict[str, Any]:
    pl.seed_everything(0, workers=True)
    steady = Steady()
    if config.get("gpu_batches"):
        train_batches, val_batches = (
            OnGpu(config["gpu_batches"], config["batch_size"], config["image_size"]),
            OnGpu(1, config["batch_size"], config["image_size"]),
        )
    else:
        train_batches, val_batches = shard_loaders(config, rank, world)
    callbacks: list[pl.Callback] = [steady]
    if "profile" in config:
        callbacks.append(Profile(Path(config["profile"]) if config["profile"] else None))
    if config.get("sync_watch"):
        callbacks.append(SyncWatch())
    if config.get("log_every_step"):
        callbacks.append(LogEveryStep())
    # Validation is limited to one batch so that the measurement is about training steps.
    if distributed:  # as a Ray Train worker of the training stage sets up its trainer
        trainer = ray_trainer(config, [*callbacks, RayTrainReportCallback()], len(train_batches), 1, world)
    else:
        trainer = make_trainer(
            config, callbacks, len(train_batches), 1, accelerator="gpu" if config["use_gpu"] else "cpu", devices=1
        )
    model = make_model(config, len(train_batches))
    if config.get("checked_metrics"):
        checked_metrics(model)
    with train_batches, val_batches:
        trainer.fit(model, train_dataloaders=train_batches, val_dataloaders=val_batches)
    return steady.result()


def ray_worker(config: dict[str, Any]) -> None:
    ShardBatches.PAGE_LOCK = config.get("page_lock", True)  # --no-page-lock reaches Ray's worker process
    context = ray.train.get_context()
    result = run_epochs(config, context.get_world_rank(), context.get_world_size(), distributed=True)
    # Results go through a file: RayTrainReportCallback owns ray.train.report in this loop.
    Path(config["result_file"]).write_text(json.dumps(result))


def ray_epochs(config: dict[str, Any], work: Path, cpus: int) -> dict[str, Any]:
    config = {**config, "result_file": str(work / "ray-result.json")}
    TorchTrainer(
        ray_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=config["use_gpu"], resources_per_worker={"CPU": cpus}),
        run_config=RunConfig(name=f"bench-{time.monotonic_ns()}", storage_path=str(work / "ray")),
    ).fit()
    return json.loads(Path(config["result_file"]).read_text())


def zoo_model(arch: str, size: int) -> torch.nn.Module:
    """A torchvision classification model by name, fresh weights, 10 classes, behind the same uint8 NHWC input and
    ImageNet normalisation as ImageModel: what a torchvision backbone costs on this GPU. A ViT is built for `size`."""
    import torchvision

    class Zoo(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            sized = {"image_size": size} if arch.startswith("vit") else {}
            self.net = torchvision.models.get_model(arch, weights=None, num_classes=10, **sized)
            self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255, persistent=False)
            self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255, persistent=False)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            x = (images.permute(0, 3, 1, 2).float() - self.mean) / self.std
            return self.net(x.contiguous(memory_format=torch.channels_last))

    return Zoo()


def limit(
    arch: str,
    batch: int,
    size: int,
    frozen: bool,
    steps: int,
    warmup: int,
    compiled: str | None = None,
    fused: bool = False,
    zoo: bool = False,
) -> dict[str, Any]:
    """Training steps of the model alone, on random uint8 batches already on the GPU: what the data path aims at.
    `compiled`: a torch.compile mode; `fused`: AdamW's fused kernel (else its default, one kernel per op over all
    tensors); `zoo`: torchvision's model of that name instead of imagelake's."""
    torch.manual_seed(0)
    batch = min(batch, DRY_RUN_BATCH or batch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # cuDNN picks its fastest kernels for these shapes, as the training path's trainer does (benchmark=True). The tables
    # before 2026-11-27 measured limits without it, and Lightning on batches already on the GPU then ran faster than
    # the frozen backbone's compiled limit (26,640 against 21,027 images/s on an H100).
    torch.backends.cudnn.benchmark = device == "cuda"
    if zoo:
        net = zoo_model(arch, size).to(device)
    else:
        net = ImageModel(10, arch, freeze_backbone=frozen, image_size=size).to(device)
        net.channels_last = True
    net = net.to(memory_format=torch.channels_last).train()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3, fused=fused or None)
    step_net = compiled_model(net, compiled)  # as the training path compiles
    images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(step_net(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    first = time.perf_counter()
    for _ in range(warmup):
        step()
    synchronize()
    warm = time.perf_counter() - first
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    utilisation: list[float] = []
    stop = sample_utilisation(utilisation) if device == "cuda" else threading.Event()
    started, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(steps):
        step()
    synchronize()
    elapsed, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    stop.set()
    result = {
        "images": steps * batch,
        "rate": steps * batch / elapsed,
        "wait": None,
        "utilisation": float(np.mean(utilisation)) if utilisation else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "cpu_ms_per_image": 1000 * cpu / (steps * batch),
        "warmup_s": warm,
    }
    return result


def loader_alone(url: str, size: int, batch: int, workers: int, processes: int, epochs: int = 2) -> dict[str, Any]:
    """ShardBatches by itself, batches copied to the GPU and dropped: the rate the loader can feed (epochs after the
    first)."""
    gpu = torch.cuda.is_available()
    with ShardBatches(
        url,
        shard=0,
        shard_count=1,
        batch_size=batch,
        image_size=size,
        seed=0,
        shuffle=True,
        workers=workers,
        pin_memory=gpu,
        processes=processes,
    ) as batches:
        images = 0
        for epoch in range(epochs):
            if epoch == 1:
                started, cpu, images = time.perf_counter(), cpu_seconds(), 0
            for batch_images, _ in batches:
                images += len(batch_images)
            if gpu:
                torch.cuda.synchronize()
        elapsed, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {
        "images": images,
        "rate": images / elapsed,
        "wait": None,
        "utilisation": None,
        "peak_gib": None,
        "cpu_ms_per_image": 1000 * cpu / images,
    }


def loaders_together(url: str, size: int, batch: int, workers: int, processes: int, epochs: int = 2) -> dict[str, Any]:
    """`processes` ShardBatches at once, each with a loader process of its own making Petastorm shard j of
    `processes`, each drained to the GPU by a thread of this process: how the loader's rate grows with processes."""
    gpu = torch.cuda.is_available()
    loaders = [
        ShardBatches(
            url,
            shard=j,
            shard_count=processes,
            batch_size=batch,
            image_size=size,
            seed=0,
            shuffle=True,
            workers=workers,
            pin_memory=gpu,
            processes=1,
        )
        for j in range(processes)
    ]
    counts = [0] * processes
    errors: list[BaseException] = []

    def drain(j: int) -> None:
        try:
            for batch_images, _ in loaders[j]:
                counts[j] += len(batch_images)
        except BaseException as error:  # raised in the measuring thread, after the others end
            errors.append(error)

    try:
        for epoch in range(epochs):
            if epoch == 1:
                started, cpu = time.perf_counter(), cpu_seconds()
                counts[:] = [0] * processes
            threads = [threading.Thread(target=drain, args=(j,)) for j in range(processes)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise errors[0]
            if gpu:
                torch.cuda.synchronize()
        elapsed, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    finally:
        for loader in loaders:
            loader.__exit__(None, None, None)
    images = sum(counts)
    return {
        "images": images,
        "rate": images / elapsed,
        "wait": None,
        "utilisation": None,
        "peak_gib": None,
        "cpu_ms_per_image": 1000 * cpu / images,
    }


def photo_crops(count: int, size: int, seed: int = 0) -> tuple[list[Any], int]:
    """`count` crops of real photographs at `size` px (random places and scales), from the sample images that
    scikit-image, scikit-learn and Matplotlib install (PIL images), and how many photographs they came from."""
    import glob
    import random

    from PIL import Image

    roots = [p for p in sys.path if p.endswith("-packages")]
    patterns = [
        "skimage/data/*.png",
        "skimage/data/*.jpg",
        "sklearn/datasets/images/*.jpg",
        "matplotlib/mpl-data/sample_data/*.jpg",
        "matplotlib/mpl-data/sample_data/*.png",
    ]
    photos = []
    for path in sorted({f for root in roots for pattern in patterns for f in glob.glob(f"{root}/{pattern}")}):
        try:
            image = Image.open(path).convert("RGB")
        except Exception:
            continue
        if min(image.size) >= 256:
            photos.append(image)
    if not photos:
        raise RuntimeError("no sample photographs found (scikit-image, scikit-learn or Matplotlib's data)")
    rng = random.Random(seed)
    crops = []
    for _ in range(count):
        photo = photos[rng.randrange(len(photos))]
        side = int(min(photo.size) * rng.uniform(0.4, 1.0))
        x, y = rng.randrange(photo.size[0] - side + 1), rng.randrange(photo.size[1] - side + 1)
        crops.append(photo.crop((x, y, x + side, y + side)).resize((size, size), Image.BICUBIC))
    return crops, len(photos)


def jpeg_section(table: Table, size: int, batch: int = 256, count: int = 1024) -> None:
    """Cache bytes per image as raw pixels against JPEG (quality 90 and 95) of real photographs at `size` px, and how
    fast each comes out as a GPU batch: raw pixels copied from pinned memory, JPEG decoded by nvJPEG
    (torchvision.io.decode_jpeg on the GPU) or by Pillow on one core."""
    import io as bytes_io

    from PIL import Image
    from torchvision.io import decode_jpeg

    crops, photos = photo_crops(count, size)
    table.say(f"JPEG against raw pixels: {count} crops of {photos} real photographs at {size} px, batches of {batch}")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a dry run decodes with torchvision on the CPU
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    raw = torch.from_numpy(np.stack([np.asarray(c) for c in crops[:batch]]))
    raw = raw.pin_memory() if device == "cuda" else raw
    for quality in (90, 95):
        encoded = []
        for crop in crops:
            out = bytes_io.BytesIO()
            crop.save(out, "JPEG", quality=quality)
            encoded.append(out.getvalue())
        mean_bytes = float(np.mean([len(b) for b in encoded]))
        datas = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in encoded[:batch]]
        decode_jpeg(datas, device=device)  # nvJPEG's start-up
        synchronize()
        rounds = 20
        started = time.perf_counter()
        for _ in range(rounds):
            images = decode_jpeg(datas, device=device)
        synchronize()
        gpu_rate = rounds * batch / (time.perf_counter() - started)
        started = time.perf_counter()
        for b in encoded[:batch]:
            np.asarray(Image.open(bytes_io.BytesIO(b)).convert("RGB"))
        cpu_rate = batch / (time.perf_counter() - started)
        table.say(
            f"  JPEG q{quality}: {mean_bytes / 1024:6.1f} KiB an image ({size * size * 3 / mean_bytes:5.1f}x "
            f"smaller than raw {size * size * 3 / 1024:.0f} KiB); "
            f"nvJPEG {gpu_rate:8.0f} images/s, Pillow one core {cpu_rate:6.0f} images/s; decoded shape "
            f"{tuple(images[0].shape)}"
        )
    started = time.perf_counter()
    for _ in range(50):
        raw.to(device, non_blocking=True)
    synchronize()
    table.say(f"  raw pixels: pinned batch to the GPU {50 * batch / (time.perf_counter() - started):8.0f} images/s")


class Table:
    """The printed table, also kept as JSON rows (written after every row, so a cut-off run keeps what it measured)."""

    COLUMNS = (
        "model           trains  path (/limit: of the faster of the model's eager and compiled limits)\n"
        "                                                  batch workers  images/s  /limit  data wait  "
        "GPU util  peak GiB  CPU ms/img"
    )

    def __init__(self, json_path: str | None, title: str) -> None:
        self.rows: list[dict[str, Any]] = []
        self.failed = 0
        self.limits: dict[tuple[str, bool, int, bool], float] = {}
        self.fastest: dict[tuple[str, bool, int], float] = {}
        self.json_path = json_path
        self.text_path = Path(json_path).with_suffix(".txt") if json_path else None
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        self.say(title)
        self.say(self.COLUMNS)

    def say(self, line: str) -> None:
        """Print a line of the table; with a JSON file, also append it to the .txt beside it (free of the run's log)."""
        print(line, flush=True)
        if self.text_path:
            with self.text_path.open("a") as out:
                out.write(line + "\n")

    def add(
        self,
        arch: str,
        frozen: bool,
        path: str,
        batch: int,
        workers: int | str | None,
        measure: Callable[[], dict[str, Any]],
    ) -> dict[str, Any] | None:
        started = time.perf_counter()
        # Each row compiles afresh: torch.compile's cache of ImageModel.forward is shared by every model of the
        # process, and after 8 models and modes (the limit's autocast, Lightning's train and validation steps) it
        # stops compiling and runs eager (the ViT row of bench/results/h200-2026-11-27).
        torch.compiler.reset()
        try:
            result = measure()
        except Exception as error:  # one failed row must not cost the rest of the table
            self.failed += 1
            self.say(
                f"{arch:15} {'head' if frozen else 'all':6}  {path:40} {batch:5} FAILED: "
                f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
            )
            return None
        # Rates are shares of the model's fastest limit row so far: eager or compiled (in any mode), whichever steps
        # the model faster is the limit that counts. `limits` keeps each kind's first row (epochs are sized by it).
        if path.startswith("limit"):
            self.limits.setdefault((arch, frozen, batch, "compile" in path), result["rate"])
            self.fastest[(arch, frozen, batch)] = max(self.fastest.get((arch, frozen, batch), 0.0), result["rate"])
        fastest = self.fastest.get((arch, frozen, batch))
        share = result["rate"] / fastest if fastest else None

        def fmt(value: Any, pattern: str) -> str:
            return "-" if value is None else pattern.format(value)

        self.say(
            f"{arch:15} {'head' if frozen else 'all':6}  {path:40} {batch:5} {fmt(workers, '{:7}')}"
            f" {result['rate']:9.0f} {fmt(share, '{:7.2f}')} {fmt(result['wait'], '{:10.1%}')} "
            f"{fmt(result['utilisation'], '{:8.0f}%')}"
            f" {fmt(result['peak_gib'], '{:9.1f}')} {result['cpu_ms_per_image']:11.2f}   "
            f"({time.perf_counter() - started:.0f} s)"
        )
        row = {
            "arch": arch,
            "frozen": frozen,
            "path": path,
            "batch": batch,
            "workers": workers,
            "of_limit": share,
            **result,
        }
        self.rows.append(row)
        if self.json_path:
            Path(self.json_path).write_text(json.dumps(self.rows, indent=1))
        return row


def epochs_for(rate: float, images: int, seconds: float) -> int:
    """Enough epochs for about `seconds` of steady training at `rate`, plus the warm-up epoch."""
    return min(12, max(2, 1 + math.ceil(rate * seconds / images)))


def train_config(
    url: str, size: int, arch: str, batch: int, epochs: int, workers: int, gpu: bool, **more: Any
) -> dict[str, Any]:
    """The training loop's config for the cached split at `url` (10 labels; no early stop before the last epoch)."""
    return {
        "train_uri": url,
        "val_uri": url,
        "num_classes": 10,
        "image_size": size,
        "arch": arch,
        "batch_size": batch,
        "learning_rate": 1e-3,
        "max_epochs": epochs,
        "patience": epochs,
        "min_delta": 0.0,
        "seed": 0,
        "use_gpu": gpu,
        "loader_workers": workers,
        **more,
    }


class GpuRun:
    """One run of the GPU table: its arguments, the cached split it trains on, the table its sections add rows to,
    and the helpers they share. Without a GPU (--dry-run) the same rows run on the CPU, to check the table's code."""

    # The sections of the newer tables: they measure the training path as it is now. The earlier tables' sections,
    # asked for alone, run as their code ran then: eager, reader threads in the training process, epoch by epoch.
    CURRENT = frozenset({"goals", "mobilenet", "final", "ray", "diagnose", "targets", "zoo-path", "jpeg-path", "table"})

    def __init__(self, args: argparse.Namespace, url: str, work: Path) -> None:
        self.args, self.url, self.work = args, url, work
        self.size, self.workers = args.size, args.loader_workers
        self.cores = os.cpu_count() or 2
        self.sections = set(args.sections)
        self.gpu = torch.cuda.is_available()
        self._caches: dict[int, str] = {}
        self._photos: dict[str, str] = {}
        dry = f"no GPU: a dry run on the CPU, torch.compile off, batches of at most {DRY_RUN_BATCH}"
        device = torch.cuda.get_device_name(0) if self.gpu else dry
        self.table = Table(
            args.json,
            f"{device}, torch {torch.__version__}, Lightning {pl.__version__}, Ray {ray.__version__}, {self.cores} "
            f"cores; {args.images} images {args.size}x{args.size} uint8 in {args.files} Parquet files; epochs after "
            "the first are measured",
        )

    def cache_at(self, size: int) -> str:
        """The run's cache, or one of as many images at SIZE px, written once a run."""
        if size == self.size:
            return self.url
        if size not in self._caches:
            started = time.perf_counter()
            self._caches[size] = write_cache(self.work / f"train-{size}", self.args.images, size, self.args.files)
            self.table.say(
                f"  a cache of {self.args.images} images at {size} px written in {time.perf_counter() - started:.0f} s"
            )
        return self._caches[size]

    def photo_caches(self) -> dict[str, str]:
        """Crops of real photographs at the run's size cached as raw pixels and as JPEG, written once a run."""
        if not self._photos:
            self._photos = write_photo_caches(self.work, self.args.images, self.size, self.args.files)
        return self._photos

    def config(self, arch: str, batch: int, frozen: bool, workers: int, epochs: int, **more: Any) -> dict[str, Any]:
        """The training loop's config for this run's cache; MORE (train_uri, image_size, ...) overrides."""
        if not self.sections & self.CURRENT:
            more = {"compile": False, "loader_processes": 0, "next_epoch_ahead": False, **more}
        if not self.gpu:  # a dry run: the paths a GPU's defaults take (the model's step path, a loader process)
            chosen = step_path(arch, None, "default", gpu=True)[0]
            more = {"compile": chosen or False, "loader_processes": int(more.get("jpeg_decode") != "device"), **more}
        more = {"page_lock": ShardBatches.PAGE_LOCK, **more}
        batch = min(batch, DRY_RUN_BATCH or batch)
        return train_config(
            self.url, self.size, arch, batch, epochs, workers, gpu=self.gpu, freeze_backbone=frozen, **more
        )

    def epochs(self, arch: str, frozen: bool, batch: int, compiled: bool, slower: float = 1) -> int:
        """Epochs for about --seconds of steady training at the model's limit (1,000 images/s when not measured), or
        at that limit over SLOWER."""
        rate = self.table.limits.get((arch, frozen, batch, compiled), 1000.0) / slower
        return epochs_for(rate, self.args.images, self.args.seconds)

    def limits(self, arch: str, frozen: bool, batches: tuple[int, ...]) -> None:
        for batch in batches:
            self.table.add(
                arch,
                frozen,
                "limit: random batches on the GPU",
                batch,
                None,
                lambda batch=batch: limit(arch, batch, self.size, frozen, self.args.steps, self.args.warmup),
            )

    def loader_paths(
        self, arch: str, frozen: bool, batch: int, workers: int, ray_too: bool = True, **more: Any
    ) -> None:
        epochs = self.epochs(arch, frozen, batch, False)
        self.table.add(
            arch,
            frozen,
            "Lightning + ShardBatches",
            batch,
            workers,
            lambda: run_epochs(self.config(arch, batch, frozen, workers, epochs, **more)),
        )
        if ray_too:
            self.table.add(
                arch,
                frozen,
                "Ray TorchTrainer, 1 GPU worker",
                batch,
                workers,
                lambda: ray_epochs(self.config(arch, batch, frozen, workers, epochs, **more), self.work, self.cores),
            )

    def limit_row(
        self,
        arch: str,
        frozen: bool,
        compiled: bool,
        size: int | None = None,
        more_steps: int = 1,
        mode: str = "default",
    ) -> int:
        """The model's eager or compiled (in MODE) limit at the run's batch (fused AdamW); the epochs for about
        --seconds at it."""
        batch, size = self.args.gpu_batch, size or self.size
        steps = more_steps * self.args.steps
        warmup = more_steps * (self.args.warmup + 5 if compiled else self.args.warmup)
        named = "" if mode == "default" else f" {mode}"
        path, mode = (f"limit: fused, compile{named}", mode) if compiled else ("limit: fused (eager)", None)
        self.table.add(
            arch, frozen, path, batch, None, lambda: limit(arch, batch, size, frozen, steps, warmup, mode, True)
        )
        return self.epochs(arch, frozen, batch, compiled)

    def compiled_limit_then_ray(self) -> int:
        """ResNet-50's compiled limit, then Ray TorchTrainer with the GPU defaults; the epochs it trained."""
        batch, workers = self.args.gpu_batch, self.workers
        epochs = self.limit_row("resnet50", False, compiled=True)
        self.table.add(
            "resnet50",
            False,
            "Ray TorchTrainer, compile, defaults",
            batch,
            f"{workers}+p",
            lambda: ray_epochs(self.config("resnet50", batch, False, workers, epochs), self.work, self.cores),
        )
        return epochs

    def both_limits(
        self, arch: str, frozen: bool, size: int | None = None, more_steps: int = 1, graphs: bool = False
    ) -> int:
        """The model's eager and compiled limits at the run's batch (with GRAPHS, compiled with CUDA graphs too:
        `reduce-overhead`, which removes the host's launches); the epochs for about --seconds at the fastest."""
        modes = [(False, "default"), (True, "default"), *([(True, "reduce-overhead")] if graphs else [])]
        return max(self.limit_row(arch, frozen, compiled, size, more_steps, mode) for compiled, mode in modes)

    @staticmethod
    def step_label(arch: str) -> str:
        """How the training path's GPU defaults step ARCH: "eager" or "compile" (tasks/rules/training.py)."""
        return "compile" if step_path(arch, None, "default", gpu=True)[0] else "eager"

    def path(
        self, arch: str, frozen: bool, label: str, readers: str, epochs: int, ray_too: bool = False, **more: Any
    ) -> None:
        """The training path at the run's batch in Lightning (and in Ray TorchTrainer with RAY_TOO)."""
        batch = self.args.gpu_batch
        self.table.add(
            arch,
            frozen,
            f"Lightning, {label}",
            batch,
            readers,
            lambda: run_epochs(self.config(arch, batch, frozen, self.workers, epochs, **more)),
        )
        if ray_too:
            self.table.add(
                arch,
                frozen,
                f"Ray TorchTrainer, {label}",
                batch,
                readers,
                lambda: ray_epochs(
                    self.config(arch, batch, frozen, self.workers, epochs, **more), self.work, self.cores
                ),
            )


def section_mobilenet(run: GpuRun) -> None:
    """The default model as a run trains it: its architecture, pretrained weights and image size from the settings'
    defaults, in its own cache at that size; its eager and compiled limits, then the training path's GPU defaults in
    Lightning and in Ray TorchTrainer, and Lightning with two loader processes."""
    defaults = Settings.model_fields
    arch, pretrained, size = (defaults[name].default for name in ("model_arch", "pretrained", "image_size"))
    if not Path(weights_file(weights_of(arch, pretrained))).is_file():
        # No weights file here (a GPU machine without network): a state dict of the same model with random weights
        # takes the same path as the published one (its backbone loaded, its lower learning rate) at the same cost.
        import torchvision

        pretrained = str(run.work / f"{arch}-random-weights.pt")
        torch.save(torchvision.models.get_model(arch, weights=None).state_dict(), pretrained)
        run.table.say(
            f"  {arch}: no file of its {defaults['pretrained'].default} weights here: starts from {pretrained}"
        )
    url = run.cache_at(size)
    at_size = {"train_uri": url, "val_uri": url, "image_size": size, "pretrained": pretrained}
    epochs = run.both_limits(arch, False, size=size, graphs=True)
    workers = run.workers
    run.path(arch, False, f"{run.step_label(arch)}, defaults", f"{workers}+p", epochs, ray_too=True, **at_size)
    run.path(
        arch,
        False,
        f"{run.step_label(arch)}, 2 loader processes",
        f"{workers}+2p",
        epochs,
        loader_processes=2,
        **at_size,
    )


def section_goals(run: GpuRun) -> None:
    """The rows with goals, most wanted first, for a device lent for minutes: the default model (mobilenet), the frozen
    backbone's compiled limit and its path with one and two loader processes, the small CNN's eager limit and its path
    with four, EfficientNet-B0 against its compiled limit, then ResNet-50 on JPEG photos decoded by nvJPEG."""
    section_mobilenet(run)
    workers = run.workers
    epochs = run.both_limits("resnet50", True)
    run.path("resnet50", True, "compile, defaults", f"{workers}+p", epochs)
    run.path("resnet50", True, "compile, 2 loader processes", f"{workers}+2p", epochs, loader_processes=2)
    epochs = run.both_limits("small_cnn", False, more_steps=10, graphs=True)
    run.path(
        "small_cnn", False, "eager, 4 loader processes", f"{workers}+4p", epochs, compile=False, loader_processes=4
    )
    # The loop's own ceiling: Lightning's loop and the model on one batch already on the GPU, no loader at all.
    run.path(
        "small_cnn",
        False,
        "eager, batches on the GPU (the loop's ceiling)",
        "-",
        epochs,
        compile=False,
        gpu_batches=max(1, run.args.images // run.args.gpu_batch),
    )
    epochs = run.both_limits("efficientnet_b0", False)
    run.path(
        "efficientnet_b0", False, f"{run.step_label('efficientnet_b0')}, defaults", f"{workers}+p", epochs, ray_too=True
    )
    jpeg_paths(run, [("resnet50", False)])


def section_resnet50(run: GpuRun) -> None:
    """1 and 2: the limit, then the project's path at the same batch."""
    table, config, limits, loader_paths, workers = (
        run.table,
        run.config,
        run.limits,
        run.loader_paths,
        run.workers,
    )
    limits("resnet50", False, (128, 256))
    loader_paths("resnet50", False, 256, workers)
    epochs = run.epochs("resnet50", False, 256, False)
    table.add(
        "resnet50",
        False,
        "Lightning, metrics checked per step",
        256,
        workers,
        lambda: run_epochs(config("resnet50", 256, False, workers, epochs, checked_metrics=True)),
    )


def section_frozen(run: GpuRun) -> None:
    """3: transfer learning needs several times the rate: how many reader threads it takes."""
    args, table, config, limits, loader_paths, work, cores = (
        run.args,
        run.table,
        run.config,
        run.limits,
        run.loader_paths,
        run.work,
        run.cores,
    )
    limits("resnet50", True, (256,))
    rates = {}
    for threads in args.frozen_workers:
        loader_paths("resnet50", True, 256, threads, ray_too=False)
        rates[threads] = table.rows[-1]["rate"] if table.rows and table.rows[-1]["workers"] == threads else 0.0
    if args.ray_everywhere:
        best = max(rates, key=rates.get)
        epochs = run.epochs("resnet50", True, 256, False)
        table.add(
            "resnet50",
            True,
            "Ray TorchTrainer, 1 GPU worker",
            256,
            best,
            lambda: ray_epochs(config("resnet50", 256, True, best, epochs), work, cores),
        )


def section_small(run: GpuRun) -> None:
    """4: the smaller models, so that users can pick."""
    args, limits, loader_paths, workers = run.args, run.limits, run.loader_paths, run.workers
    limits("resnet18", False, (256,))
    loader_paths("resnet18", False, 256, workers, ray_too=args.ray_everywhere)
    limits("small_cnn", False, (256,))
    loader_paths("small_cnn", False, 256, workers, ray_too=args.ray_everywhere)


def section_profile(run: GpuRun) -> None:
    """Where a step of the project's path goes, host and GPU."""
    args, table, config, workers = run.args, run.table, run.config, run.workers
    epochs = run.epochs("resnet50", False, 256, False)
    profile = str(Path(args.json).with_name("gpu-profile.txt")) if args.json else ""
    table.add(
        "resnet50",
        False,
        "Lightning, under torch.profiler",
        256,
        workers,
        lambda: run_epochs(config("resnet50", 256, False, workers, epochs, profile=profile)),
    )


def section_compile(run: GpuRun) -> None:
    """Torch.compile on the limit: does it raise the ceiling?."""
    args, table, size = run.args, run.table, run.size
    table.add(
        "resnet50",
        False,
        "limit, torch.compile",
        256,
        None,
        lambda: limit("resnet50", 256, size, False, args.steps, args.warmup + 10, compiled="default"),
    )


def section_ladder(run: GpuRun) -> None:
    """ResNet-50's limit one step at a time: the optimizer's kernel, compile, CUDA graphs."""
    args, table, size = run.args, run.table, run.size
    steps, warm = args.steps, args.warmup
    table.add(
        "resnet50",
        False,
        "limit: AdamW foreach (eager)",
        256,
        None,
        lambda: limit("resnet50", 256, size, False, steps, warm),
    )
    table.add(
        "resnet50",
        False,
        "limit: AdamW fused (eager)",
        256,
        None,
        lambda: limit("resnet50", 256, size, False, steps, warm, fused=True),
    )
    table.add(
        "resnet50",
        False,
        "limit: fused, compile",
        256,
        None,
        lambda: limit("resnet50", 256, size, False, steps, warm + 5, "default", True),
    )
    table.add(
        "resnet50",
        False,
        "limit: fused, compile reduce-overhead",
        256,
        None,
        lambda: limit("resnet50", 256, size, False, steps, warm + 5, "reduce-overhead", True),
    )
    table.add(
        "tv_resnet50",
        False,
        "limit: fused (eager), torchvision",
        256,
        None,
        lambda: limit("resnet50", 256, size, False, steps, warm, fused=True, zoo=True),
    )


def section_paths(run: GpuRun) -> None:
    """The training path with the fused optimizer, then compiled, in Lightning and Ray Train."""
    args, table, config, workers, work, cores = run.args, run.table, run.config, run.workers, run.work, run.cores
    rate = table.limits.get(("resnet50", False, 256, True), table.limits.get(("resnet50", False, 256, False), 1000.0))
    epochs = epochs_for(rate, args.images, args.seconds)
    table.add(
        "resnet50",
        False,
        "Lightning, fused AdamW",
        256,
        workers,
        lambda: run_epochs(config("resnet50", 256, False, workers, epochs)),
    )
    table.add(
        "resnet50",
        False,
        "Lightning, compile",
        256,
        workers,
        lambda: run_epochs(config("resnet50", 256, False, workers, epochs, compile="default")),
    )
    table.add(
        "resnet50",
        False,
        "Ray TorchTrainer, compile",
        256,
        workers,
        lambda: ray_epochs(config("resnet50", 256, False, workers, epochs, compile="default"), work, cores),
    )
    table.add(
        "resnet50",
        False,
        "Ray TorchTrainer, compile, 1 loader proc",
        256,
        f"{workers}+p",
        lambda: ray_epochs(
            config("resnet50", 256, False, workers, epochs, compile="default", loader_processes=1), work, cores
        ),
    )


def section_loader(run: GpuRun) -> None:
    """Reader threads in the training process against a loader process, where the loader limits."""
    table, config, limits, size, workers, url = (
        run.table,
        run.config,
        run.limits,
        run.size,
        run.workers,
        run.url,
    )
    for threads in (4, 8):
        table.add(
            "loader",
            False,
            "ShardBatches alone, threads",
            256,
            threads,
            lambda threads=threads: loader_alone(url, size, 256, threads, 0),
        )
        table.add(
            "loader",
            False,
            "ShardBatches alone, 1 process",
            256,
            f"{threads}+p",
            lambda threads=threads: loader_alone(url, size, 256, threads, 1),
        )
    for arch, frozen in (("resnet50", True), ("small_cnn", False)):
        limits(arch, frozen, (256,))
        epochs = run.epochs(arch, frozen, 256, False)
        table.add(
            arch,
            frozen,
            "Lightning, threads",
            256,
            workers,
            lambda arch=arch, frozen=frozen, epochs=epochs: run_epochs(config(arch, 256, frozen, workers, epochs)),
        )
        table.add(
            arch,
            frozen,
            "Lightning, 1 loader process",
            256,
            f"{workers}+p",
            lambda arch=arch, frozen=frozen, epochs=epochs: run_epochs(
                config(arch, 256, frozen, workers, epochs, loader_processes=1)
            ),
        )


def section_final(run: GpuRun) -> None:
    """The training path's defaults on a GPU, against each model's eager and compiled limits."""
    args, table, config, size, workers, work, cores, compiled_limit_then_ray = (
        run.args,
        run.table,
        run.config,
        run.size,
        run.workers,
        run.work,
        run.cores,
        run.compiled_limit_then_ray,
    )
    batch = args.gpu_batch

    def defaults(arch: str, frozen: bool, baseline_too: bool) -> None:
        epochs = run.epochs(arch, frozen, batch, True)
        # The defaults with a GPU: compiled, one loader process, the next epoch begun ahead.
        table.add(
            arch,
            frozen,
            "Lightning, compile, defaults",
            batch,
            f"{workers}+p",
            lambda: run_epochs(config(arch, batch, frozen, workers, epochs)),
        )
        if baseline_too:
            table.add(
                arch,
                frozen,
                "Lightning, compile, no next epoch ahead",
                batch,
                f"{workers}+p",
                lambda: run_epochs(config(arch, batch, frozen, workers, epochs, next_epoch_ahead=False)),
            )

    steps, warm = args.steps, args.warmup
    table.add(
        "resnet50",
        False,
        "limit: fused (eager)",
        batch,
        None,
        lambda: limit("resnet50", batch, size, False, steps, warm, fused=True),
    )
    epochs = compiled_limit_then_ray()
    defaults("resnet50", False, baseline_too=True)
    for arch, frozen in (("resnet50", True), ("small_cnn", False)):
        table.add(
            arch,
            frozen,
            "limit: fused (eager)",
            batch,
            None,
            lambda arch=arch, frozen=frozen: limit(arch, batch, size, frozen, steps, warm, fused=True),
        )
        table.add(
            arch,
            frozen,
            "limit: fused, compile",
            batch,
            None,
            lambda arch=arch, frozen=frozen: limit(arch, batch, size, frozen, steps, warm + 5, "default", True),
        )
        defaults(arch, frozen, baseline_too=False)
    table.add(
        "small_cnn",
        False,
        "Lightning, eager, threads",
        batch,
        workers,
        lambda: run_epochs(
            config(
                "small_cnn",
                batch,
                False,
                workers,
                run.epochs("small_cnn", False, batch, False),
                compile=False,
                loader_processes=0,
            )
        ),
    )
    table.add(
        "resnet50",
        False,
        "Ray TorchTrainer, compile, no next epoch ahead",
        batch,
        f"{workers}+p",
        lambda: ray_epochs(config("resnet50", batch, False, workers, epochs, next_epoch_ahead=False), work, cores),
    )


def section_diagnose(run: GpuRun) -> None:
    """Where the frozen backbone and the small CNN lose their steps: the loop, the loader, syncs."""
    args, table, config, size, workers, url = run.args, run.table, run.config, run.size, run.workers, run.url
    batch, steps, warm = args.gpu_batch, args.steps, args.warmup
    on_gpu_steps = max(1, args.images // batch)
    epochs = run.limit_row("resnet50", True, compiled=True)
    table.add(
        "resnet50",
        True,
        "Lightning, compile, defaults",
        batch,
        f"{workers}+p",
        lambda: run_epochs(config("resnet50", batch, True, workers, epochs)),
    )
    table.add(
        "resnet50",
        True,
        "Lightning, compile, batches on the GPU",
        batch,
        None,
        lambda: run_epochs(config("resnet50", batch, True, workers, epochs, gpu_batches=on_gpu_steps)),
    )
    table.add(
        "resnet50",
        True,
        "Lightning, compile reduce-overhead",
        batch,
        f"{workers}+p",
        lambda: run_epochs(config("resnet50", batch, True, workers, epochs, compile="reduce-overhead")),
    )
    profile = str(Path(args.json).with_name("gpu-profile-frozen.txt")) if args.json else ""
    table.add(
        "resnet50",
        True,
        "Lightning, compile, syncs watched, profiled",
        batch,
        f"{workers}+p",
        lambda: run_epochs(config("resnet50", batch, True, workers, epochs, sync_watch=True, profile=profile)),
    )
    table.add(
        "small_cnn",
        False,
        "limit: fused (eager)",
        batch,
        None,
        lambda: limit("small_cnn", batch, size, False, steps, warm, fused=True),
    )
    epochs = run.epochs("small_cnn", False, batch, False, slower=3)
    table.add(
        "small_cnn",
        False,
        "Lightning, eager, batches on the GPU",
        batch,
        None,
        lambda: run_epochs(config("small_cnn", batch, False, workers, epochs, compile=False, gpu_batches=on_gpu_steps)),
    )
    for processes in (1, 2, 4):
        table.add(
            "loader",
            False,
            f"{processes} loader processes at once",
            batch,
            f"{workers}+{processes}p",
            lambda processes=processes: loaders_together(url, size, batch, workers, processes),
        )
    table.add(
        "small_cnn",
        False,
        "Lightning, eager, 1 loader process",
        batch,
        f"{workers}+p",
        lambda: run_epochs(config("small_cnn", batch, False, workers, epochs, compile=False)),
    )
    table.add(
        "small_cnn",
        False,
        "Lightning, eager, syncs watched",
        batch,
        f"{workers}+p",
        lambda: run_epochs(config("small_cnn", batch, False, workers, epochs, compile=False, sync_watch=True)),
    )


def section_targets(run: GpuRun) -> None:
    """The frozen backbone and the small CNN against their limits, the per-step wait gone; more loader processes."""
    args, table, config, size, workers = run.args, run.table, run.config, run.size, run.workers
    batch, steps, warm = args.gpu_batch, args.steps, args.warmup
    on_gpu_steps = max(1, args.images // batch)
    epochs = run.limit_row("resnet50", True, compiled=True)
    table.add(
        "resnet50",
        True,
        "Lightning, compile, batches on the GPU",
        batch,
        None,
        lambda: run_epochs(config("resnet50", batch, True, workers, epochs, gpu_batches=on_gpu_steps)),
    )
    table.add(
        "resnet50",
        True,
        "Lightning, compile, defaults",
        batch,
        f"{workers}+p",
        lambda: run_epochs(config("resnet50", batch, True, workers, epochs)),
    )
    # The small CNN's steps are short: ten times the steps for a steady limit.
    table.add(
        "small_cnn",
        False,
        "limit: fused (eager)",
        batch,
        None,
        lambda: limit("small_cnn", batch, size, False, 10 * steps, 2 * warm, fused=True),
    )
    epochs = run.epochs("small_cnn", False, batch, False, slower=3)
    table.add(
        "small_cnn",
        False,
        "Lightning, eager, batches on the GPU",
        batch,
        None,
        lambda: run_epochs(config("small_cnn", batch, False, workers, epochs, compile=False, gpu_batches=on_gpu_steps)),
    )
    for processes in (2, 4):
        table.add(
            "small_cnn",
            False,
            f"Lightning, eager, {processes} loader processes",
            batch,
            f"{workers}+{processes}p",
            lambda processes=processes: run_epochs(
                config("small_cnn", batch, False, workers, epochs, compile=False, loader_processes=processes)
            ),
        )
    table.add(
        "resnet50",
        True,
        "Lightning, compile, 2 loader processes",
        batch,
        f"{workers}+2p",
        lambda: run_epochs(
            config(
                "resnet50",
                batch,
                True,
                workers,
                run.epochs("resnet50", True, batch, True),
                loader_processes=2,
            )
        ),
    )


def section_zoo_path(run: GpuRun) -> None:
    """Torchvision's models in the training path, against their own limits."""
    args, table, config, size, workers, work, cores, sections = (
        run.args,
        run.table,
        run.config,
        run.size,
        run.workers,
        run.work,
        run.cores,
        run.sections,
    )
    batch, steps, warm = args.gpu_batch, args.steps, args.warmup
    for arch in ("efficientnet_b0", "vit_b_16"):
        if "zoo-eager" in sections:
            table.add(
                arch,
                False,
                "limit: fused (eager)",
                batch,
                None,
                lambda arch=arch: limit(arch, batch, size, False, steps, warm, fused=True),
            )
        table.add(
            arch,
            False,
            "limit: fused, compile",
            batch,
            None,
            lambda arch=arch: limit(arch, batch, size, False, steps, warm + 5, "default", True),
        )
        epochs = run.epochs(arch, False, batch, True)
        table.add(
            arch,
            False,
            "Lightning, compile, defaults",
            batch,
            f"{workers}+p",
            lambda arch=arch, epochs=epochs: run_epochs(config(arch, batch, False, workers, epochs)),
        )
        if "zoo-ray" in sections:
            table.add(
                arch,
                False,
                "Ray TorchTrainer, compile, defaults",
                batch,
                f"{workers}+p",
                lambda arch=arch, epochs=epochs: ray_epochs(config(arch, batch, False, workers, epochs), work, cores),
            )


def section_table(run: GpuRun) -> None:
    """Every model: eager and compiled limits, then the training path in Lightning and Ray."""
    args, table, config, size, workers, work, cores = (
        run.args,
        run.table,
        run.config,
        run.size,
        run.workers,
        run.work,
        run.cores,
    )
    batch, steps, warm = args.gpu_batch, args.steps, args.warmup

    both_limits, path = run.both_limits, run.path

    # The small CNN's steps are short: ten times the steps for a steady limit. It is fed by several loader
    # processes (loader_processes), compiled or not.
    epochs = both_limits("small_cnn", False, more_steps=10)
    for processes in args.small_processes:
        path(
            "small_cnn",
            False,
            f"eager, {processes} loader processes",
            f"{workers}+{processes}p",
            epochs,
            compile=False,
            loader_processes=processes,
        )
    # What Lightning's loop gives this model without any loader: one batch already on the GPU, again and again.
    path(
        "small_cnn",
        False,
        "eager, batches on the GPU",
        "-",
        epochs,
        compile=False,
        gpu_batches=args.images // batch,
    )
    small_epochs = epochs
    epochs = both_limits("resnet50", False)
    path("resnet50", False, "compile, defaults", f"{workers}+p", epochs, ray_too=True)
    epochs = both_limits("resnet50", True)
    path("resnet50", True, "compile, defaults", f"{workers}+p", epochs)
    # One loader process made about 20,000 images/s alone (H100), under the frozen backbone's compiled limit.
    for processes in args.frozen_processes:
        path(
            "resnet50",
            True,
            f"compile, {processes} loader processes",
            f"{workers}+{processes}p",
            epochs,
            loader_processes=processes,
        )
    for arch in ("vit_b_16", "efficientnet_b0"):
        epochs = both_limits(arch, False)
        path(arch, False, "compile, defaults", f"{workers}+p", epochs)
    path(
        "small_cnn",
        False,
        f"compile, {args.small_processes[0]} loader processes",
        f"{workers}+{args.small_processes[0]}p",
        small_epochs,
        loader_processes=args.small_processes[0],
    )
    # A larger batch spreads the loop's host work per step over more images: the small CNN at 4 times the batch,
    # against its own limit at that batch.
    big = 4 * batch
    table.add(
        "small_cnn",
        False,
        "limit: fused (eager)",
        big,
        None,
        lambda: limit("small_cnn", big, size, False, 5 * steps, 5 * warm, None, True),
    )
    big_epochs = run.epochs("small_cnn", False, big, False)
    table.add(
        "small_cnn",
        False,
        f"Lightning, eager, {args.small_processes[0]} loader processes",
        big,
        f"{workers}+{args.small_processes[0]}p",
        lambda: run_epochs(
            config(
                "small_cnn",
                big,
                False,
                workers,
                big_epochs,
                compile=False,
                loader_processes=args.small_processes[0],
            )
        ),
    )
    for arch, frozen in (("resnet50", True), ("vit_b_16", False), ("efficientnet_b0", False)):
        epochs = run.epochs(arch, frozen, batch, True)
        table.add(
            arch,
            frozen,
            "Ray TorchTrainer, compile, defaults",
            batch,
            f"{workers}+p",
            lambda arch=arch, frozen=frozen, epochs=epochs: ray_epochs(
                config(arch, batch, frozen, workers, epochs), work, cores
            ),
        )


def section_ray(run: GpuRun) -> None:
    """The Ray row of "final" alone, against the compiled limit."""
    run.compiled_limit_then_ray()


def section_jpeg(run: GpuRun) -> None:
    """Cache bytes per image as raw pixels and as JPEG, and how fast each becomes a batch on the device."""
    table, size = run.table, run.size
    try:
        jpeg_section(table, size)
    except Exception as error:
        table.failed += 1
        table.say(f"JPEG section FAILED: {type(error).__name__}: {error}")


def jpeg_paths(run: GpuRun, models: list[tuple[str, bool]]) -> None:
    """The training path over real photos cached as raw pixels and as JPEG (cache_format), for each (arch, frozen) of
    MODELS: raw pixels, JPEG decoded on the training device (nvJPEG on a GPU), JPEG decoded by 4 loader processes."""
    args, table, config, workers = run.args, run.table, run.config, run.workers
    batch = args.gpu_batch
    caches = run.photo_caches()
    for image_format, uri in caches.items():
        files = list(Path(uri.removeprefix("file://")).parent.glob("*.parquet"))
        per_image = sum(f.stat().st_size for f in files) / args.images
        table.say(f"  photos, {image_format}: {per_image:,.0f} bytes/image")
    paths = (
        ("raw", "Lightning, compile, photos: raw", {}, f"{workers}+p"),
        ("jpeg", "Lightning, compile, photos: JPEG, nvJPEG", {"jpeg_decode": "device"}, workers),
        (
            "jpeg",
            "Lightning, compile, photos: JPEG, 4 loader processes",
            {"jpeg_decode": "loader", "loader_processes": 4},
            f"{workers}+4p",
        ),
    )
    for arch, frozen in models:
        epochs = run.epochs(arch, frozen, batch, True)
        for image_format, path, more, readers in paths:
            uris = {"train_uri": caches[image_format], "val_uri": caches[image_format]}
            table.add(
                arch,
                frozen,
                path,
                batch,
                readers,
                lambda arch=arch, frozen=frozen, more=more, uris=uris, epochs=epochs: run_epochs(
                    {**config(arch, batch, frozen, workers, epochs, **more), **uris}
                ),
            )


def section_jpeg_path(run: GpuRun) -> None:
    """The training path over real photos cached as raw pixels and as JPEG, for the models of --jpeg-models."""
    models = {"resnet50": ("resnet50", False), "frozen": ("resnet50", True), "small_cnn": ("small_cnn", False)}
    jpeg_paths(run, [models[name] for name in run.args.jpeg_models])


def section_zoo(run: GpuRun) -> None:
    """Torchvision's models: what compile gives each."""
    args, table, size = run.args, run.table, run.size
    for arch in ("efficientnet_b0", "vit_b_16"):
        table.add(
            arch,
            False,
            "limit: fused (eager), torchvision",
            256,
            None,
            lambda arch=arch: limit(arch, 256, size, False, args.steps, args.warmup, fused=True, zoo=True),
        )
        table.add(
            arch,
            False,
            "limit: fused, compile, torchvision",
            256,
            None,
            lambda arch=arch: limit(arch, 256, size, False, args.steps, args.warmup + 5, "default", True, zoo=True),
        )


# The table's sections in the order they run, whatever the order of --sections.
SECTIONS: dict[str, Callable[[GpuRun], None]] = {
    "goals": section_goals,
    "mobilenet": section_mobilenet,
    "resnet50": section_resnet50,
    "frozen": section_frozen,
    "small": section_small,
    "profile": section_profile,
    "compile": section_compile,
    "ladder": section_ladder,
    "paths": section_paths,
    "loader": section_loader,
    "final": section_final,
    "diagnose": section_diagnose,
    "targets": section_targets,
    "zoo-path": section_zoo_path,
    "table": section_table,
    "ray": section_ray,
    "jpeg": section_jpeg,
    "jpeg-path": section_jpeg_path,
    "zoo": section_zoo,
}
ZOO_PATH_OPTIONS = ("zoo-eager", "zoo-ray")  # not sections: rows zoo-path adds when they are named too


def record_gpu_rows(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """A record of the table's rows for each model and the layers it trains (gpu_<arch>_<all|head>): each row's rate,
    share of its limit, data wait and memory, named by its path, batch and loader workers."""
    by_model: dict[tuple[str, bool], dict[str, float | int | str]] = {}
    for row in rows:
        words = f"{row['path']} b{row['batch']} w{row['workers'] or ''}"
        prefix = "_".join("".join(c if c.isalnum() else " " for c in words).split()).lower()
        found = by_model.setdefault((row["arch"], row["frozen"]), {})
        found[f"{prefix}_images_per_s"] = round(row["rate"])
        if row.get("of_limit") is not None:
            found[f"{prefix}_of_limit"] = round(row["of_limit"], 2)
        if row.get("wait") is not None:
            found[f"{prefix}_data_wait_pct"] = round(100 * row["wait"], 1)
        if row.get("peak_gib") is not None:
            found[f"{prefix}_peak_gib"] = round(row["peak_gib"], 1)
    for (arch, frozen), values in by_model.items():
        layers = "head" if frozen else "all"
        figures.record(
            f"gpu_{arch}_{layers}",
            f"{arch} training {'its head' if frozen else 'all layers'}: images/s of each path against its limit",
            figures.invoked(),
            values,
            note=f"sections {','.join(args.sections)}; {args.images} images {args.size} px",
        )


def gpu_table(args: argparse.Namespace, url: str, work: Path) -> int:
    """The sections --sections names, in SECTIONS' order; how many rows failed."""
    run = GpuRun(args, url, work)
    # Ray's object store is unused here (the loader reads Parquet itself): a small one starts fast anywhere.
    ray.init(
        num_cpus=run.cores + 1,
        num_gpus=int(run.gpu),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        object_store_memory=2 * 2**30,
    )
    for name, section in SECTIONS.items():
        if name in run.sections:
            try:
                section(run)
            except Exception as error:  # outside a row (a cache written, say): the other sections still run
                traceback.print_exc()
                run.table.failed += 1
                run.table.say(f"section {name} FAILED: {type(error).__name__}: {error}")
    if run.table.rows and not args.dry_run and not args.no_record:
        record_gpu_rows(run.table.rows, args)
    return run.table.failed


def cpu_comparison(args: argparse.Namespace, url: str, work: Path) -> None:
    cores = os.cpu_count() or 2
    print(
        f"{args.images} images {args.size}x{args.size}, {args.arch}, batch {args.batch}, {args.epochs} "
        "epochs (the first is warm-up), "
        f"CPU, {cores} cores, {torch.get_num_threads()} torch threads"
    )
    config = train_config(url, args.size, args.arch, args.batch, args.epochs, args.loader_workers, gpu=False)

    def report(label: str, result: dict[str, Any], wall: float) -> float:
        print(
            f"{label:44} {result['rate']:8.1f} images/s   data wait {result['wait']:5.1%}   wall {wall:6.1f} s",
            flush=True,
        )
        return result["rate"]

    started = time.perf_counter()
    a = report("(a) plain Lightning, one process", run_epochs(config), time.perf_counter() - started)
    # The worker gets every core, as the plain process has (Ray sets its torch threads from its CPUs); +1 for the
    # controller.
    ray.init(num_cpus=cores + 1, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    started = time.perf_counter()
    result = ray_epochs(config, work, cores)
    b = report(
        f"(b) Ray Train TorchTrainer, one worker ({result['threads']} threads)", result, time.perf_counter() - started
    )
    print(f"TorchTrainer / plain Lightning: {b / a:.2f}")
    if not args.no_record:
        figures.record(
            "train_cpu",
            f"training images/s on the CPU: Ray Train's TorchTrainer against plain Lightning ({args.arch}, "
            f"{args.size} px, batch {args.batch})",
            figures.invoked(),
            {
                "plain_lightning_images_per_s": round(a, 1),
                "torchtrainer_images_per_s": round(b, 1),
                "torchtrainer_of_plain_ratio": round(b / a, 2),
            },
        )


def host_time(args: argparse.Namespace) -> None:
    """The host's time per step of the training path's Lightning loop, measured where the model's own work is next to
    nothing (the small CNN on batches of 8 images of 4x4 px, already in memory, one torch thread): what a GPU whose
    step is shorter waits for. Against the loop as it was (metric objects handed to self.log at every step); the two
    alternate, --repeats times each."""
    torch.set_num_threads(1)
    batch = 8
    config = train_config("", 4, "small_cnn", batch, 3, 1, gpu=False, gpu_batches=args.host_steps)
    loops = {"before: self.log at every step": True, "now: self.log once an epoch": False}
    rows: dict[str, list[float]] = {label: [] for label in loops}
    for _ in range(args.repeats):
        for label, every in loops.items():
            rows[label].append(batch / run_epochs({**config, "log_every_step": every})["rate"] * 1000)
    print(f"host ms per step, {args.host_steps} steps an epoch, the last 2 of 3 epochs, {args.repeats} runs each")
    for label, times in rows.items():
        print(f"{label:34} min {min(times):6.2f}  median {float(np.median(times)):6.2f}  max {max(times):6.2f}")
    before, now = (float(np.median(times)) for times in rows.values())
    print(f"now / before (medians): {now / before:.2f}")
    if not args.no_record:
        figures.record(
            "train_host_step",
            f"the host's ms per Lightning step with next to no model work ({args.host_steps} steps an epoch, "
            f"median of {args.repeats})",
            figures.invoked(),
            {"now_ms": round(now, 2), "before_ms": round(before, 2), "now_of_before_ratio": round(now / before, 2)},
        )


def counts(text: str) -> list[int]:
    """A command-line list of counts: "2,4" -> [2, 4]."""
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="the GPU table (needs one CUDA GPU)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=(
            "the GPU table's code on the CPU: every section (or those of --sections) on 64 images of 32 px, 2 steps "
            "a limit, torch.compile off; exits 1 if a row fails"
        ),
    )
    parser.add_argument("--host", action="store_true", help="CPU: the host's time per Lightning step (no cache)")
    parser.add_argument("--host-steps", type=int, default=400, help="--host: steps an epoch")
    parser.add_argument("--repeats", type=int, default=3, help="--host: runs of each loop")
    parser.add_argument("--images", type=int, help="cached images (default 2048 on CPU, 16384 with --gpu)")
    parser.add_argument("--size", type=int, help="image size (default 96 on CPU, 224 with --gpu)")
    parser.add_argument("--files", type=int, default=8, help="Parquet files in the cache")
    parser.add_argument("--loader-workers", type=int, help="Petastorm reader threads (default 2 on CPU, 8 with --gpu)")
    parser.add_argument("--arch", default="small_cnn", help="CPU only")
    parser.add_argument("--batch", type=int, default=64, help="CPU only")
    parser.add_argument("--epochs", type=int, default=6, help="CPU only")
    parser.add_argument(
        "--sections",
        type=lambda s: s.split(","),
        help=(
            "GPU only: which parts of the table, comma-separated (default goals; also mobilenet, final, table, "
            "targets, diagnose, zoo-path with zoo-eager and zoo-ray, jpeg-path; ladder, paths, loader, jpeg, zoo, "
            "resnet50, frozen, small, profile, compile: earlier tables'; all: every one)"
        ),
    )
    parser.add_argument(
        "--frozen-workers",
        type=counts,
        default=[2, 4],
        help="GPU only: reader threads tried for the frozen backbone",
    )
    parser.add_argument(
        "--ray-everywhere",
        action="store_true",
        help="GPU only: Ray rows for the frozen backbone and the smaller models too",
    )
    parser.add_argument("--steps", type=int, default=40, help="GPU only: timed steps of each limit")
    parser.add_argument("--warmup", type=int, default=15, help="GPU only: untimed steps before them")
    parser.add_argument(
        "--seconds",
        type=float,
        default=8.0,
        help="GPU only: about how long each loader path trains after its warm-up epoch",
    )
    parser.add_argument("--gpu-batch", type=int, default=256, help="GPU only: the batch of the final section")
    parser.add_argument(
        "--no-page-lock",
        action="store_true",
        help="GPU only: loader processes' batches copied into pinned memory, not sent from their page-locked buffers",
    )
    parser.add_argument(
        "--jpeg-models",
        type=lambda s: s.split(","),
        default=["resnet50", "frozen", "small_cnn"],
        help="GPU only, section jpeg-path: which of resnet50, frozen and small_cnn train on the photo caches",
    )
    parser.add_argument(
        "--small-processes",
        type=counts,
        default=[4, 8],
        help="GPU only, section table: the loader processes tried for the small CNN",
    )
    parser.add_argument(
        "--frozen-processes",
        type=counts,
        default=[2],
        help="GPU only, section table: loader processes tried for the frozen backbone besides the default",
    )
    parser.add_argument("--json", help="GPU only: also write the rows to this file")
    figures.add_record_option(parser)
    args = parser.parse_args()
    if args.host:
        host_time(args)
        return
    if args.dry_run:  # the table's code, at sizes a 2-core machine runs in minutes
        args.gpu = True
        args.images, args.size, args.files = args.images or 64, args.size or 32, 8  # 8 row groups: 4 loaders
        args.loader_workers = args.loader_workers or 2
        args.steps, args.warmup, args.seconds, args.gpu_batch = 2, 1, 0.01, 16
        global DRY_RUN_BATCH
        DRY_RUN_BATCH = args.gpu_batch
        args.frozen_workers, args.small_processes, args.frozen_processes = [2], [1, 2], [1]
        args.sections = args.sections or ["all"]
        # Here and in Ray's workers (started after this, with this environment): models run as written.
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
        torch.compiler.set_stance("force_eager")
    args.images = args.images or (16384 if args.gpu else 2048)
    args.size = args.size or (224 if args.gpu else 96)
    args.loader_workers = args.loader_workers or (8 if args.gpu else 2)
    args.sections = args.sections or ["goals"]
    if args.sections == ["all"]:  # goals runs mobilenet's rows first
        args.sections = [*(name for name in SECTIONS if name != "mobilenet"), *ZOO_PATH_OPTIONS]
    unknown = set(args.sections) - set(SECTIONS) - set(ZOO_PATH_OPTIONS)
    if unknown:
        parser.error(f"--sections: no section {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)} or all")
    if args.gpu and not args.dry_run and not torch.cuda.is_available():
        parser.error("--gpu: torch sees no CUDA GPU on this machine (--dry-run runs the table's code on the CPU)")
    ShardBatches.PAGE_LOCK = not args.no_page_lock
    work = Path(tempfile.mkdtemp(prefix="imagelake-train-"))
    try:
        started = time.perf_counter()
        url = write_cache(work / "train", args.images, args.size, args.files)
        print(f"cache written in {time.perf_counter() - started:.1f} s", flush=True)
        if not args.gpu:
            cpu_comparison(args, url, work)
            return
        failed = gpu_table(args, url, work)
        print(f"the table took {time.perf_counter() - started:.0f} s; {failed} row(s) failed", flush=True)
        if failed:
            sys.exit(1)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
