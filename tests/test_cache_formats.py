"""`cache_format: jpeg`: the cache holds each image as a JPEG file instead of raw pixels. It holds the same rows as the
raw cache in fewer bytes, written by Spark and grown by the driver, and every reader (the loader's threads and
processes, the gate, the cards, the baseline) gets pixels close to the raw ones, in the same batches."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from imagelake.tasks.data.cache_files import encode_jpeg, label_samples, pixel_rows, split_files
from imagelake.tasks.data.resize_executor import DecodeRules
from imagelake.tasks.registry.baseline import thumbnails
from imagelake.tasks.stages.cache import Stored, cache_one_at_a_time, cache_splits, line_key
from imagelake.tasks.stages.promote import read_split, split_hashes
from imagelake.tasks.stages.split import plan_splits
from imagelake.tasks.worker.loader import ShardBatches
from tests.lake import Lake, copy_digits

SIZE = 48  # 6,912 bytes an image raw


def smooth_images(count: int, size: int) -> np.ndarray:
    """COUNT (count, size*size*3) uint8 images of gradients and a block: what photos and drawings look like to JPEG,
    unlike noise."""
    y, x = np.mgrid[0:size, 0:size] / size
    images = []
    for i in range(count):
        image = np.stack([x * 255, y * 255, (x + y) * 127], axis=-1)
        image[size // 4 : size // 2, size // 4 + i % 4 : size // 2 + i % 4] = (20 * i) % 256
        images.append(image.astype(np.uint8).reshape(-1))
    return np.stack(images)


def test_jpeg_rows_decode_close_to_the_pixels_encoded_and_a_bad_one_is_named() -> None:
    pixels = smooth_images(5, 32)
    encoded = encode_jpeg(pa.array([row.tobytes() for row in pixels], pa.binary()), 32, 95)
    assert all(value.as_py()[:2] == b"\xff\xd8" for value in encoded)
    assert pc.sum(pc.binary_length(encoded)).as_py() < pixels.nbytes / 2
    decoded = pixel_rows(pa.chunked_array([encoded[:2], encoded[2:]]), 32 * 32 * 3, "the split", "jpeg")
    assert decoded.shape == pixels.shape and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(int) - pixels).mean() < 2
    before = set(threading.enumerate())
    assert np.array_equal(pixel_rows(encoded, 32 * 32 * 3, "the split", "jpeg", threads=3), decoded)
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == [], "the decoding threads end"
    garbled = pa.array([encoded[0].as_py(), b"not a JPEG"], pa.binary())
    for threads in (1, 2):
        with pytest.raises(ValueError, match=r"the split holds an image that is not a JPEG: rebuild the cache"):
            pixel_rows(garbled, 32 * 32 * 3, "the split", "jpeg", threads)
    with pytest.raises(ValueError, match=r"not a 16x16 RGB JPEG \(a RGB image of 32x32\)"):
        pixel_rows(encoded, 16 * 16 * 3, "the split", "jpeg")
    # A raw line keeps the key it had before JPEG caches existed: an upgrade reuses it.
    assert Stored().key() == [] and Stored("jpeg", 95).key() == ["jpeg", 95] != Stored("jpeg", 90).key()


def image_bytes(cached) -> int:
    return sum(
        pc.sum(pc.binary_length(pq.read_table(split_files(uri)[1], columns=["image"])["image"])).as_py()
        for uri in cached.splits.values()
    )


def epochs(
    cached, processes: int, first_epoch: int = 0, count: int = 2, decode_device: str | None = None
) -> list[list[tuple[bytes, list, list]]]:
    """Epochs of the train split's batches as plain values (pixels, labels, keys); the loader's threads and processes
    are gone when it returns."""
    before = set(threading.enumerate())
    with ShardBatches(
        cached.splits["train"],
        shard=0,
        shard_count=1,
        batch_size=8,
        image_size=SIZE,
        seed=3,
        shuffle=True,
        key_field="sha256",
        processes=processes,
        decode_device=decode_device,
    ) as loader:
        loader.epoch = first_epoch  # as a resume sets it
        made = [[(i.numpy().tobytes(), la.tolist(), k) for i, la, k in loader] for _ in range(count)]
        workers = loader._process.processes if processes else []
    assert not any(process.is_alive() for process in workers)
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []
    return made


def test_a_jpeg_cache_holds_the_raw_caches_rows_in_fewer_bytes_grows_and_reads_the_same(
    lake: Lake, digits_dir: Path, tmp_path: Path, settings
) -> None:
    source = tmp_path / "src"
    rules = DecodeRules(size=SIZE, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000)
    copy_digits(digits_dir, source, per_label=10)
    _, _, v0 = lake.run(source, rules=rules)
    raw_settings = settings.model_copy(update={"image_size": SIZE, "val_fraction": 0.2, "test_fraction": 0.2})
    jpeg_settings = raw_settings.model_copy(update={"cache_format": "jpeg"})
    plan = plan_splits(lake.spark, v0, raw_settings)
    raw = cache_splits(lake.spark, plan, SIZE, raw_settings.cache_uri, raw_settings.seed)
    jpeg = cache_one_at_a_time(lake.spark, plan, jpeg_settings)  # written whole by Spark
    assert (raw.image_format, jpeg.image_format) == ("raw", "jpeg") and raw.cache_dir != jpeg.cache_dir
    assert jpeg.cache_dir.endswith(line_key(plan, SIZE, raw_settings.seed, Stored("jpeg", 95)))
    assert jpeg.counts == raw.counts

    # The same rows, in the same order; pixels close to the raw ones, in a fraction of the bytes.
    for split in raw.splits:
        assert split_hashes(jpeg.splits[split]) == split_hashes(raw.splits[split])
        raw_images, raw_labels = read_split(raw.splits[split], SIZE)
        jpeg_images, jpeg_labels = read_split(jpeg.splits[split], SIZE)
        assert jpeg_labels.tolist() == raw_labels.tolist()
        assert np.abs(jpeg_images.astype(int) - raw_images).mean() < 2
    assert image_bytes(jpeg) < image_bytes(raw) / 2

    # The loader: the batches of the raw cache (rows, labels, order: here each file is one row group in both), from
    # threads or a process alike, and a resumed epoch is the one a whole run makes.
    raw_epochs, threads, process = epochs(raw, 0), epochs(jpeg, 0), epochs(jpeg, 1)
    assert threads == process
    # Decoded a batch at a time by torchvision (on the CPU here; with nvJPEG on a GPU): the same batches.
    assert epochs(jpeg, 0, decode_device="cpu") == threads
    with pytest.raises(ValueError, match="jpeg_decode=device .* set loader_processes=0"):
        epochs(jpeg, 1, decode_device="cpu")
    assert [[(labels, keys) for _, labels, keys in epoch] for epoch in threads] == [
        [(labels, keys) for _, labels, keys in epoch] for epoch in raw_epochs
    ]
    for jpeg_epoch, raw_epoch in zip(threads, raw_epochs, strict=True):
        for (jpeg_pixels, _, _), (raw_pixels, _, _) in zip(jpeg_epoch, raw_epoch, strict=True):
            difference = np.frombuffer(jpeg_pixels, np.uint8).astype(int) - np.frombuffer(raw_pixels, np.uint8)
            assert np.abs(difference).mean() < 2
    assert epochs(jpeg, 0, first_epoch=1, count=1) == threads[1:]

    # The cards' samples and the baseline's thumbnails read it too.
    samples = label_samples(jpeg.splits["train"], SIZE, jpeg.labels, per_label=2)
    assert {label: images.shape for label, images in samples.items()} == {
        label: (2, SIZE, SIZE, 3) for label in jpeg.labels
    }
    thumbs, labels = thumbnails(jpeg.splits["train"], SIZE, jpeg.counts["train"], 10, seed=0)
    assert thumbs.shape == (10, 32 * 32 * 3) and len(labels) == 10

    # A new version grows it: the new rows, encoded by the driver, in a new generation.
    copy_digits(digits_dir, source, per_label=2, skip=10)
    _, _, v1 = lake.run(source, rules=rules)
    plan1 = plan_splits(lake.spark, v1, raw_settings)
    grown = cache_one_at_a_time(lake.spark, plan1, jpeg_settings)
    assert grown.cache_dir == jpeg.cache_dir and grown.image_format == "jpeg" and not grown.reused
    new_files = [f for uri in grown.splits.values() for f in split_files(uri)[1] if "/g000001/" in f]
    new_images = pq.read_table(new_files, columns=["image"])["image"]
    assert len(new_images) == 8 and all(value[:2] == b"\xff\xd8" for value in new_images.to_pylist())
    for split in grown.splits:
        assert split_hashes(grown.splits[split]) == split_hashes(
            cache_splits(lake.spark, plan1, SIZE, raw_settings.cache_uri, raw_settings.seed).splits[split]
        )
        read_split(grown.splits[split], SIZE)


def test_a_jpeg_cache_is_decoded_on_the_training_device_where_the_settings_say(tmp_path: Path, monkeypatch) -> None:
    import torch

    from imagelake.tasks.worker.train_loop import jpeg_decode_device

    manifests = {}
    for image_format in ("raw", "jpeg"):
        manifests[image_format] = tmp_path / f"{image_format}.json"
        manifests[image_format].write_text(json.dumps({"files": [], "cached": {"image_format": image_format}}))

    def where(image_format: str, jpeg_decode: str | None, use_gpu: bool = False) -> str | None:
        config = {"train_uri": str(manifests[image_format]), "jpeg_decode": jpeg_decode, "use_gpu": use_gpu}
        return jpeg_decode_device(config)

    assert where("raw", "device") is None, "raw pixels have nothing to decode"
    assert (where("jpeg", "auto"), where("jpeg", None), where("jpeg", "loader")) == (None, None, None)
    assert where("jpeg", "device") == "cpu"
    # Without a GPU here, use_gpu trains on the CPU: auto keeps decoding in the loader.
    assert where("jpeg", "auto", use_gpu=True) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the one thing that cannot exist here: a GPU
    assert (where("jpeg", "auto", use_gpu=True), where("jpeg", "device", use_gpu=True)) == ("cuda", "cuda")
    assert (where("jpeg", "loader", use_gpu=True), where("raw", "auto", use_gpu=True)) == (None, None)
