"""Training input: one Petastorm shard of a cached split, as uint8 image batches, exactly one pass per epoch.

Every worker takes the same number of steps per epoch (DDP needs that); each worker's shard is
split into that many batches, so every sample of a shard is seen exactly once per epoch. Each
epoch opens a fresh one-pass reader, so no reader is ever reset in the middle of iteration.

The batches are a function of the seed, the shard and the epoch alone: Petastorm's reader threads
deliver row groups in whatever order they finish, so each group is named by its first `position`
and held until its turn in the order Petastorm ventilated them (seeded: infra/compat.py:petastorm_ventilation_order).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Any, Self

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from petastorm import make_batch_reader
from petastorm.arrow_reader_worker import ArrowReaderWorkerResultsQueueReader
from petastorm.workers_pool import EmptyResultError
from pyarrow.filesystem import DaskFileSystem

from imagelake.infra.compat import petastorm_ventilation_order, replace_petastorm_results_reader
from imagelake.infra.errors import PermanentError
from imagelake.tasks.data.cache_files import (
    POSITION,
    encoded_rows,
    pixel_rows,
    row_group_sizes,
    row_groups,
    split_format,
    split_urls,
)

# Petastorm is pinned with pyarrow 14 on purpose (see pyproject.toml): its legacy-API notices are known and noise.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")


class ShardTooSmall(ValueError):
    """A worker's shard has fewer rows than the steps every worker must take."""


@lru_cache(maxsize=32)
def petastorm_filesystem(url: str) -> Any:
    """The filesystem to hand Petastorm for URL: None (Petastorm's own) for local files; for an object store, its fsspec
    filesystem in pyarrow's legacy wrapper. Petastorm 0.12 opens a dataset with ParquetDataset(validate_schema=...),
    which pyarrow 14 only accepts with a legacy (`pyarrow.filesystem`) filesystem."""
    fs, _ = fsspec.core.url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the wrapper's own deprecation notice
        return _LegacyFsspec(fs)


class _LegacyFsspec(DaskFileSystem):
    """pyarrow's generic fsspec wrapper (S3FSWrapper calls s3fs' now-async internals), with the three calls it
    leaves unimplemented, through fsspec's public API."""

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def isfile(self, path: str) -> bool:
        return self.fs.isfile(path)

    def walk(self, path: str):
        return self.fs.walk(path)


def shard_rows(url: str, shard_count: int) -> list[int]:
    """Rows each shard gets: Petastorm gives row group i to shard i % shard_count."""
    sizes = row_group_sizes(url)
    if len(sizes) < shard_count:
        raise ShardTooSmall(
            f"{url} has {len(sizes)} row groups, fewer than the {shard_count} workers: cache with more partitions"
        )
    return [sum(sizes[shard::shard_count]) for shard in range(shard_count)]


def steps_per_epoch(rows_per_shard: list[int], batch_size: int) -> int:
    """Steps every worker takes per epoch: enough batches of at most `batch_size` for the largest shard."""
    if not rows_per_shard or min(rows_per_shard) <= 0:
        raise ValueError(f"cannot train on an empty shard (rows per shard: {rows_per_shard})")
    return max(1, math.ceil(max(rows_per_shard) / batch_size))


def batch_sizes(rows: int, steps: int) -> list[int]:
    """Split a shard's rows into `steps` batches whose sizes differ by at most one."""
    if rows < steps:
        raise ShardTooSmall(
            f"a shard of {rows} rows cannot fill {steps} steps: use fewer workers, a smaller batch or more partitions"
        )
    base, extra = divmod(rows, steps)
    return [base + 1] * extra + [base] * (steps - extra)


class ShardBatches:
    """Batches of shard `shard` of `shard_count` of a Petastorm-readable Parquet folder.

    Iterating gives one epoch: `len(self)` batches (the same on every shard) holding every row of
    the shard once, as (uint8 NHWC images, int64 labels). With `shuffle`, row groups come in a
    seeded random order and rows are drawn at random from a buffer of `buffer_batches` batches.

    With `pin_memory` and a GPU, a thread assembles the batches in pinned memory and copies them to
    the current GPU on a stream of its own, `GPU_AHEAD` batches ahead of training: the batches
    arrive on the GPU, and nothing in a training step waits for the host.

    With `next_epoch_ahead` (the default on that path), once the thread has made an epoch's last batch it opens the
    next epoch's reader and makes its first batches, while training finishes the epoch and validates: the reader's
    start and the shuffle buffer's filling no longer stall the first steps of every epoch. Those batches are kept
    only for the epoch they were made for; an epoch set by hand (a resume) or dropped half way starts afresh.
    """

    GPU_AHEAD = 3
    # Loader processes' shared buffers page-locked for the GPU's copy engine (a batch goes to the GPU straight from
    # them); False copies each batch into pinned memory first, as before.
    PAGE_LOCK = True

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
        processes: int = 0,
        next_epoch_ahead: bool | None = None,
        sizes: list[int] | None = None,
        decode_device: str | None = None,
    ) -> None:
        if not isinstance(processes, int) or processes < 0:
            raise ValueError(
                f"loader_processes is {processes!r}: 0 (read in the training process) or the number of "
                "loader processes (1 or more)"
            )
        # A JPEG cache's images: decoded as their row groups arrive (in the reader's thread or process), or, with a
        # decode_device ("cpu" or "cuda"), a batch at a time by torchvision on that device (nvJPEG on a GPU).
        self.image_format = split_format(url)
        self.decode_device = decode_device if self.image_format == "jpeg" else None
        if self.decode_device is not None and processes:
            raise ValueError(
                f"jpeg_decode=device decodes a JPEG cache's images on the training device, from the training "
                f"process's reader threads, and loader_processes is {processes}: set loader_processes=0 (or leave it "
                "unset), or jpeg_decode=loader"
            )
        self.spec = dict(
            url=url,
            shard=shard,
            shard_count=shard_count,
            batch_size=batch_size,
            image_size=image_size,
            seed=seed,
            shuffle=shuffle,
            workers=workers,
            buffer_batches=buffer_batches,
            key_field=key_field,
        )
        self.processes = processes
        self._process: BatchProcesses | None = None
        self.url, self.shard, self.shard_count = url, shard, shard_count
        self.image_size, self.seed, self.shuffle, self.workers = image_size, seed, shuffle, workers
        self.buffer_rows = max(1, buffer_batches) * batch_size
        self.key_field, self.pin_memory = key_field, pin_memory
        if sizes is None:
            rows = shard_rows(url, shard_count)
            self.rows = rows[shard]
            self.steps = steps_per_epoch(rows, batch_size)
            self.sizes = batch_sizes(self.rows, self.steps)
        else:  # a loader process's share of each batch of its shard (see BatchProcesses)
            self.rows, self.steps, self.sizes = sum(sizes), len(sizes), list(sizes)
        self.epoch = 0
        self._reader = None
        self.on_gpu = pin_memory and torch.cuda.is_available()
        self.next_epoch_ahead = self.on_gpu if next_epoch_ahead is None else next_epoch_ahead
        self._stream: Any = None
        self._decode_on: torch.device | None = None  # decode_device, with the training thread's GPU
        self._current: Ahead | None = None  # the epoch being handed out, made ahead by a thread
        self._prepared: tuple[int, Ahead] | None = None  # the next epoch, begun before it was asked for
        self._prepared_lock = threading.Lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_ahead()
        self._stop()
        if self._process is not None:
            self._process.close()
            self._process = None

    def __len__(self) -> int:
        return self.steps

    def _stop(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader.join()
            self._reader = None

    def _stop_ahead(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            current.close()  # stops its thread, which stops the epoch's reader (and, finished, may prepare the next)
        with self._prepared_lock:
            prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared[1].close()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self.decode_device is not None and self._decode_on is None:  # the training thread's device
            cuda = self.decode_device == "cuda"
            self._decode_on = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if not (self.on_gpu or self.next_epoch_ahead):
            return self._lazy()
        previous, self._current = self._current, None
        if previous is not None and previous.received >= self.steps:
            previous.finish()  # its thread is past the last batch: the next epoch begins there, if it is to
        elif previous is not None:
            previous.close()  # an epoch abandoned half way leaves its thread behind
        epoch, self.epoch = self.epoch, self.epoch + 1
        with self._prepared_lock:
            prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] != epoch:
            prepared[1].close()
            prepared = None
        self._current = prepared[1] if prepared is not None else self._ahead(epoch)
        return self._current

    def _lazy(self) -> Iterator[tuple[Any, ...]]:
        """One epoch made as it is asked for; the epoch is counted at its first batch."""
        epoch, self.epoch = self.epoch, self.epoch + 1
        yield from self._source(epoch)

    def _source(self, epoch: int) -> Iterator[tuple[Any, ...]]:
        return self._from_process(epoch) if self.processes else self._batches(epoch)

    def _ahead(self, epoch: int) -> Ahead:
        """Epoch `epoch` made by a thread of its own, which then begins the next epoch if `next_epoch_ahead`."""

        def next_epoch() -> None:
            following = self._ahead(epoch + 1)
            with self._prepared_lock:
                self._prepared = (epoch + 1, following)

        then = next_epoch if self.next_epoch_ahead else None
        if not self.on_gpu:
            return Ahead(self._source(epoch), self.GPU_AHEAD, then=then)
        if self._stream is None:  # first asked for by the training thread: its device, which threads do not inherit
            self._stream = torch.cuda.Stream(torch.device("cuda", torch.cuda.current_device()))
        stream = self._stream
        device = stream.device

        def copy(batch: tuple[Any, ...]) -> tuple[tuple[Any, ...], torch.cuda.Event]:
            with torch.cuda.stream(stream):
                moved = tuple(
                    item.to(device, non_blocking=True) if isinstance(item, torch.Tensor) else item for item in batch
                )
                copied = torch.cuda.Event()
                copied.record(stream)
            return moved, copied

        def receive(item: tuple[tuple[Any, ...], torch.cuda.Event]) -> tuple[Any, ...]:
            moved, copied = item
            current = torch.cuda.current_stream(device)
            current.wait_event(copied)
            for tensor in moved:
                if isinstance(tensor, torch.Tensor):
                    tensor.record_stream(current)  # its memory is not reused before training is done with it
            return moved

        return Ahead(self._source(epoch), self.GPU_AHEAD, copy, receive, then)

    def _from_process(self, epoch: int) -> Iterator[tuple[Any, ...]]:
        """Epoch `epoch`'s batches, made by the loader processes in shared memory and copied out (into pinned memory
        with `pin_memory`). With one process, the same batches as `_batches` makes here."""
        if self._process is None:
            self._process = BatchProcesses(
                self.spec, self.processes, self.sizes, self.image_size, page_lock=self.on_gpu and self.PAGE_LOCK
            )
        process = self._process
        process.start(epoch)
        finished = False
        try:
            while True:
                item = process.next()
                if item is None:
                    finished = True
                    return
                slot, size, labels, keys = item
                if process.locked:
                    # The slot itself goes to the GPU (the thread that made this batch ahead copies it as soon as it
                    # is yielded); it goes back to the processes once that copy has ended, below.
                    images = process.slots[slot][:size]
                else:
                    images = self._new_images(size)
                    images.copy_(process.slots[slot][:size])
                    process.release(slot)
                try:
                    yield self._batch(images, labels, keys)
                finally:
                    if process.locked:
                        self._stream.synchronize()
                        process.release(slot)
        finally:
            if not finished:
                process.abandon()

    def _new_images(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, self.image_size, self.image_size, 3), dtype=torch.uint8, pin_memory=self.pin_memory)

    def _batch(self, images: torch.Tensor, labels: np.ndarray, keys: list | None) -> tuple[Any, ...]:
        """What an epoch yields: images, labels (pinned too: a copy from pageable memory would make the host wait for
        the GPU at every step) and, with a key field, the keys."""
        label_tensor = torch.from_numpy(labels).pin_memory() if self.pin_memory else torch.from_numpy(labels)
        return (images, label_tensor, keys) if self.key_field else (images, label_tensor)

    def _batches(self, epoch: int, into: Callable[[int], torch.Tensor] | None = None) -> Iterator[tuple[Any, ...]]:
        """Epoch `epoch`'s batches, made here; `into(size)` gives the tensor each batch's images are written to."""
        self._stop()  # an epoch abandoned half way (an exception, an early stop) leaves its reader behind
        fields = ["image", "label"] + ([self.key_field] if self.key_field else [])
        groups = row_groups(self.url)
        ordered = None not in (first for _, first in groups)
        # The seed changes every epoch, and so do the row groups' order and the rows drawn from the pool.
        seed = (self.seed * 100_003 + epoch) % 2**32 if self.shuffle else None  # numpy's RandomState takes 32 bits
        self._reader = make_batch_reader(
            split_urls(self.url),
            schema_fields=fields + ([POSITION] if ordered else []),
            cur_shard=self.shard,
            shard_count=self.shard_count,
            num_epochs=1,
            shuffle_row_groups=self.shuffle,
            seed=seed,
            workers_count=self.workers,
            filesystem=petastorm_filesystem(self.url),
        )
        replace_petastorm_results_reader(
            self._reader,
            PixelRowGroups(
                self.image_size,
                self.key_field,
                ordered,
                "encoded" if self.decode_device else self.image_format,
                decoders=self.workers,
            ),
        )
        pool = RowPool(
            self.image_size * self.image_size * 3,
            np.random.default_rng([self.seed, self.shard, epoch]) if self.shuffle else None,
        )
        arrivals = InOrder(
            iter(self._reader),
            [
                groups[i][1]
                for i in petastorm_ventilation_order(len(groups), self.shard, self.shard_count, seed, self.shuffle)
            ]
            if ordered
            else None,
        )
        exhausted = False
        try:
            for size in self.sizes:
                while not exhausted and len(pool) < max(size, self.buffer_rows if self.shuffle else size):
                    group = next(arrivals, None)
                    if group is None:
                        exhausted = True
                    else:
                        pool.add(group)
                if len(pool) < size:
                    raise RuntimeError(f"shard {self.shard} of {self.url} ended after fewer rows than its {self.rows}")
                if self.decode_device is not None:
                    encoded: list[Any] = [None] * size
                    labels, keys = pool.take(size, encoded)
                    images = decode_batch(encoded, self._decode_on or torch.device("cpu"), self.image_size, self.url)
                else:
                    images = into(size) if into is not None else self._new_images(size)
                    labels, keys = pool.take(size, images.numpy().reshape(size, -1))
                yield self._batch(images, labels, keys)
            if next(arrivals, None) is not None:
                raise RuntimeError(
                    f"shard {self.shard} of {self.url} holds more rows than its {self.rows}: the cache changed"
                )
        finally:
            self._stop()


def piece_sizes(sizes: list[int], rows: list[int]) -> list[list[int]]:
    """How many rows of each batch each of several loader processes makes: `sizes` are the batches' sizes, `rows` each
    process's rows (they add up to the same). Each process's share of every batch follows its share of the rows
    made so far, so that each ends its rows with the last batch."""
    total = sum(rows)
    if total != sum(sizes):
        raise ValueError(f"the loader processes hold {total} rows, the batches {sum(sizes)}")
    taken = [0] * len(rows)
    pieces: list[list[int]] = [[] for _ in rows]
    made = 0
    for size in sizes:
        made += size
        # what each is owed by the end of this batch
        due = [row * made / total - had for row, had in zip(rows, taken, strict=True)]
        share = [max(0, min(int(owed), row - had)) for owed, row, had in zip(due, rows, taken, strict=True)]
        while sum(share) < size:  # the most owed that has rows left
            j = max(
                (j for j in range(len(rows)) if share[j] < rows[j] - taken[j]), key=lambda j: (due[j] - share[j], -j)
            )
            share[j] += 1
        while sum(share) > size:  # the least owed that has a row in this batch
            j = min((j for j in range(len(rows)) if share[j] > 0), key=lambda j: (due[j] - share[j], j))
            share[j] -= 1
        for j, piece in enumerate(share):
            pieces[j].append(piece)
            taken[j] += piece
    return pieces


class SharedMemoryShort(PermanentError, RuntimeError):
    """The loader processes' batch buffers would not fit in the node's shared memory (/dev/shm)."""


SHARED_MEMORY = "/dev/shm"


def check_shared_memory(needed: int, batch_size: int, image_size: int, folder: str = SHARED_MEMORY) -> None:
    """Refuse to allocate NEEDED bytes of shared memory where FOLDER (the node's /dev/shm) has fewer free: past it the
    allocation does not fail but the first write to the missing pages kills the process (SIGBUS), and a run that fills
    /dev/shm starves every process on the node that shares it."""
    import shutil

    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # no such folder (not Linux): torch shares memory another way
    if needed > free:
        raise SharedMemoryShort(
            f"the training loader's processes need {needed / 2**30:.1f} GiB of shared memory for their batch buffers "
            f"(batch_size={batch_size} at image_size={image_size}), and {folder} has {free / 2**30:.1f} GiB free: "
            "lower batch_size, set loader_processes=0 (batches made in the training process), or give the nodes "
            "more shared memory (a container's --shm-size)"
        )


class BatchProcesses:
    """Processes of their own that make a ShardBatches' batches in shared memory, one epoch per `start`.

    Their reader threads and the batch assembly hold those processes' interpreter locks, not the training process's,
    whose own thread launches the GPU's work. Batches travel in `SLOTS` shared buffers that go round, batch k of an
    epoch in slot k % SLOTS: each process fills its piece of it once the slot is free and names it on its `ready`
    queue; the consumer copies the batch out and hands the slot back to every process (`release`).

    With several processes, process j reads Petastorm shard `shard + shard_count * j` of `shard_count * processes`
    (together exactly the shard's row groups), shuffles its own rows, and makes its share of every batch (piece_sizes):
    the batches keep their sizes and every row comes once an epoch. They are not the batches one process would make,
    but the same for the same seed, epoch and number of processes.
    """

    SLOTS = ShardBatches.GPU_AHEAD + 2
    END = "end"

    def __init__(
        self, spec: dict[str, Any], processes: int, sizes: list[int], image_size: int, page_lock: bool = False
    ) -> None:
        import torch.multiprocessing as mp

        # spawn, not fork: the training process has threads (Ray's, the reader's), and a fork copies their locks.
        context = mp.get_context("spawn")
        self.where = spec["url"]
        group_rows = row_group_sizes(spec["url"])
        count = max(
            1, min(processes, len(range(spec["shard"], len(group_rows), spec["shard_count"])))
        )  # a row group each at least
        if count == 1:
            specs = [spec]
        else:
            shards = [spec["shard"] + spec["shard_count"] * j for j in range(count)]
            pieces = piece_sizes(sizes, [sum(group_rows[shard :: spec["shard_count"] * count]) for shard in shards])
            specs = [
                {**spec, "shard": shard, "shard_count": spec["shard_count"] * count, "sizes": piece}
                for shard, piece in zip(shards, pieces, strict=True)
            ]
        check_shared_memory(self.SLOTS * max(sizes) * image_size * image_size * 3, max(sizes), image_size)
        self.slots = [
            torch.empty((max(sizes), image_size, image_size, 3), dtype=torch.uint8).share_memory_()
            for _ in range(self.SLOTS)
        ]
        # Page-locked, a slot is copied to the GPU as it is (asynchronously, at the copy engine's speed): the training
        # process no longer copies every batch into pinned memory first, the copy that held several processes back.
        self.locked = page_lock and lock_pages(self.slots)
        self.halt = context.Event()
        self.commands, self.free, self.ready = ([context.Queue() for _ in specs] for _ in range(3))
        for free in self.free:
            for slot in range(self.SLOTS):
                free.put(slot)
        self.open = False
        self.processes = []
        offsets = [0] * len(sizes)
        for j, piece_spec in enumerate(specs):
            self.processes.append(
                context.Process(
                    target=_make_batches,
                    args=(
                        piece_spec,
                        list(offsets),
                        self.slots,
                        self.commands[j],
                        self.free[j],
                        self.ready[j],
                        self.halt,
                    ),
                    name=f"imagelake-loader-{j}",
                    daemon=True,
                )
            )
            offsets = [offset + piece for offset, piece in zip(offsets, piece_spec.get("sizes", sizes), strict=True)]
        for process in self.processes:
            process.start()

    @property
    def process(self) -> Any:
        """The first loader process."""
        return self.processes[0]

    def start(self, epoch: int) -> None:
        self.halt.clear()
        for commands in self.commands:
            commands.put(epoch)
        self.open = True  # until the epoch's END or error arrives
        self.batch = 0

    def _next(self, j: int) -> tuple[int, int, np.ndarray, list | None] | str | BaseException:
        while True:
            try:
                return self.ready[j].get(timeout=1.0)
            except queue.Empty:
                if not self.processes[j].is_alive():
                    raise RuntimeError(
                        f"the loader process reading {self.where} ended (exit code "
                        f"{self.processes[j].exitcode}) in the middle of an epoch"
                    ) from None

    def next(self) -> tuple[int, int, np.ndarray, list | None] | None:
        """The next batch's (slot, rows, labels, keys), or None at the epoch's end; an error in a process is raised here
        (after the other processes' pieces of that batch have come, so that their slots go round in step)."""
        items = [self._next(j) for j in range(len(self.processes))]
        error = next((item for item in items if isinstance(item, BaseException)), None)
        if error is not None or any(isinstance(item, str) for item in items):
            self.open = False
            self.halt.set()
            for j, item in enumerate(items):  # the others end their epoch too, their slots handed back
                if isinstance(item, tuple):
                    self.free[j].put(item[0])
                    self._drain(j)
            if error is not None:
                raise error
            return None
        slot = self.batch % self.SLOTS
        if any(item[0] != slot for item in items):
            raise RuntimeError(
                f"the loader processes reading {self.where} filled slots {[item[0] for item in items]} for "
                f"batch {self.batch}: they are out of step"
            )
        self.batch += 1
        labels = np.concatenate([item[2] for item in items])
        keys = None if items[0][3] is None else [key for item in items for key in item[3]]
        return slot, len(labels), labels, keys

    def _drain(self, j: int) -> None:
        """Process j's items until its epoch's end (or error), its slots handed back to it."""
        while True:
            item = self._next(j)
            if isinstance(item, BaseException) or item == self.END:
                return
            self.free[j].put(item[0])

    def release(self, slot: int) -> None:
        for free in self.free:
            free.put(slot)

    def abandon(self) -> None:
        """Stop the epoch in the middle: the processes end it after the piece they are making; the slots come back."""
        if not self.open:
            return
        self.halt.set()
        self.open = False
        try:
            for j in range(len(self.processes)):
                self._drain(j)
        except Exception:  # a process failed or died while stopping: close() ends them
            self.close()

    def close(self) -> None:
        for process, commands in zip(self.processes, self.commands, strict=True):
            if process.is_alive():
                commands.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        for channel in (*self.commands, *self.free, *self.ready):
            channel.close()
            channel.join_thread()
        if self.locked:
            unlock_pages(self.slots)
            self.locked = False


def lock_pages(tensors: list[torch.Tensor]) -> bool:
    """Page-lock the memory of `tensors` (CPU, shared) for the current GPU's copy engine, through CUDA's
    cudaHostRegister (torch.cuda.cudart()): copies from them to the GPU then run asynchronously, as from pinned
    memory. False, with none left locked, where CUDA refuses one (the caller copies through pinned memory instead)."""
    cudart = torch.cuda.cudart()
    locked: list[torch.Tensor] = []
    for tensor in tensors:
        portable = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
        if int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), portable)) != 0:
            unlock_pages(locked)
            return False
        locked.append(tensor)
    return True


def unlock_pages(tensors: list[torch.Tensor]) -> None:
    cudart = torch.cuda.cudart()
    for tensor in tensors:
        cudart.cudaHostUnregister(tensor.data_ptr())


def _make_batches(
    spec: dict[str, Any], offsets: list[int], slots: list[torch.Tensor], commands: Any, free: Any, ready: Any, halt: Any
) -> None:
    """A loader process: for each epoch named on `commands` (None ends it), its piece of each batch into a free slot
    (at the batch's offset `offsets[k]`), then END; an error (the split gone or changed) is sent in place of the rest of
    the epoch."""
    import multiprocessing
    import pickle

    # A training process killed outright (a lost Ray worker, the OOM killer) runs no clean-up: this process ends as
    # soon as it is gone, wherever it is waiting, instead of living on with its memory and reader threads.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_end_with, args=(parent.sentinel,), name="imagelake-loader-parent", daemon=True).start()
    batches: ShardBatches | None = None
    available: set[int] = set()  # slots the consumer has handed back, not yet filled

    def take(slot: int) -> None:
        while slot not in available:
            available.add(free.get())
        available.remove(slot)

    # `into` reads the epoch's `held` and `made_pieces`, which the loop below sets afresh for each epoch.
    def into(size: int) -> torch.Tensor:
        slot = made_pieces % len(slots)  # batch k goes in slot k % SLOTS, in every process
        take(slot)
        held.append(slot)
        offset = offsets[made_pieces]
        return slots[slot][offset : offset + size]

    while (epoch := commands.get()) is not None:
        held: list[int] = []
        made_pieces = 0
        made = None
        try:
            batches = batches or ShardBatches(**spec)
            made = batches._batches(epoch, into)
            for batch in made:
                made_pieces += 1
                if halt.is_set():
                    break
                labels = batch[1].numpy()
                ready.put((held.pop(), len(labels), labels, batch[2] if len(batch) > 2 else None))
            ready.put(BatchProcesses.END)
        except Exception as error:
            try:
                pickle.dumps(error)
            except Exception:
                error = RuntimeError(f"{type(error).__name__}: {error}")
            ready.put(error)
        finally:
            if made is not None:
                made.close()
            available.update(held)  # a piece made but not sent


def _end_with(sentinel: int) -> None:
    """End this process once the process that `sentinel` stands for has ended."""
    from multiprocessing.connection import wait

    wait([sentinel])
    os._exit(1)


class Ahead:
    """`items`, made up to `depth` ahead by a thread, started at once, that also runs `prepare` on each; `receive` runs
    on each as it is handed over. An error in the thread is raised here, in order. `close()` stops the thread, which
    closes `items`. `then`, if given, runs in the thread once `items` has ended of itself, before its end is handed
    over.
    """

    def __init__(
        self,
        items: Iterator[Any],
        depth: int,
        prepare: Callable[[Any], Any] = lambda item: item,
        receive: Callable[[Any], Any] = lambda item: item,
        then: Callable[[], None] | None = None,
    ) -> None:
        self.ready: queue.Queue = queue.Queue(depth)
        self.halt = threading.Event()
        self.receive = receive
        self.received = 0  # items handed out
        self.ended = False
        # The thread holds the queue and the event, not this object: dropping it unread still stops the thread.
        self.thread = threading.Thread(
            target=_produce, args=(items, prepare, then, self.ready, self.halt), name="imagelake-batches", daemon=True
        )
        self.thread.start()

    def __iter__(self) -> Ahead:
        return self

    def __next__(self) -> Any:
        if self.ended:
            raise StopIteration
        item = self.ready.get()
        if item is _END:
            self.ended = True
            self.thread.join()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        self.received += 1
        return self.receive(item)

    def finish(self) -> None:
        """Wait for the thread, whose items have all been handed out, to end; an error it met after them is raised."""
        self.thread.join()
        self.ended = True
        while not self.ready.empty():
            item = self.ready.get_nowait()
            if isinstance(item, BaseException):
                raise item

    def close(self) -> None:
        self.halt.set()
        self.thread.join()
        self.ended = True

    def __del__(self) -> None:
        self.halt.set()


_END = object()


def _produce(
    items: Iterator[Any],
    prepare: Callable[[Any], Any],
    then: Callable[[], None] | None,
    ready: queue.Queue,
    halt: threading.Event,
) -> None:
    def hand_over(item: object) -> bool:
        while not halt.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in items:
            if not hand_over(prepare(item)):
                return
        if then is not None and not halt.is_set():
            then()
        hand_over(_END)
    except BaseException as error:  # raised by the consumer, after the items before it
        hand_over(error)
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


class InOrder:
    """Row groups as the reader's threads finish them, given back in the planned order (by first position).

    Early arrivals wait in a buffer: about one per reader thread while row groups take similar
    times to read, more while the awaited one is much slower than the rest. Without a plan (a
    cache without positions) groups pass in arrival order.
    """

    def __init__(self, arrivals: Iterator[tuple], plan: list[int | None] | None) -> None:
        self.arrivals, self.plan, self.waiting, self.next = arrivals, plan, {}, 0

    def __iter__(self) -> InOrder:
        return self

    def __next__(self) -> tuple:
        if self.plan is None:
            return next(self.arrivals)[:3]
        if self.next >= len(self.plan):
            extra = next(self.arrivals, None)
            if extra is not None:
                return extra[:3]  # more groups than planned: the caller reports the changed cache
            raise StopIteration
        wanted = self.plan[self.next]
        while wanted not in self.waiting:
            group = next(self.arrivals, None)
            if group is None:
                raise RuntimeError(
                    f"the reader ended before row group at position {wanted}: the cache changed while training read it"
                )
            self.waiting[group[3]] = group
        self.next += 1
        return self.waiting.pop(wanted)[:3]


class PixelRowGroups(ArrowReaderWorkerResultsQueueReader):
    """Petastorm's results for one row group, with the image column as one (rows, pixels) uint8 view of the Arrow data
    buffer (of a JPEG cache: its images decoded into one such array).

    Petastorm's own conversion makes a Python bytes object of every image; this makes none.
    """

    def __init__(
        self,
        image_size: int,
        key_field: str | None,
        positions: bool = False,
        image_format: str = "raw",
        decoders: int = 1,
    ) -> None:
        """IMAGE_FORMAT: the cache's (raw, jpeg: decoded here, by DECODERS threads), or "encoded": a JPEG cache's
        files handed on as they are, each a view of the buffer (decoded a batch at a time by decode_batch)."""
        super().__init__()
        self.pixels, self.key_field, self.positions = image_size * image_size * 3, key_field, positions
        self.image_format, self.decoders = image_format, decoders

    def read_next(self, workers_pool: Any, schema: Any, ngram: Any) -> tuple:
        try:
            table = workers_pool.get_results()
        except EmptyResultError:
            raise StopIteration from None
        if self.image_format == "encoded":
            images: Any = encoded_rows(table.column("image"))
        else:
            images = pixel_rows(
                table.column("image"), self.pixels, "the cached split", self.image_format, self.decoders
            )
        labels = table.column("label").to_numpy().astype(np.int64, copy=False)
        keys = table.column(self.key_field).to_pylist() if self.key_field else None
        first = table.column(POSITION)[0].as_py() if self.positions and len(table) else None
        return images, labels, keys, first


def decode_batch(encoded: list[np.ndarray], device: torch.device, image_size: int, url: str) -> torch.Tensor:
    """A batch of JPEG files as uint8 NHWC images on DEVICE, decoded by torchvision there (nvJPEG on a GPU, in one
    call). The files are gathered into one tensor first: torchvision reads each from CPU memory."""
    from torchvision.io import decode_jpeg

    flat = torch.from_numpy(np.concatenate(encoded))
    files = list(torch.tensor_split(flat, np.cumsum([len(file) for file in encoded])[:-1].tolist()))
    try:
        decoded = decode_jpeg(files, device=device)
    except RuntimeError as exc:
        raise ValueError(f"{url} holds an image that is not a JPEG ({exc}): rebuild the cache") from None
    for image in decoded:
        if image.shape != (3, image_size, image_size):
            raise ValueError(
                f"{url} holds an image of {tuple(image.shape)} where {(3, image_size, image_size)} was cached: "
                "rebuild the cache"
            )
    return torch.stack(decoded).permute(0, 2, 3, 1).contiguous()


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
