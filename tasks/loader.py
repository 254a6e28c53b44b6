"""Training input: one Petastorm shard of a cached split, as uint8 image batches, exactly one pass per epoch.

Every worker takes the same number of steps per epoch (DDP needs that); each worker's shard is
split into that many batches, so every sample of a shard is seen exactly once per epoch. Each
epoch opens a fresh one-pass reader, so no reader is ever reset in the middle of iteration.
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache
from typing import Any, Iterator, Self

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from petastorm import make_batch_reader
from petastorm.arrow_reader_worker import ArrowReaderWorkerResultsQueueReader
from petastorm.workers_pool import EmptyResultError

# Petastorm is pinned with pyarrow 14 on purpose (see pyproject.toml): its legacy-API notices are known and noise.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")


class ShardTooSmall(ValueError):
    """A worker's shard has fewer rows than the steps every worker must take."""


@lru_cache(maxsize=32)
def row_group_sizes(url: str) -> tuple[int, ...]:
    """Rows of each row group of a Parquet folder, in the order Petastorm numbers them (files by path, then row groups)."""
    fs, root = fsspec.core.url_to_fs(url)
    files = sorted(path for path in fs.find(root) if path.endswith(".parquet") and not path.rsplit("/", 1)[-1].startswith(("_", ".")))
    sizes: list[int] = []
    for path in files:
        with fs.open(path, "rb") as handle:
            meta = pq.ParquetFile(handle).metadata
        sizes.extend(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return tuple(sizes)


def shard_rows(url: str, shard_count: int) -> list[int]:
    """Rows each shard gets: Petastorm gives row group i to shard i % shard_count."""
    sizes = row_group_sizes(url)
    if len(sizes) < shard_count:
        raise ShardTooSmall(f"{url} has {len(sizes)} row groups, fewer than the {shard_count} workers: cache with more partitions")
    return [sum(sizes[shard::shard_count]) for shard in range(shard_count)]


def steps_per_epoch(rows_per_shard: list[int], batch_size: int) -> int:
    """Steps every worker takes per epoch: enough batches of at most `batch_size` for the largest shard."""
    if not rows_per_shard or min(rows_per_shard) <= 0:
        raise ValueError(f"cannot train on an empty shard (rows per shard: {rows_per_shard})")
    return max(1, math.ceil(max(rows_per_shard) / batch_size))


def batch_sizes(rows: int, steps: int) -> list[int]:
    """Split a shard's rows into `steps` batches whose sizes differ by at most one."""
    if rows < steps:
        raise ShardTooSmall(f"a shard of {rows} rows cannot fill {steps} steps: use fewer workers, a smaller batch or more partitions")
    base, extra = divmod(rows, steps)
    return [base + 1] * extra + [base] * (steps - extra)


class ShardBatches:
    """Batches of shard `shard` of `shard_count` of a Petastorm-readable Parquet folder.

    Iterating gives one epoch: `len(self)` batches (the same on every shard) holding every row of
    the shard once, as (uint8 NHWC images, int64 labels). With `shuffle`, row groups come in a
    seeded random order and rows are drawn at random from a buffer of `buffer_batches` batches.
    """

    def __init__(
        self,
        url: str,
        *,
        shard: int,
        shard_count: int,
        batch_size: int,
        image_size: int,
        seed: int,
        shuffle: bool,
        workers: int = 2,
        buffer_batches: int = 4,
        key_field: str | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.url, self.shard, self.shard_count = url, shard, shard_count
        self.image_size, self.seed, self.shuffle, self.workers = image_size, seed, shuffle, workers
        self.buffer_rows = max(1, buffer_batches) * batch_size
        self.key_field, self.pin_memory = key_field, pin_memory
        rows = shard_rows(url, shard_count)
        self.rows = rows[shard]
        self.steps = steps_per_epoch(rows, batch_size)
        self.sizes = batch_sizes(self.rows, self.steps)
        self.epoch = 0
        self._reader = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def __len__(self) -> int:
        return self.steps

    def _stop(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader.join()
            self._reader = None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        self._stop()  # an epoch abandoned half way (an exception, an early stop) leaves its reader behind
        epoch, self.epoch = self.epoch, self.epoch + 1
        fields = ["image", "label"] + ([self.key_field] if self.key_field else [])
        self._reader = make_batch_reader(
            self.url,
            schema_fields=fields,
            cur_shard=self.shard,
            shard_count=self.shard_count,
            num_epochs=1,
            shuffle_row_groups=self.shuffle,
            seed=self.seed + epoch,
            workers_count=self.workers,
        )
        if not hasattr(self._reader, "_results_queue_reader"):
            raise RuntimeError("this Petastorm version's Reader has no _results_queue_reader: pin petastorm 0.12.1")
        self._reader._results_queue_reader = PixelRowGroups(self.image_size, self.key_field)
        pool = RowPool(self.image_size * self.image_size * 3, np.random.default_rng([self.seed, self.shard, epoch]) if self.shuffle else None)
        groups = iter(self._reader)
        exhausted = False
        try:
            for size in self.sizes:
                while not exhausted and len(pool) < max(size, self.buffer_rows if self.shuffle else size):
                    group = next(groups, None)
                    if group is None:
                        exhausted = True
                    else:
                        pool.add(group)
                if len(pool) < size:
                    raise RuntimeError(f"shard {self.shard} of {self.url} ended after fewer rows than its {self.rows}")
                images = torch.empty((size, self.image_size, self.image_size, 3), dtype=torch.uint8, pin_memory=self.pin_memory)
                labels, keys = pool.take(size, images.numpy().reshape(size, -1))
                yield (images, torch.from_numpy(labels), keys) if self.key_field else (images, torch.from_numpy(labels))
            if next(groups, None) is not None:
                raise RuntimeError(f"shard {self.shard} of {self.url} holds more rows than its {self.rows}: the cache changed")
        finally:
            self._stop()


def pixel_rows(images: pa.ChunkedArray, pixels: int, where: str) -> np.ndarray:
    """A binary column of images, `pixels` bytes each, as one (rows, pixels) uint8 view of its Arrow data buffer.

    A single chunk is used as it is (combine_chunks would copy); `where` names the data in the error.
    """
    column = images.chunk(0) if images.num_chunks == 1 else images.combine_chunks()
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32, count=len(column) + 1, offset=column.offset * 4)
    if column.null_count or np.any(np.diff(offsets) != pixels):
        raise ValueError(f"{where} holds images that are not {pixels} bytes each: rebuild the cache for this image_size")
    # Binary values lie back to back: one frombuffer over the data buffer reads them all.
    data = np.frombuffer(column.buffers()[2], dtype=np.uint8, count=len(column) * pixels, offset=int(offsets[0]))
    return data.reshape(len(column), pixels)


class PixelRowGroups(ArrowReaderWorkerResultsQueueReader):
    """Petastorm's results for one row group, with the image column as one (rows, pixels) uint8 view of the Arrow data buffer.

    Petastorm's own conversion makes a Python bytes object of every image; this makes none.
    """

    def __init__(self, image_size: int, key_field: str | None) -> None:
        super().__init__()
        self.pixels, self.key_field = image_size * image_size * 3, key_field

    def read_next(self, workers_pool: Any, schema: Any, ngram: Any) -> tuple:
        try:
            table = workers_pool.get_results()
        except EmptyResultError:
            raise StopIteration from None
        images = pixel_rows(table.column("image"), self.pixels, "the cached split")
        labels = table.column("label").to_numpy().astype(np.int64, copy=False)
        keys = table.column(self.key_field).to_pylist() if self.key_field else None
        return images, labels, keys


class RowPool:
    """Rows of several row groups waiting to be batched: drawn at random (with a generator) or in order."""

    def __init__(self, pixels: int, rng: np.random.Generator | None) -> None:
        self.pixels, self.rng = pixels, rng
        self.groups: dict[int, tuple[np.ndarray, np.ndarray, list | None]] = {}
        self.group_of = np.zeros(0, dtype=np.int64)
        self.row_of = np.zeros(0, dtype=np.int64)
        self.next_id = 0

    def __len__(self) -> int:
        return len(self.group_of)

    def add(self, group: tuple[np.ndarray, np.ndarray, list | None]) -> None:
        rows = len(group[1])
        self.groups[self.next_id] = group
        self.group_of = np.concatenate([self.group_of, np.full(rows, self.next_id)])
        self.row_of = np.concatenate([self.row_of, np.arange(rows)])
        self.next_id += 1

    def take(self, size: int, out: np.ndarray) -> tuple[np.ndarray, list | None]:
        """Copy `size` rows' pixels into `out`, grouped by row group; return their labels and keys."""
        if self.rng is None:
            picked = np.arange(size)
        else:
            picked = np.sort(self.rng.choice(len(self), size, replace=False))
        groups, rows = self.group_of[picked], self.row_of[picked]
        if self.rng is not None:
            # The batch's order is random too, but each group's rows stay together for the gather.
            order = np.lexsort((self.rng.random(size), groups))
            groups, rows = groups[order], rows[order]
        labels = np.empty(size, dtype=np.int64)
        keys: list | None = [] if any(g[2] is not None for g in self.groups.values()) else None
        start = 0
        for group_id in dict.fromkeys(groups.tolist()):
            chosen = rows[groups == group_id]
            images, group_labels, group_keys = self.groups[group_id]
            for offset, row in enumerate(chosen.tolist(), start):
                out[offset] = images[row]  # a row copy is one memcpy (np.take copies byte by byte here)
            labels[start : start + len(chosen)] = group_labels[chosen]
            if keys is not None:
                keys.extend(group_keys[i] for i in chosen)
            start += len(chosen)
        keep = np.ones(len(self), dtype=bool)
        keep[picked] = False
        self.group_of, self.row_of = self.group_of[keep], self.row_of[keep]
        for group_id in set(self.groups) - set(np.unique(self.group_of).tolist()):
            del self.groups[group_id]
        return labels, keys
