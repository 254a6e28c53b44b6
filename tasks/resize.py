"""Resize: decode with Pillow on the Spark executors in Arrow batches, orient, convert to RGB, make square."""

from __future__ import annotations

import io
import math
from typing import Iterator, Literal

import numpy as np
import pyarrow as pa
from PIL import Image, ImageOps
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.settings import Settings
from infra.spark import spark_session
from tasks.results import Ingested, Resized
from tasks.stage import stage

ResizeMode = Literal["letterbox", "center_crop"]

ROWS_PER_DECODE_TASK = 256

RESIZED_SCHEMA = "path string, label string, sha256 string, width int, height int, image binary, error string"


class ImageDecodeError(ValueError):
    """A file that is not a decodable image."""


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB of any Pillow mode: 16-bit scaled down, transparency composited on white."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        wide = np.asarray(image, dtype=np.int64).clip(0, 65535)
        image = Image.fromarray((wide >> 8).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    return image.convert("RGB")


def fit_square(image: Image.Image, size: int, mode: ResizeMode) -> Image.Image:
    """Letterbox (scale the long side to `size`, pad with black) or centre-crop to size x size."""
    width, height = image.size
    scale = size / (max(width, height) if mode == "letterbox" else min(width, height))
    new_size = (max(1, round(width * scale)), max(1, round(height * scale)))
    scaled = image.resize(new_size, Image.Resampling.BILINEAR, reducing_gap=3.0)
    if mode == "center_crop":
        left, top = (new_size[0] - size) // 2, (new_size[1] - size) // 2
        return scaled.crop((left, top, left + size, top + size))
    canvas = Image.new("RGB", (size, size))
    canvas.paste(scaled, ((size - new_size[0]) // 2, (size - new_size[1]) // 2))
    return canvas


def resize_image(data: bytes, size: int, mode: ResizeMode = "letterbox") -> tuple[np.ndarray, int, int]:
    """Decode one image file's bytes into size x size x 3 uint8 pixels; also return its oriented width and height."""
    if not data:
        raise ImageDecodeError("empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            # draft() only helps before pixels load: JPEGs then decode at a reduced scale, still >= size.
            image.draft("RGB", (size, size))
            oriented = ImageOps.exif_transpose(image)
            width, height = oriented.size
            square = fit_square(to_rgb(oriented), size, mode)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageDecodeError(f"{type(exc).__name__}: {exc}") from None
    return np.asarray(square, dtype=np.uint8), width, height


def resize_batches(batches: Iterator[pa.RecordBatch], size: int, mode: ResizeMode) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: resize every image of each Arrow batch; undecodable files get an error instead of pixels."""
    for batch in batches:
        columns = batch.to_pydict()
        images, widths, heights, errors = [], [], [], []
        for path, content in zip(columns["path"], columns["content"]):
            try:
                pixels, width, height = resize_image(content, size, mode)
            except ImageDecodeError as exc:
                images.append(None), widths.append(None), heights.append(None), errors.append(f"{path}: {exc}")
                continue
            images.append(pixels.tobytes()), widths.append(width), heights.append(height), errors.append(None)
        yield pa.RecordBatch.from_pydict(
            {
                "path": columns["path"],
                "label": columns["label"],
                "sha256": columns["sha256"],
                "width": pa.array(widths, pa.int32()),
                "height": pa.array(heights, pa.int32()),
                "image": pa.array(images, pa.binary()),
                "error": pa.array(errors, pa.string()),
            }
        )


def resize_images(spark: SparkSession, ingested: Ingested, size: int, mode: ResizeMode, staging_uri: str) -> Resized:
    """Decode and resize every staged file on the executors into staging Parquet."""
    # Staged files are packed into few read tasks; spread the rows so every executor core decodes.
    partitions = max(spark.sparkContext.defaultParallelism * 2, math.ceil(ingested.rows / ROWS_PER_DECODE_TASK))
    raw = spark.read.parquet(ingested.staging_uri).repartition(partitions)
    resized = raw.mapInArrow(lambda batches: resize_batches(batches, size, mode), RESIZED_SCHEMA)
    resized.write.mode("overwrite").parquet(staging_uri)
    staged = spark.read.parquet(staging_uri)
    counts = staged.agg(F.count("*").alias("rows"), F.count("error").alias("failed")).first()
    failures = staged.where(F.col("error").isNotNull()).select("path", "error").limit(20).collect() if counts["failed"] else []
    return Resized(
        staging_uri=staging_uri,
        rows=counts["rows"] - counts["failed"],
        failed=counts["failed"],
        failures={row["path"]: row["error"] for row in failures},
        image_size=size,
        content_fingerprint=ingested.content_fingerprint,
    )


@stage("resize")
def resize(ingested: Ingested, settings: Settings) -> Resized:
    """Prefect stage: resize the ingested images to the configured square size."""
    key = f"{ingested.content_fingerprint[:16]}-{settings.image_size}-{settings.resize_mode}"
    staging = settings.staging_dir / f"resize-{key}"
    return resize_images(spark_session(settings), ingested, settings.image_size, settings.resize_mode, str(staging))
