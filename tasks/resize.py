"""Resize: decode with Pillow on the Spark executors in Arrow batches, orient, convert to RGB, make square."""

from __future__ import annotations

import hashlib
import io
import math
import uuid
import warnings
from dataclasses import dataclass
from typing import Iterator, Literal

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageOps, UnidentifiedImageError
from pyspark import TaskContext
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql import functions as F

from infra.delta import Engine, choose_engine, read_current
from infra.settings import Settings
from infra.spark import spark_session
from tasks.ingest import LISTING_SCHEMA
from tasks.results import Ingested, Resized
from tasks.stage import stage

ResizeMode = Literal["letterbox", "center_crop"]

ROWS_PER_DECODE_TASK = 256

# The listing's columns, then what reading and decoding found.
STAGED_ARROW_SCHEMA = pa.schema(
    list(LISTING_SCHEMA)
    + [
        ("sha256", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("image", pa.binary()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
    ]
)



class ImageDecodeError(ValueError):
    """A file that is not a decodable image; `reason` is the quarantine reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


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


def resize_image(data: bytes, size: int, mode: ResizeMode = "letterbox", max_pixels: int | None = None) -> tuple[np.ndarray, int, int]:
    """Decode one image file's bytes into size x size x 3 uint8 pixels; also return its oriented width and height."""
    if not data:
        raise ImageDecodeError("empty_file", "0 bytes")
    try:
        with Image.open(io.BytesIO(data)) as image:
            if max_pixels and image.width * image.height > max_pixels:
                raise ImageDecodeError("decompression_bomb", f"{image.width}x{image.height} is over max_image_pixels={max_pixels}")
            # draft() only helps before pixels load: JPEGs then decode at a reduced scale, still >= size.
            image.draft("RGB", (size, size))
            oriented = ImageOps.exif_transpose(image)
            width, height = oriented.size
            square = fit_square(to_rgb(oriented), size, mode)
    except ImageDecodeError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError("decompression_bomb", str(exc)) from None
    except (UnidentifiedImageError, SyntaxError) as exc:
        raise ImageDecodeError("not_an_image", str(exc)) from None
    except (OSError, ValueError) as exc:
        reason = "truncated" if "truncated" in str(exc) or "broken data stream" in str(exc) else "undecodable"
        raise ImageDecodeError(reason, f"{type(exc).__name__}: {exc}") from None
    return np.asarray(square, dtype=np.uint8), width, height


@dataclass(frozen=True)
class DecodeRules:
    """What every executor needs to decode one run's files the same way."""

    size: int
    mode: ResizeMode
    max_file_bytes: int
    max_pixels: int


def read_bytes(path: str) -> bytes:
    """A file's bytes through fsspec (local paths and object stores alike)."""
    with fsspec.open(path, "rb") as handle:
        return handle.read()


def process_file(row: dict, rules: DecodeRules, known: frozenset[str]) -> dict:
    """One listed file to one staged row: retired, quarantined, already known, or new with its pixels."""
    out = {**row, "sha256": None, "width": None, "height": None, "image": None, "status": "new", "reason": None, "detail": None}
    if row["action"] == "delete":
        return {**out, "status": "delete"}
    if row["issue"]:
        return {**out, "status": "quarantined", "reason": row["issue"], "detail": row["issue"].replace("_", " ")}
    try:
        data = read_bytes(row["path"])
    except OSError as exc:
        return {**out, "status": "quarantined", "reason": "unreadable", "detail": f"{type(exc).__name__}: {exc}"}
    out["sha256"] = hashlib.sha256(data).hexdigest()
    if len(data) > rules.max_file_bytes:
        return {**out, "status": "quarantined", "reason": "file_too_large", "detail": f"{len(data)} bytes > max_file_bytes"}
    if out["sha256"] in known:
        return {**out, "status": "known"}
    try:
        pixels, width, height = resize_image(data, rules.size, rules.mode, rules.max_pixels)
    except ImageDecodeError as exc:
        return {**out, "status": "quarantined", "reason": exc.reason, "detail": str(exc)}
    return {**out, "width": width, "height": height, "image": pixels.tobytes()}


SUMMARY_SCHEMA = "status string, reason string, files long, example string"
DICTIONARY_COLUMNS = [name for name in STAGED_ARROW_SCHEMA.names if name != "image"]


def process_partition(batches: Iterator[pa.RecordBatch], rules: DecodeRules, known: frozenset[str], staging_uri: str) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: read, hash and (only if its hash is new) decode every listed file of one partition.

    The staged rows, pixels included, are written here as one Parquet file per partition, so the
    pixels never pass through the JVM; Spark gets back only counts by (status, reason) with an
    example path. The file name is the partition's, written under a temporary name and renamed:
    a retried task replaces it.
    """
    # Our own check quarantines at max_pixels; Pillow's (warning at 1x, error at 2x) stays as a backstop.
    Image.MAX_IMAGE_PIXELS = rules.max_pixels
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    partition = TaskContext.get().partitionId()
    fs, folder = fsspec.core.url_to_fs(staging_uri)
    final, temporary = f"{folder}/part-{partition:05d}.parquet", f"{folder}/.part-{partition:05d}-{uuid.uuid4().hex}.tmp"
    counts: dict[tuple[str, str | None], list] = {}
    with fs.open(temporary, "wb") as out, pq.ParquetWriter(
        out, STAGED_ARROW_SCHEMA, compression="none", use_dictionary=DICTIONARY_COLUMNS, write_statistics=DICTIONARY_COLUMNS
    ) as writer:
        for batch in batches:
            rows = [process_file(row, rules, known) for row in batch.to_pylist()]
            writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=STAGED_ARROW_SCHEMA))
            for row in rows:
                counts.setdefault((row["status"], row["reason"]), [0, row["path"]])[0] += 1
    fs.mv(temporary, final)
    yield pa.RecordBatch.from_pylist(
        [{"status": status, "reason": reason, "files": n, "example": example} for (status, reason), (n, example) in counts.items()],
        schema=pa.schema([("status", pa.string()), ("reason", pa.string()), ("files", pa.int64()), ("example", pa.string())]),
    )


def resize_images(spark: SparkSession, ingested: Ingested, rules: DecodeRules, known: frozenset[str], staging_uri: str) -> Resized:
    """Decode and resize every new or changed file on the executors into staging Parquet."""
    fs, folder = fsspec.core.url_to_fs(staging_uri)
    if fs.exists(folder):
        fs.rm(folder, recursive=True)
    fs.makedirs(folder, exist_ok=True)
    # The list is small: the driver reads it, so Spark itself never needs access to the staging store.
    with fsspec.open(ingested.manifest_uri, "rb") as handle:
        listed = spark.createDataFrame(pq.read_table(handle).to_pandas(), schema=from_arrow_schema(LISTING_SCHEMA))
    # Spread a long list so every executor core reads and decodes; a short one is already split per core.
    partitions = math.ceil(ingested.candidates / ROWS_PER_DECODE_TASK)
    if partitions > listed.rdd.getNumPartitions():
        listed = listed.repartition(partitions)
    shared = spark.sparkContext.broadcast(known)
    summary = listed.mapInArrow(lambda batches: process_partition(batches, rules, shared.value, staging_uri), SUMMARY_SCHEMA)
    counts: dict[tuple[str, str | None], tuple[int, str]] = {}
    for row in summary.collect():
        n, example = counts.get((row["status"], row["reason"]), (0, row["example"]))
        counts[(row["status"], row["reason"])] = (n + row["files"], example)
    shared.unpersist()
    by_status: dict[str, int] = {}
    for (status, _), (n, _) in counts.items():
        by_status[status] = by_status.get(status, 0) + n
    return Resized(
        staging_uri=staging_uri,
        image_size=rules.size,
        decoded=by_status.get("new", 0),
        known=by_status.get("known", 0),
        retired=by_status.get("delete", 0),
        quarantined={reason: n for (status, reason), (n, _) in counts.items() if status == "quarantined"},
        examples={reason: example for (status, reason), (_, example) in counts.items() if status == "quarantined"},
        content_fingerprint=ingested.content_fingerprint,
    )


def known_hashes(spark: SparkSession, engine: Engine, table_uri: str, image_size: int) -> frozenset[str]:
    """Content hashes already in the table at this image size: those files are not decoded again."""
    rows = read_current(spark, table_uri, engine, ["sha256"], F.col("image_size") == image_size)
    return frozenset(rows.column("sha256").to_pylist())


@stage("resize")
def resize(ingested: Ingested, settings: Settings) -> Resized:
    """Prefect stage: read, hash and resize what ingest found new or changed."""
    rules = DecodeRules(settings.image_size, settings.resize_mode, settings.max_file_bytes, settings.max_image_pixels)
    key = f"{ingested.content_fingerprint[:16]}-{settings.image_size}-{settings.resize_mode}"
    spark = spark_session(settings)
    known = known_hashes(spark, choose_engine(settings, spark), settings.table_uri, settings.image_size)
    return resize_images(spark, ingested, rules, known, f"{settings.staging_uri}/resize-{key}")
