"""The loader on a GPU: batches from loader processes go to the GPU straight from their page-locked shared buffers.

Skipped without a CUDA GPU (CI has none). It imports no Spark or servers, so that it runs on a bare GPU machine:
`python3 -m pytest --noconftest -p no:cacheprovider tests/test_loader_gpu.py`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from imagelake.tasks.worker.loader import ShardBatches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SIZE = 16  # 16x16 RGB: 768 bytes an image


def write_split(out: Path, rows: int, files: int) -> str:
    """A split in the cache's layout (image, label, sha256, position), each row's pixels and label made from its
    index, in row groups of 10 rows."""
    out.mkdir()
    for file, indices in enumerate(np.array_split(np.arange(rows), files)):
        images = [bytes([(i * 7 + j) % 256 for j in range(SIZE * SIZE * 3)]) for i in indices.tolist()]
        table = pa.table(
            {
                "image": pa.array(images, pa.binary()),
                "label": pa.array(indices % 10, pa.int64()),
                "sha256": pa.array([f"{i:064x}" for i in indices.tolist()]),
                "position": pa.array((file << 33) + np.arange(len(indices), dtype=np.int64)),
            }
        )
        pq.write_table(table, out / f"part-{file:05d}.parquet", row_group_size=10)
    return f"file://{out}"


def gpu_epochs(url: str, processes: int, page_lock: bool, epochs: int = 3) -> tuple[list, bool]:
    """`epochs` epochs of batches on the GPU as plain values (the second left after two batches and not counted), and
    whether the loader processes' buffers were page-locked."""
    ShardBatches.PAGE_LOCK = page_lock
    try:
        with ShardBatches(
            url,
            shard=0,
            shard_count=1,
            batch_size=32,
            image_size=SIZE,
            seed=5,
            shuffle=True,
            workers=2,
            key_field="sha256",
            pin_memory=True,
            processes=processes,
        ) as loader:
            made = []
            for epoch in range(epochs):
                batches = iter(loader)
                if epoch == 1:  # dropped half way: its slots must come back for the next epoch
                    next(batches), next(batches)
                    batches.close()
                    continue
                made.append(
                    [
                        (images.device.type, images.cpu().numpy().tobytes(), labels.cpu().tolist(), keys)
                        for images, labels, keys in batches
                    ]
                )
            process = loader._process
            locked = process.locked
        assert not process.locked  # unlocked once the processes have ended
    finally:
        ShardBatches.PAGE_LOCK = True
    return made, locked


@pytest.mark.parametrize("processes", [1, 2])
def test_batches_copied_from_page_locked_buffers_are_the_ones_copied_through_pinned_memory(
    tmp_path: Path, processes: int
) -> None:
    """Each batch goes to the GPU from the loader processes' shared buffer; the buffer goes back to the processes only
    once that copy has ended: a buffer refilled too early would change the batches on the GPU."""
    url = write_split(tmp_path / "split", rows=600, files=3)
    locked, was_locked = gpu_epochs(url, processes, page_lock=True)
    copied, was_copied = gpu_epochs(url, processes, page_lock=False)
    assert was_locked and not was_copied
    assert locked == copied
    assert all(device == "cuda" for epoch in locked for device, *_ in epoch)
    assert len(locked[0]) == -(-600 // 32) and locked[0] != locked[1]
