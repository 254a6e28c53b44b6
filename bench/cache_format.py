"""Cache bytes and loader speed of the two cache formats, raw pixels and JPEG, side by side, on real images.

    .venv/bin/python bench/cache_format.py [--sets photos,stamps,digits] [--size 224] [--quality 95] [--epochs 3]

Each data set's images are decoded and resized as the resize stage does (tasks/rules/images.py), then cached both
ways in the cache's layout (rows dealt to files, 8 MB row groups: tasks/stages/cache.py, by the driver); `stamps` needs
`make stamps`. For each format it prints the cache's bytes per image, the mean pixel error against the raw cache, the
CPU time to decode one image (one core), and the images per second the training loader (ShardBatches) delivers, with
its reader threads in the training process and with one loader process, median of the epochs after a first one.
Ratios are JPEG against raw, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from figures import add_record_option, keep  # noqa: E402 - bench/figures.py

from imagelake.tasks.data.cache_files import pixel_rows  # noqa: E402
from imagelake.tasks.rules.images import decode_square  # noqa: E402
from imagelake.tasks.stages.cache import Stored, write_split_arrow  # noqa: E402
from imagelake.tasks.worker.loader import ShardBatches  # noqa: E402


def image_files(name: str, folder: Path) -> list[Path]:
    """The data set's image files, written into FOLDER (digits, photos) or found where Debian installs them."""
    from imagelake.flows.demo_data import write_digits, write_photos

    if name == "stamps":
        stamps = Path("/usr/share/tuxpaint/stamps")
        if not stamps.is_dir():
            raise SystemExit("stamps: run `make stamps` first (it installs Debian's tuxpaint-stamps-default)")
        return sorted(stamps.rglob("*.png"))
    {"digits": write_digits, "photos": write_photos}[name](folder)
    return sorted(p for p in folder.rglob("*") if p.suffix in (".png", ".jpg"))


def raw_rows(files: list[Path], size: int) -> pa.Table:
    """The images as the table stores them: raw size x size RGB pixels, a label and a content hash each."""
    images = [decode_square(path.read_bytes(), size)[0].tobytes() for path in files]
    return pa.table(
        {
            "image": pa.array(images, pa.binary()),
            "label": pa.array([i % 8 for i in range(len(files))], pa.int64()),
            "sha256": pa.array([f"{i:064x}" for i in range(len(files))], pa.string()),
        }
    )


def write_cache(rows: pa.Table, folder: Path) -> str:
    import fsspec

    write_split_arrow(rows, fsspec.filesystem("file"), str(folder), partitions=4, seed=0, generation=0)
    return str(folder)


def manifest_for(folder: Path, image_format: str) -> str:
    """A manifest naming the folder's files, recording the format as the cache stage's do."""
    import json

    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.parquet"))
    manifest = folder / "train-v0.json"
    manifest.write_text(json.dumps({"files": files, "cached": {"image_format": image_format}}))
    return str(manifest)


def loader_rate(url: str, size: int, processes: int, epochs: int, batch: int) -> float:
    """Images per second of the loader over whole epochs: the median of the epochs after the first."""
    rates = []
    with ShardBatches(
        url, shard=0, shard_count=1, batch_size=batch, image_size=size, seed=0, shuffle=True, processes=processes
    ) as loader:
        for _ in range(epochs + 1):
            started, rows = time.perf_counter(), 0
            for images, _ in loader:
                rows += len(images)
            rates.append(rows / (time.perf_counter() - started))
    return statistics.median(rates[1:])


def decode_ms(column: pa.ChunkedArray, size: int, image_format: str) -> float:
    started = time.process_time()
    pixel_rows(column, size * size * 3, "bench", image_format)
    return (time.process_time() - started) * 1000 / len(column)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="photos,stamps,digits")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--quality", type=int, default=95)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per loader, after a first untimed one")
    parser.add_argument("--batch", type=int, default=64)
    add_record_option(parser)
    args = parser.parse_args()
    print(f"size {args.size} px, JPEG quality {args.quality} (4:4:4), batch {args.batch}")
    print(
        "| data set | images | format | bytes/image | ratio | mean abs error | decode ms/image (1 core) "
        "| loader images/s, threads | ratio | loader images/s, 1 process | ratio |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.sets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            files = image_files(name, work / "source")
            rows = raw_rows(files, args.size)
            measured = {}
            for image_format in ("raw", "jpeg"):
                stored = Stored(image_format, args.quality)
                folder = work / image_format
                write_cache(stored.rows(rows, args.size), folder)
                url = manifest_for(folder, image_format)
                parts = sorted(folder.rglob("*.parquet"))
                table = pq.read_table(parts, columns=["image", "sha256"]).sort_by("sha256")
                pixels = pixel_rows(table["image"], args.size * args.size * 3, name, image_format)
                measured[image_format] = {
                    "bytes": sum(p.stat().st_size for p in folder.rglob("*.parquet")) / len(files),
                    "pixels": pixels,
                    "decode": decode_ms(table["image"], args.size, image_format),
                    "threads": loader_rate(url, args.size, 0, args.epochs, args.batch),
                    "process": loader_rate(url, args.size, 1, args.epochs, args.batch),
                }
            raw = measured["raw"]
            jpeg = measured["jpeg"]
            keep(
                args,
                f"cache_format_{name}",
                f"the cache's JPEG format against raw pixels on {name} ({args.size} px, quality {args.quality})",
                {
                    "jpeg_of_raw_bytes_ratio": round(jpeg["bytes"] / raw["bytes"], 3),
                    "jpeg_mean_abs_error": round(
                        float(np.abs(jpeg["pixels"].astype(np.int16) - raw["pixels"]).mean()), 2
                    ),
                    "jpeg_decode_ms_per_image": round(jpeg["decode"], 3),
                    "jpeg_of_raw_loader_threads_ratio": round(jpeg["threads"] / raw["threads"], 2),
                    "jpeg_of_raw_loader_process_ratio": round(jpeg["process"] / raw["process"], 2),
                },
            )
            for image_format, m in measured.items():
                error = np.abs(m["pixels"].astype(np.int16) - raw["pixels"]).mean()
                print(
                    f"| {name} | {len(files)} | {image_format} | {m['bytes']:,.0f} | {m['bytes'] / raw['bytes']:.3f} "
                    f"| {error:.2f} | {m['decode']:.3f} | {m['threads']:,.0f} | {m['threads'] / raw['threads']:.2f} "
                    f"| {m['process']:,.0f} | {m['process'] / raw['process']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
