"""The training loader: rows shuffled when cached, batches a function of seed, shard and epoch, whatever the reader
threads do."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from petastorm import make_batch_reader

from imagelake.infra.compat import petastorm_ventilation_order as ventilation_order
from imagelake.tasks.data.cache_files import POSITION, row_groups
from imagelake.tasks.stages.cache import write_split
from imagelake.tasks.worker.loader import ShardBatches, piece_sizes, shard_rows

SIZE = 4  # 4x4 RGB: 48 bytes an image


def write_label_runs(spark, out: Path, rows: int, partitions: int, seed: int = 42) -> str:
    """A split whose source order is one long run per label (as a table written folder by folder is)."""
    data = [(bytes([i % 251]) * (SIZE * SIZE * 3), i * 10 // rows, f"{i:064x}") for i in range(rows)]
    frame = spark.createDataFrame(data, "image binary, label long, sha256 string").coalesce(1)
    write_split(frame, str(out), partitions, seed, 0)
    return f"file://{out}"


def label_changes(path: Path) -> list[float]:
    """For each cached file: the share of neighbouring rows whose labels differ."""
    shares = []
    for file in sorted(path.glob("*.parquet")):
        labels = pq.read_table(file, columns=["label"]).column("label").to_numpy()
        shares.append(float(np.count_nonzero(np.diff(labels))) / max(1, len(labels) - 1))
    return shares


def content(batches) -> list[tuple[bytes, list[int], list[str]]]:
    """An epoch's batches as plain values: pixels, labels, keys."""
    return [(images.numpy().tobytes(), labels.tolist(), keys) for images, labels, keys in batches]


def epochs_around_a_dropped_one(loader: ShardBatches) -> tuple[list, list]:
    """Epoch 0 whole, epoch 1 left after two batches, epoch 2 whole: the first and the last."""
    first = content(loader)
    dropped = iter(loader)
    next(dropped), next(dropped)
    dropped.close()
    return first, content(loader)


def test_cached_rows_are_shuffled_not_in_runs_of_one_label(spark, tmp_path: Path) -> None:
    write_label_runs(spark, tmp_path / "split", rows=400, partitions=2)
    # In runs of 40 a file would change label about 1 time in 40; shuffled, about 9 times in 10.
    assert min(label_changes(tmp_path / "split")) > 0.7
    positions = pq.read_table(tmp_path / "split", columns=[POSITION]).column(POSITION).to_pylist()
    assert len(set(positions)) == 400


@pytest.mark.parametrize("shuffle, seed", [(False, None), (True, 7), (True, 12345)])
def test_ventilation_order_is_petastorms(spark, tmp_path: Path, shuffle: bool, seed: int | None) -> None:
    """Pins the private order the loader replays: one reader thread hands row groups over in ventilation order."""
    url = write_label_runs(spark, tmp_path / "split", rows=90, partitions=9)
    groups = row_groups(url)
    assert len(groups) == 9 and all(first is not None for _, first in groups)
    for shard in range(2):
        with make_batch_reader(
            url,
            schema_fields=[POSITION],
            cur_shard=shard,
            shard_count=2,
            num_epochs=1,
            shuffle_row_groups=shuffle,
            seed=seed,
            workers_count=1,
        ) as reader:
            delivered = [int(batch.position[0]) for batch in reader]
        assert delivered == [groups[i][1] for i in ventilation_order(len(groups), shard, 2, seed, shuffle)]


def epoch_batches(url: str, seed: int, epoch: int, workers: int) -> list[tuple[list[int], list[str]]]:
    loader = ShardBatches(
        url,
        shard=0,
        shard_count=2,
        batch_size=8,
        image_size=SIZE,
        seed=seed,
        shuffle=True,
        workers=workers,
        key_field="sha256",
    )
    loader.epoch = epoch
    with loader:
        return [(labels.tolist(), keys) for _, labels, keys in loader]


def test_batches_depend_on_seed_and_epoch_only(spark, tmp_path: Path) -> None:
    url = write_label_runs(spark, tmp_path / "split", rows=240, partitions=12)
    first = epoch_batches(url, seed=3, epoch=0, workers=4)
    # Four reader threads finish row groups in a different order each time; the batches never change.
    for _ in range(4):
        assert epoch_batches(url, seed=3, epoch=0, workers=4) == first
    assert epoch_batches(url, seed=3, epoch=0, workers=1) == first
    assert epoch_batches(url, seed=3, epoch=1, workers=4) != first, "each epoch shuffles anew"
    assert epoch_batches(url, seed=4, epoch=0, workers=4) != first, "another seed, another order"
    labels = [label for batch, _ in first for label in batch]
    # A batch of 8 from shuffled rows holds several labels, never a run of one.
    assert min(len(set(batch)) for batch, _ in first) >= 3 and len(labels) == shard_rows(url, 2)[0]


def test_batches_made_ahead_by_a_thread_are_the_same_and_the_thread_stops_with_them(spark, tmp_path: Path) -> None:
    """The GPU path's prefetch thread (ahead), on the real reader: the same batches in the same order; an epoch
    dropped half way leaves no thread behind, neither its own nor the reader's; an error arrives after the batches
    made before it."""
    import threading

    from imagelake.tasks.worker.loader import Ahead as ahead

    url = write_label_runs(spark, tmp_path / "split", rows=200, partitions=4)

    def loader() -> ShardBatches:
        return ShardBatches(
            url,
            shard=0,
            shard_count=1,
            batch_size=16,
            image_size=SIZE,
            seed=3,
            shuffle=True,
            workers=2,
            key_field="sha256",
        )

    with loader() as plain, loader() as threaded:
        assert content(ahead(iter(threaded), 2)) == content(plain) != []

    before = set(threading.enumerate())
    with loader() as dropped:
        batches = ahead(iter(dropped), 2)
        next(batches)
        assert len(set(threading.enumerate()) - before) > 1  # the prefetch thread and the reader's
        batches.close()
        left = [thread.name for thread in set(threading.enumerate()) - before if thread.is_alive()]
        assert left == []

    def failing():
        yield 1
        yield 2
        raise ValueError("row group unreadable")

    got, makers = [], set()
    with pytest.raises(ValueError, match="unreadable"):
        for item in ahead(
            failing(), 1, prepare=lambda item: (item * 10, threading.current_thread().name), receive=lambda item: item
        ):
            got.append(item[0])
            makers.add(item[1])
    assert got == [10, 20] and makers == {"imagelake-batches"}


def test_the_next_epoch_made_ahead_is_the_epoch_asked_for_and_stops_with_the_loader(spark, tmp_path: Path) -> None:
    """next_epoch_ahead (the GPU path's default): once an epoch's last batch is made, its thread begins the next epoch.
    Taken as Lightning takes them (len(loader) batches, never the end), the batches are those made one epoch at a
    time; an epoch set by hand (a resume) drops the one made ahead; no thread outlives the loader."""
    import itertools
    import threading

    url = write_label_runs(spark, tmp_path / "split", rows=200, partitions=4)

    def loader(next_epoch_ahead: bool) -> ShardBatches:
        return ShardBatches(
            url,
            shard=0,
            shard_count=1,
            batch_size=16,
            image_size=SIZE,
            seed=3,
            shuffle=True,
            workers=2,
            key_field="sha256",
            next_epoch_ahead=next_epoch_ahead,
        )

    def epoch(batches: ShardBatches) -> list[tuple[bytes, list[int], list[str]]]:
        return [
            (images.numpy().tobytes(), labels.tolist(), keys)
            for images, labels, keys in itertools.islice(iter(batches), len(batches))
        ]

    with loader(False) as plain:
        expected = [epoch(plain) for _ in range(5)]
    assert len({str(batches) for batches in expected}) == 5
    before = set(threading.enumerate())
    with loader(True) as chained:
        assert epoch(chained) == expected[0]
        chained._current.thread.join()  # the epoch's thread is done: it has begun the next one
        assert chained._prepared is not None and chained._prepared[0] == 1
        assert epoch(chained) == expected[1]
        chained.epoch = 4  # as a resume sets it: epoch 2, made ahead, is dropped
        assert epoch(chained) == expected[4]
        assert epoch(chained) == epoch(plain)  # epoch 5, both ways
    assert [thread.name for thread in set(threading.enumerate()) - before if thread.is_alive()] == []


@pytest.mark.slow  # starts a process
def test_a_loader_process_makes_the_same_batches_and_ends_with_the_loader(spark, tmp_path: Path) -> None:
    """loader_processes=1: the reader's threads and the batch assembly run in a process of their own, and the batches
    are the ones the training process would make, epoch after epoch, also after an epoch dropped half way. An error
    there (a cached file garbled) arrives in the training process with its type, and the process ends with the
    loader."""
    import multiprocessing

    url = write_label_runs(spark, tmp_path / "split", rows=200, partitions=4)

    def loader(processes: int) -> ShardBatches:
        return ShardBatches(
            url,
            shard=0,
            shard_count=1,
            batch_size=16,
            image_size=SIZE,
            seed=3,
            shuffle=True,
            workers=2,
            key_field="sha256",
            processes=processes,
            next_epoch_ahead=processes
            > 0,  # the process begins each epoch as soon as it has made the last one's batches
        )

    with loader(0) as here:
        expected = [content(here) for _ in range(3)]
    assert expected[0] != expected[1] != [] and len(expected[0]) == len(here)
    with loader(1) as there:
        assert epochs_around_a_dropped_one(there) == (expected[0], expected[2])
        process = there._process.process
        assert process.is_alive()
        # Swapped in whole: the process may be reading the file at this moment, and must never see it half written.
        (tmp_path / "garbled").write_bytes(b"not a Parquet file")
        os.replace(tmp_path / "garbled", sorted((tmp_path / "split").glob("*.parquet"))[0])
        with pytest.raises(pa.ArrowInvalid, match="magic bytes"):
            content(there)
    assert not process.is_alive() and process not in multiprocessing.active_children()
    with pytest.raises(ValueError, match="loader_processes"):
        loader(-1)


@pytest.mark.slow  # starts processes
def test_several_loader_processes_share_each_batch_every_row_once_the_same_for_the_same_seed(
    spark, tmp_path: Path
) -> None:
    """loader_processes=2: each process reads half the shard's row groups and makes its share of every batch; the
    batches keep the sizes one process gives, every row comes once an epoch, epochs differ, a run with the same seed
    gets the same batches (also after an epoch dropped half way), and the processes end with the loader."""
    import multiprocessing

    url = write_label_runs(spark, tmp_path / "split", rows=200, partitions=4)

    def loader(processes: int) -> ShardBatches:
        return ShardBatches(
            url,
            shard=0,
            shard_count=1,
            batch_size=16,
            image_size=SIZE,
            seed=3,
            shuffle=True,
            workers=2,
            key_field="sha256",
            processes=processes,
        )

    with loader(0) as here:
        one = content(here)
    with loader(2) as two:
        expected = [content(two) for _ in range(3)]
        assert len(two._process.processes) == 2
    for epoch in expected:
        assert [len(labels) for _, labels, _ in epoch] == [len(labels) for _, labels, _ in one]
        assert sorted(key for _, _, keys in epoch for key in keys) == sorted(key for _, _, keys in one for key in keys)
        # Each row's pixels and label still belong to its key (rows are made from the key's index).
        for images, labels, keys in epoch:
            pixels = np.frombuffer(images, dtype=np.uint8).reshape(len(keys), -1)
            assert [(int(row[0]), label) for row, label in zip(pixels, labels, strict=True)] == [
                (int(key, 16) % 251, int(key, 16) * 10 // 200) for key in keys
            ]
    assert expected[0] != expected[1] != expected[2]
    with loader(2) as again:
        assert epochs_around_a_dropped_one(again) == (expected[0], expected[2])
        processes = again._process.processes
        assert all(process.is_alive() for process in processes)
    assert not any(process.is_alive() or process in multiprocessing.active_children() for process in processes)


@pytest.mark.parametrize(
    "sizes, rows",
    [([16] * 12 + [8], [104, 96]), ([5] * 7 + [4], [13, 1, 25]), ([3, 3, 2], [0, 8]), ([256] * 4, [1000, 24])],
)
def test_each_loader_process_makes_its_share_of_every_batch_and_all_its_rows(sizes: list[int], rows: list[int]) -> None:
    pieces = piece_sizes(sizes, rows)
    assert [sum(column) for column in zip(*pieces, strict=True)] == sizes
    assert [sum(piece) for piece in pieces] == rows
    assert all(piece >= 0 for process in pieces for piece in process)
    # Shares follow the rows: no process is more than a batch's share ahead or behind its rows' pace.
    for j, process in enumerate(pieces):
        made = np.cumsum(process)
        due = np.cumsum(sizes) * rows[j] / sum(rows)
        assert np.all(np.abs(made - due) <= len(rows))


@pytest.mark.slow  # starts processes
def test_a_loader_process_ends_when_its_training_process_is_killed(tmp_path: Path) -> None:
    """A training process killed outright (Ray losing a worker, the kernel's OOM killer) runs no clean-up: its loader
    process must still end, not live on holding its memory and its reader threads."""
    import signal
    import subprocess
    import sys
    import time

    from tests.test_loader_gpu import write_split

    url = write_split(tmp_path / "split", rows=200, files=2)
    script = (
        "import sys, time\n"
        "from imagelake.tasks.worker.loader import ShardBatches\n"
        "if __name__ == '__main__':\n"
        f"    loader = ShardBatches({url!r}, shard=0, shard_count=1, batch_size=16, image_size=16, seed=1, "
        "shuffle=True, processes=1)\n"
        "    batches = iter(loader)\n"
        "    next(batches)\n"  # half way through an epoch
        "    print(loader._process.process.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    (tmp_path / "train.py").write_text(script)
    training = subprocess.Popen([sys.executable, str(tmp_path / "train.py")], stdout=subprocess.PIPE, text=True)
    try:
        loader_pid = int(training.stdout.readline())
        training.send_signal(signal.SIGKILL)
        training.wait()
        for _ in range(600):  # a liveness bound, not a timing: it ends within a second or two
            stat = Path(f"/proc/{loader_pid}/stat")
            if not stat.exists() or stat.read_text().split(") ")[1].startswith("Z"):
                break
            time.sleep(0.1)
        else:
            os.kill(loader_pid, signal.SIGKILL)
            pytest.fail(f"the loader process {loader_pid} outlived its killed training process by 60 s")
    finally:
        training.kill()


def test_loader_processes_check_shared_memory_before_they_allocate_their_buffers(spark, tmp_path: Path) -> None:
    """Batch buffers past the node's free /dev/shm are refused before any is allocated (past it, the first write to a
    missing page kills the process with SIGBUS), naming the settings and what to do; within it they are made."""
    import shutil

    from imagelake.tasks.worker.loader import SHARED_MEMORY, BatchProcesses, SharedMemoryShort

    url = write_label_runs(spark, tmp_path / "split", rows=40, partitions=2)
    spec = {"url": url, "shard": 0, "shard_count": 1, "seed": 3, "shuffle": True, "workers": 1, "key_field": "sha256"}
    free = shutil.disk_usage(SHARED_MEMORY).free
    side = math.isqrt(free // (BatchProcesses.SLOTS * 3 * 40)) + 1  # 40-image batches of SIDE px overflow it
    with pytest.raises(SharedMemoryShort, match=rf"batch_size=40 at image_size={side}.*lower batch_size"):
        BatchProcesses(spec, 1, [40], side)
    assert shutil.disk_usage(SHARED_MEMORY).free >= free - 2**20, "nothing was allocated"
