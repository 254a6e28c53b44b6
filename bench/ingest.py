"""Ingest -> resize -> table throughput against the seed blog's method and the machine's decode limit, side by side.

    .venv/bin/python bench/ingest.py [--images 4000] [--size 224]

(a) seed blog: Spark binaryFile + a row-at-a-time Python UDF (open, convert, thumbnail, letterbox), to Parquet
(b) the limit: a plain Pillow loop with draft() decoding, one process per core, no Spark, nothing written
(c) imagelake: ingest (listing + diff) -> resize (read, sha256, draft decode and data files written on the
    executors) -> Delta write (one commit of those files), once with each Delta engine for the table's reads
    (delta-rs, and Spark's Delta where its jars load)
All three run on the same realistic JPEG photos: random crops of scikit-learn's sample photos,
300 to 1,600 px on the long side.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from figures import add_record_option, keep  # bench/figures.py
from PIL import Image
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType
from sklearn.datasets import load_sample_images

from imagelake.infra.settings import Settings
from imagelake.infra.spark import delta_jars_loaded, spark_session
from imagelake.tasks.data.changes import ingest_listing
from imagelake.tasks.data.listing import source_uri
from imagelake.tasks.data.resize_executor import DecodeRules
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.rules.images import resize_image
from imagelake.tasks.rules.listed_files import Scope
from imagelake.tasks.stages.resize import resize_images
from imagelake.tasks.stages.write import write_images


def write_photos(out: Path, count: int, seed: int = 0) -> None:
    """Random crops of scikit-learn's sample photos, rescaled to 300-1,600 px on the long side, as JPEG."""
    rng = np.random.default_rng(seed)
    photos = [Image.fromarray(array) for array in load_sample_images().images]
    for index in range(count):
        photo = photos[index % len(photos)]
        width, height = photo.size
        crop_w, crop_h = int(rng.integers(width // 2, width)), int(rng.integers(height // 2, height))
        left, top = int(rng.integers(0, width - crop_w)), int(rng.integers(0, height - crop_h))
        crop = photo.crop((left, top, left + crop_w, top + crop_h))
        scale = int(rng.integers(300, 1601)) / max(crop.size)
        folder = out / f"class{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        crop.resize((max(1, round(crop.size[0] * scale)), max(1, round(crop.size[1] * scale)))).save(
            folder / f"{index:05d}.jpg", quality=90
        )


def seed_blog(spark, source: str, out: str, size: int) -> None:
    """(a) The seed blog's code path: binaryFile, a row-at-a-time UDF, Parquet."""

    def resize_one(content: bytes) -> bytes:
        image = Image.open(io.BytesIO(content)).convert("RGB")
        image.thumbnail((size, size))
        canvas = Image.new("RGB", (size, size))
        canvas.paste(image, ((size - image.size[0]) // 2, (size - image.size[1]) // 2))
        return canvas.tobytes()

    udf = F.udf(resize_one, BinaryType())
    frame = spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(source)
    frame.select("path", udf("content").alias("image")).write.mode("overwrite").parquet(out)


def _decode(args: tuple[str, int]) -> int:
    path, size = args
    pixels, _, _ = resize_image(Path(path).read_bytes(), size)
    return pixels.shape[0]


def pillow_limit(pool, files: list[Path], size: int) -> None:
    """(b) The decode limit: the same Pillow work (draft, orient, RGB, letterbox), one process per core.

    The pool is started and warmed before timing, so only the decoding is measured.
    """
    pool.map(_decode, [(str(f), size) for f in files], chunksize=16)


def imagelake(spark, source: str, root: Path, size: int, engine: str = "delta-rs") -> None:
    """(c) imagelake's data stages, into a fresh Delta table, with one Delta engine for the table's reads and merges."""
    table, quarantine = str(root / "images"), str(root / "quarantine")
    rules = DecodeRules(size, "letterbox", 50 * 1024 * 1024, 64_000_000)
    images = ImageTable.at(spark, table, size, engine, quarantine)
    ingested = ingest_listing(images, source, Scope((".jpg",)), False, str(root / "staging"))
    resized = resize_images(images, ingested, rules, str(root / "staging" / "resized"))
    write_images(images, resized, 0.1)


def timed(label: str, images: int, work) -> float:
    started = time.perf_counter()
    work()
    rate = images / (time.perf_counter() - started)
    print(f"{label:58} {rate:8.1f} images/s", flush=True)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # A nightly batch: each run also pays a fixed ~0.35 s (listing, a Spark job, the commit), which dominates tiny runs.
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--size", type=int, default=224)
    add_record_option(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="imagelake-bench-"))
    try:
        write_photos(work / "photos", args.images)
        write_photos(work / "warm", 16, seed=1)
        files = sorted((work / "photos").rglob("*.jpg"))
        print(
            f"{len(files)} JPEG photos, {sum(f.stat().st_size for f in files) / len(files) / 1024:.0f} KB on average, "
            f"{os.cpu_count()} cores, {args.size}x{args.size} letterbox",
            flush=True,
        )
        spark = spark_session(Settings(workspace=work / "ws"))
        pool = multiprocessing.get_context("spawn").Pool(os.cpu_count())
        # Warm the JVM, the Python workers, the pool and the page cache for every method alike.
        seed_blog(spark, source_uri(str(work / "warm")), str(work / "warm-a"), args.size)
        engines = ["delta-rs"] + (["spark"] if delta_jars_loaded(spark) else [])
        for engine in engines:
            imagelake(spark, source_uri(str(work / "warm")), work / f"warm-c-{engine}", args.size, engine)
        pillow_limit(pool, sorted((work / "warm").rglob("*.jpg")), args.size)
        for path in files:
            path.read_bytes()
        source = source_uri(str(work / "photos"))
        a = timed(
            "(a) seed blog: binaryFile + row UDF + thumbnail, Parquet",
            args.images,
            lambda: seed_blog(spark, source, str(work / "a"), args.size),
        )
        b = timed(
            "(b) limit: Pillow + draft(), one process per core",
            args.images,
            lambda: pillow_limit(pool, files, args.size),
        )
        c = {
            engine: timed(
                f"(c) imagelake: ingest -> resize -> Delta write ({engine})",
                args.images,
                lambda engine=engine: imagelake(spark, source, work / f"c-{engine}", args.size, engine),
            )
            for engine in engines
        }
        pool.close()
        for engine, rate in c.items():
            print(f"imagelake ({engine}) / limit: {rate / b:.2f}   imagelake ({engine}) / seed blog: {rate / a:.2f}")
        keep(
            args,
            "ingest",
            f"images/s from JPEG files to a Delta table of {args.size} px images ({args.images} photos)",
            {
                "seed_blog_images_per_s": round(a, 1),
                "limit_images_per_s": round(b, 1),
                **{f"imagelake_{engine.replace('-', '_')}_images_per_s": round(rate, 1) for engine, rate in c.items()},
                **{
                    f"imagelake_{engine.replace('-', '_')}_of_limit_ratio": round(rate / b, 2)
                    for engine, rate in c.items()
                },
            },
        )
        if len(engines) == 1:
            print(
                "Spark's Delta jars are not installed (`make install` fetches them with mvn): only delta-rs "
                "was measured"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
