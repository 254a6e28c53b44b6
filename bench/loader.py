"""Training input throughput: imagelake's Petastorm shard loader against Petastorm's defaults and the limit, side by
side.

    .venv/bin/python bench/loader.py [--images 2000] [--size 224] [--batch 64]

All three read the same cached split (Parquet written by Spark, as the cache stage writes it) and
end with what the model consumes:
(a) Petastorm defaults: make_batch_reader + a per-row TransformSpec + petastorm.pytorch.DataLoader, float tensors
(b) the limit: pyarrow iter_batches, one np.frombuffer over the image column's data buffer, uint8 tensors
(c) imagelake: ShardBatches (one-pass Petastorm reader per epoch, shuffle buffer), uint8 NHWC tensors
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import torch
from figures import add_record_option, keep  # bench/figures.py
from petastorm import make_batch_reader
from petastorm.pytorch import DataLoader
from petastorm.transform import TransformSpec

from imagelake.infra.settings import Settings
from imagelake.infra.spark import spark_session
from imagelake.tasks.worker.loader import ShardBatches


def write_cache(spark, out: Path, images: int, size: int, partitions: int) -> str:
    """A split in the cache's layout: image (raw uint8 pixels), label, sha256; 8 MB row groups."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (images, size * size * 3), dtype=np.uint8)
    frame = pd.DataFrame(
        {
            "image": [row.tobytes() for row in pixels],
            "label": rng.integers(0, 10, images),
            "sha256": [f"{i:064x}" for i in range(images)],
        }
    )
    spark.createDataFrame(frame).repartition(partitions).write.mode("overwrite").option(
        "parquet.block.size", 8 * 1024 * 1024
    ).parquet(str(out))
    return f"file://{out}"


def petastorm_defaults(url: str, size: int, batch: int) -> int:
    """(a) Per-row decode in a TransformSpec, Petastorm's torch DataLoader, float tensors."""

    def decode(frame: pd.DataFrame) -> pd.DataFrame:
        frame["image"] = frame["image"].map(
            lambda b: np.frombuffer(b, dtype=np.uint8).reshape(size, size, 3).astype(np.float32) / 255.0
        )
        return frame[["image", "label"]]

    spec = TransformSpec(
        decode, edit_fields=[("image", np.float32, (size, size, 3), False)], selected_fields=["image", "label"]
    )
    seen = 0
    with make_batch_reader(url, schema_fields=["image", "label"], num_epochs=1, transform_spec=spec) as reader:
        for images, _ in ((b["image"], b["label"]) for b in DataLoader(reader, batch_size=batch)):
            seen += len(images)
    return seen


def limit(url: str, size: int, batch: int) -> int:
    """(b) pyarrow batches turned into uint8 tensors by one frombuffer over the column's data buffer."""
    seen = 0
    for record_batch in ds.dataset(url.removeprefix("file://"), format="parquet").to_batches(
        columns=["image", "label"], batch_size=batch
    ):
        column = record_batch.column(0)
        offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=len(column) + 1, offset=column.offset * 4)
        data = np.frombuffer(
            column.buffers()[2], dtype=np.uint8, count=int(offsets[-1] - offsets[0]), offset=int(offsets[0])
        )
        images = torch.from_numpy(data.reshape(len(column), size, size, 3))
        labels = torch.from_numpy(record_batch.column(1).to_numpy(zero_copy_only=False).copy())
        seen += len(images) if len(labels) == len(images) else 0
    return seen


def imagelake(url: str, size: int, batch: int, workers: int) -> int:
    """(c) The loader training uses, on one shard covering the split, for one epoch."""
    seen = 0
    with ShardBatches(
        url, shard=0, shard_count=1, batch_size=batch, image_size=size, seed=0, shuffle=True, workers=workers
    ) as loader:
        for images, labels in loader:
            assert images.dtype == torch.uint8 and labels.dtype == torch.int64
            seen += len(images)
    return seen


def one_pass(label: str, images: int, work) -> float:
    started = time.perf_counter()
    seen = work()
    if seen != images:
        raise AssertionError(f"{label} read {seen} images, not {images}")
    return seen / (time.perf_counter() - started)


def report(label: str, rates: list[float]) -> float:
    median = statistics.median(rates)
    print(f"{label:58} {median:9.1f} images/s  (median of {len(rates)}: {min(rates):.0f}-{max(rates):.0f})", flush=True)
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--passes", type=int, default=7, help="passes of (b) and (c), taking turns; medians are printed"
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="Petastorm reader threads for (c)")
    add_record_option(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="imagelake-loader-"))
    try:
        spark = spark_session(Settings(workspace=work / "ws"))
        url = write_cache(spark, work / "train", args.images, args.size, partitions=4)
        print(
            f"{args.images} images {args.size}x{args.size}x3 uint8 in Parquet, batches of {args.batch}, "
            f"{os.cpu_count()} cores",
            flush=True,
        )
        # Warm the page cache and imports for every method alike.
        limit(url, args.size, args.batch)
        imagelake(url, args.size, args.batch, args.workers)
        a = report(
            "(a) Petastorm defaults: TransformSpec per row + DataLoader",
            [one_pass("a", args.images, lambda: petastorm_defaults(url, args.size, args.batch))],
        )
        # (b) and (c) take turns, pass after pass, so that both see the same machine state.
        rates: dict[str, list[float]] = {"b": [], "c": []}
        for _ in range(args.passes):
            rates["b"].append(one_pass("b", args.images, lambda: limit(url, args.size, args.batch)))
            rates["c"].append(one_pass("c", args.images, lambda: imagelake(url, args.size, args.batch, args.workers)))
        b = report("(b) limit: pyarrow + one frombuffer per batch, uint8", rates["b"])
        c = report("(c) imagelake ShardBatches, uint8, shuffled", rates["c"])
        print(f"imagelake / limit: {c / b:.2f}   imagelake / Petastorm defaults: {c / a:.1f}")
        keep(
            args,
            "loader",
            f"the training loader's images/s from the Parquet cache ({args.images} images, {args.size} px)",
            {
                "petastorm_defaults_images_per_s": round(a, 1),
                "limit_images_per_s": round(b, 1),
                "imagelake_images_per_s": round(c, 1),
                "imagelake_of_limit_ratio": round(c / b, 2),
            },
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
