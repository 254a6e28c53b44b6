"""Training input: one Petastorm shard of a cached split, as fixed-size uint8 image batches."""

from __future__ import annotations

import math
import warnings
from typing import Iterator

import numpy as np
import torch
from petastorm import make_batch_reader

# Petastorm is pinned with pyarrow 14 on purpose (see pyproject.toml): its legacy-API notices are known and noise.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")


def steps_per_epoch(rows: int, batch_size: int, world_size: int) -> int:
    """Batches each worker takes per epoch so that all workers together cover the split once."""
    if rows <= 0:
        raise ValueError(f"cannot train on an empty split (rows={rows})")
    return max(1, math.ceil(rows / (batch_size * world_size)))


class ShardBatches:
    """An endless Petastorm batch reader over shard `shard` of `shard_count`, yielding `steps` batches per iteration.

    The reader stays open across epochs: Petastorm cannot reset a reader in the middle of iteration,
    and Lightning asks for a new iterator every epoch.
    """

    def __init__(
        self, url: str, *, shard: int, shard_count: int, batch_size: int, steps: int, image_size: int, seed: int, shuffle: bool, workers: int = 2
    ) -> None:
        self.url, self.shard, self.shard_count = url, shard, shard_count
        self.batch_size, self.steps, self.image_size = batch_size, steps, image_size
        self.seed, self.shuffle, self.workers = seed, shuffle, workers
        self._reader = None
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __enter__(self) -> "ShardBatches":
        self._reader = make_batch_reader(
            self.url,
            schema_fields=["image", "label"],
            cur_shard=self.shard,
            shard_count=self.shard_count,
            num_epochs=None,
            shuffle_row_groups=self.shuffle,
            seed=self.seed,
            workers_count=self.workers,
        )
        self._batches = self._generate()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader.join()
            self._reader = None

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._batches is None:
            raise RuntimeError("ShardBatches must be used inside a `with` block")
        for _ in range(self.steps):
            yield next(self._batches)

    def _generate(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rng = np.random.default_rng(self.seed + self.shard)
        images: list[bytes] = []
        labels: list[np.ndarray] = []
        for group in self._reader:
            order = rng.permutation(len(group.label)) if self.shuffle else np.arange(len(group.label))
            images.extend(group.image[order])
            labels.append(np.asarray(group.label, dtype=np.int64)[order])
            label_pool = np.concatenate(labels)
            while len(images) >= self.batch_size:
                yield self._to_tensors(images[: self.batch_size], label_pool[: self.batch_size])
                images, label_pool = images[self.batch_size :], label_pool[self.batch_size :]
            labels = [label_pool]

    def _to_tensors(self, images: list[bytes], labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.image_size
        # One join and one frombuffer per batch instead of one array per image.
        pixels = torch.frombuffer(bytearray(b"".join(images)), dtype=torch.uint8).view(len(images), size, size, 3)
        return pixels, torch.from_numpy(labels.copy())
