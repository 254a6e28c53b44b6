"""Ingest + resize throughput: imagelake's batched stages against the seed blog's row-at-a-time UDF, side by side.

    .venv/bin/python bench/resize.py [--images 400] [--size 224]

Both read the same JPEG photos with Spark's binaryFile source and write resized pixels to
Parquet on the same local Spark session; the ratio is imagelake / baseline.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType
from sklearn.datasets import load_sample_images

from infra.settings import Settings
from infra.spark import spark_session
from tasks.ingest import ingest_images, source_uri
from tasks.resize import resize_images


def write_photos(out: Path, count: int, seed: int = 0) -> None:
    """Realistic JPEG photos: random crops of scikit-learn's sample photos, 300 to 1,600 px on the long side."""
    rng = np.random.default_rng(seed)
    photos = [Image.fromarray(array) for array in load_sample_images().images]
    for index in range(count):
        photo = photos[index % len(photos)]
        width, height = photo.size
        crop_w, crop_h = int(rng.integers(width // 2, width)), int(rng.integers(height // 2, height))
        left, top = int(rng.integers(0, width - crop_w)), int(rng.integers(0, height - crop_h))
        long_side = int(rng.integers(300, 1601))
        crop = photo.crop((left, top, left + crop_w, top + crop_h))
        scale = long_side / max(crop.size)
        folder = out / f"class{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        crop.resize((max(1, round(crop.size[0] * scale)), max(1, round(crop.size[1] * scale)))).save(folder / f"{index:05d}.jpg", quality=90)


def seed_blog_resize(spark, source: str, out: str, size: int) -> None:
    """The seed blog's method: a row-at-a-time Python UDF with thumbnail + letterbox, written to Parquet."""

    def resize_one(content: bytes) -> bytes:
        image = Image.open(io.BytesIO(content)).convert("RGB")
        image.thumbnail((size, size))
        canvas = Image.new("RGB", (size, size))
        canvas.paste(image, ((size - image.size[0]) // 2, (size - image.size[1]) // 2))
        return canvas.tobytes()

    udf = F.udf(resize_one, BinaryType())
    frame = spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(source)
    frame.select("path", udf("content").alias("image")).write.mode("overwrite").parquet(out)


def timed(label: str, images: int, work) -> float:
    started = time.perf_counter()
    work()
    rate = images / (time.perf_counter() - started)
    print(f"{label:50} {rate:8.1f} images/s")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="imagelake-bench-"))
    try:
        write_photos(work / "photos", args.images)
        spark = spark_session(Settings(workspace=work / "ws"))
        uri = source_uri(str(work / "photos"))
        warm = work / "warm"
        write_photos(warm, 8, seed=1)
        seed_blog_resize(spark, source_uri(str(warm)), str(work / "warm-out"), args.size)  # JVM and workers warm
        baseline = timed("seed blog (binaryFile + row UDF + thumbnail)", args.images, lambda: seed_blog_resize(spark, uri, str(work / "a"), args.size))

        def imagelake() -> None:
            ingested = ingest_images(spark, uri, [".jpg"], str(work / "raw"))
            resize_images(spark, ingested, args.size, "letterbox", str(work / "b"))

        ours = timed("imagelake ingest + resize (mapInArrow, draft)", args.images, imagelake)
        print(f"ratio imagelake / seed blog: {ours / baseline:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
