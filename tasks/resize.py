"""Resize: decode with Pillow on the Spark executors in Arrow batches, orient, convert to RGB, make square."""

from __future__ import annotations

import hashlib
import io
import math
import time
import uuid
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterator, Literal, Self

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageOps, UnidentifiedImageError
from pyspark import TaskContext
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql import functions as F

from infra.delta import Engine, choose_engine, read_current, table_version
from infra.settings import Settings
from infra.spark import spark_session
from tasks.ingest import LISTING_SCHEMA, diff_against_table, scope_of
from tasks.results import Ingested, Listed, Resized
from tasks.progress import Every, rate_line, stage_logger
from tasks.stage import stage

ResizeMode = Literal["letterbox", "center_crop"]

# Rows per decode task beyond one task per core: small enough to balance a long list, large enough to amortise a task.
ROWS_PER_DECODE_TASK = 2048
PROGRESS_FOLDER, PROGRESS_SECONDS = "_progress", 2.0

# The listing's columns, then what reading and decoding found.
STAGED_ARROW_SCHEMA = pa.schema(
    list(LISTING_SCHEMA)
    + [
        ("sha256", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("data_file", pa.string()),
    ]
)

# The Delta table of images, one row per (path, image size).
IMAGE_TABLE_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("label", pa.string()),
        ("date", pa.date32()),
        ("size", pa.int64()),
        ("mtime", pa.float64()),
        ("sha256", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("image_size", pa.int32()),
        ("image", pa.binary()),
        ("ingested_at", pa.timestamp("us", tz="UTC")),
    ]
)
STAGED_IMAGE_COLUMNS = [name for name in IMAGE_TABLE_SCHEMA.names if name not in ("image_size", "image", "ingested_at")]



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


def decode_square(data: bytes, size: int, mode: ResizeMode = "letterbox", max_pixels: int | None = None) -> tuple[Image.Image, int, int]:
    """Decode one image file's bytes into a size x size RGB image; also return its oriented width and height."""
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
    return square, width, height


def resize_image(data: bytes, size: int, mode: ResizeMode = "letterbox", max_pixels: int | None = None) -> tuple[np.ndarray, int, int]:
    """Decode one image file's bytes into size x size x 3 uint8 pixels; also return its oriented width and height."""
    square, width, height = decode_square(data, size, mode, max_pixels)
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


def process_file(row: dict, rules: DecodeRules, known: frozenset[str]) -> tuple[dict, bytes | None]:
    """One listed file to one staged row (retired, quarantined, already known, or new) and, if new, its pixels."""
    out = {**row, "sha256": None, "width": None, "height": None, "status": "new", "reason": None, "detail": None, "data_file": None}
    if row["action"] == "delete":
        return {**out, "status": "delete"}, None
    if row["issue"]:
        return {**out, "status": "quarantined", "reason": row["issue"], "detail": row["issue"].replace("_", " ")}, None
    try:
        data = read_bytes(row["path"])
    except OSError as exc:
        return {**out, "status": "quarantined", "reason": "unreadable", "detail": f"{type(exc).__name__}: {exc}"}, None
    out["sha256"] = hashlib.sha256(data).hexdigest()
    if len(data) > rules.max_file_bytes:
        return {**out, "status": "quarantined", "reason": "file_too_large", "detail": f"{len(data)} bytes > max_file_bytes"}, None
    if out["sha256"] in known:
        return {**out, "status": "known"}, None
    try:
        square, width, height = decode_square(data, rules.size, rules.mode, rules.max_pixels)
    except ImageDecodeError as exc:
        return {**out, "status": "quarantined", "reason": exc.reason, "detail": str(exc)}, None
    return {**out, "width": width, "height": height}, square.tobytes()


SUMMARY_SCHEMA = "status string, reason string, files long, example string"


def binary_column(values: list[bytes]) -> pa.Array:
    """A binary Arrow array over one joined buffer: the pixels are copied once, not once per value."""
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    return pa.Array.from_buffers(pa.binary(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(values))])


def image_rows(staged: list[dict], pixels: list[bytes], image_size: int, ingested_at: datetime) -> pa.Table:
    """The table's rows for newly decoded files."""
    columns = {name: pa.array([row[name] for row in staged], IMAGE_TABLE_SCHEMA.field(name).type) for name in STAGED_IMAGE_COLUMNS}
    columns["image_size"] = pa.array([image_size] * len(staged), pa.int32())
    columns["image"] = binary_column(pixels)
    columns["ingested_at"] = pa.array([ingested_at] * len(staged), pa.timestamp("us", tz="UTC"))
    return pa.table([columns[name] for name in IMAGE_TABLE_SCHEMA.names], schema=IMAGE_TABLE_SCHEMA)


class ImageFileWriter:
    """One uncommitted Parquet data file of new images in the table's folder, written a small row group at a time.

    Writing each few images while their pixels are still in the CPU cache costs a third of
    writing them all at the end. The file is created only if the partition has a new image.
    """

    ROWS_PER_GROUP = 16

    def __init__(self, table_uri: str, partition: int, image_size: int, ingested_at: datetime) -> None:
        self.table_uri, self.image_size, self.ingested_at = table_uri, image_size, ingested_at
        self.name = f"part-{partition:05d}-{uuid.uuid4()}-c000.imagelake.parquet"
        self.rows: list[dict] = []
        self.pixels: list[bytes] = []
        self.handle = self.writer = None

    def __enter__(self) -> Self:
        return self

    def add(self, row: dict, pixels: bytes) -> None:
        row["data_file"] = self.name
        self.rows.append(row)
        self.pixels.append(pixels)
        if len(self.rows) >= self.ROWS_PER_GROUP:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        if self.writer is None:
            fs, folder = fsspec.core.url_to_fs(self.table_uri)
            fs.makedirs(folder, exist_ok=True)
            self.handle = fs.open(f"{folder}/{self.name}", "wb")
            small = [n for n in IMAGE_TABLE_SCHEMA.names if n != "image"]
            # Raw pixels hardly compress and are never filtered on: no compression, dictionary or statistics.
            self.writer = pq.ParquetWriter(
                self.handle, IMAGE_TABLE_SCHEMA, compression={n: ("none" if n == "image" else "snappy") for n in IMAGE_TABLE_SCHEMA.names},
                use_dictionary=small, write_statistics=small,
            )
        self.writer.write_table(image_rows(self.rows, self.pixels, self.image_size, self.ingested_at))
        self.rows, self.pixels = [], []

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.flush()
        if self.writer is not None:
            self.writer.close()
            self.handle.close()


def process_partition(
    batches: Iterator[pa.RecordBatch], rules: DecodeRules, known: frozenset[str], staging_uri: str, table_uri: str, ingested_at: datetime
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: read, hash and (only if its hash is new) decode every listed file of one partition.

    New images are written here, in the table's own schema, as one Parquet data file in the
    table's folder; the write stage commits that file to the Delta log (or, if the run replaces
    rows, merges its rows). Uncommitted, it is invisible to every reader. Every listed file also
    gets a small staged row (no pixels) for the write stage's bookkeeping. The pixels never pass
    through the JVM: Spark gets back only counts by (status, reason) with an example path.
    """
    # Our own check quarantines at max_pixels; Pillow's (warning at 1x, error at 2x) stays as a backstop.
    Image.MAX_IMAGE_PIXELS = rules.max_pixels
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    partition = TaskContext.get().partitionId()
    staged: list[dict] = []
    fs, folder = fsspec.core.url_to_fs(staging_uri)
    reported = time.monotonic()
    with ImageFileWriter(table_uri, partition, rules.size, ingested_at) as images:
        for batch in batches:
            for row in batch.to_pylist():
                out, decoded = process_file(row, rules, known)
                staged.append(out)
                if decoded is not None:
                    images.add(out, decoded)
                if time.monotonic() - reported > PROGRESS_SECONDS:
                    # The driver sums these files for its progress line (a retried task overwrites its own).
                    fs.pipe_file(f"{folder}/{PROGRESS_FOLDER}/{partition:05d}", str(len(staged)).encode())
                    reported = time.monotonic()
    # Under a temporary name, then renamed: a retried task replaces its partition's file.
    final, temporary = f"{folder}/part-{partition:05d}.parquet", f"{folder}/.part-{partition:05d}-{uuid.uuid4().hex}.tmp"
    with fs.open(temporary, "wb") as out:
        pq.write_table(pa.Table.from_pylist(staged, schema=STAGED_ARROW_SCHEMA), out)
    fs.mv(temporary, final)
    counts: dict[tuple[str, str | None], list] = {}
    for row in staged:
        counts.setdefault((row["status"], row["reason"]), [0, row["path"]])[0] += 1
    yield pa.RecordBatch.from_pylist(
        [{"status": status, "reason": reason, "files": n, "example": example} for (status, reason), (n, example) in counts.items()],
        schema=pa.schema([("status", pa.string()), ("reason", pa.string()), ("files", pa.int64()), ("example", pa.string())]),
    )


def files_done(staging_uri: str) -> int:
    """Files the executors have finished so far, from the progress files they write every few seconds."""
    fs, folder = fsspec.core.url_to_fs(f"{staging_uri}/{PROGRESS_FOLDER}")
    return sum(int(fs.cat_file(path) or 0) for path in fs.find(folder)) if fs.exists(folder) else 0


def balanced_partitions(rows: list[dict], partitions: int) -> list[list[dict]]:
    """Deal the files largest first, in a snake order, so every task gets a similar count and a similar number of bytes."""
    groups: list[list[dict]] = [[] for _ in range(partitions)]
    for index, row in enumerate(sorted(rows, key=lambda r: -(r["size"] or 0))):
        turn, position = divmod(index, partitions)
        groups[position if turn % 2 == 0 else partitions - 1 - position].append(row)
    return [group for group in groups if group]


def resize_images(spark: SparkSession, ingested: Ingested, rules: DecodeRules, known: frozenset[str], staging_uri: str, table_uri: str) -> Resized:
    """Decode and resize every new or changed file on the executors: pixels into uncommitted table files, the rest to staging."""
    fs, folder = fsspec.core.url_to_fs(staging_uri)
    if fs.exists(folder):
        fs.rm(folder, recursive=True)
    fs.makedirs(folder, exist_ok=True)
    # The list is small: the driver reads it, so Spark itself never needs access to the staging store.
    with fsspec.open(ingested.manifest_uri, "rb") as handle:
        listed = pq.read_table(handle).to_pylist()
    # One task per core, more for a long list; each gets a fair share of the bytes to decode.
    cores = spark.sparkContext.defaultParallelism
    groups = balanced_partitions(listed, cores * max(1, math.ceil(len(listed) / (cores * ROWS_PER_DECODE_TASK))))
    names = LISTING_SCHEMA.names
    rows = spark.sparkContext.parallelize(groups, max(1, len(groups))).flatMap(lambda group: [tuple(r[n] for n in names) for r in group])
    frame = spark.createDataFrame(rows, schema=from_arrow_schema(LISTING_SCHEMA))
    shared = spark.sparkContext.broadcast(known)
    ingested_at = datetime.now(timezone.utc)
    summary = frame.mapInArrow(lambda batches: process_partition(batches, rules, shared.value, staging_uri, table_uri, ingested_at), SUMMARY_SCHEMA)
    counts: dict[tuple[str, str | None], tuple[int, str]] = {}
    logger, started = stage_logger(), time.monotonic()
    with Every(lambda: logger.info(rate_line("resize", files_done(staging_uri), len(listed), time.monotonic() - started, "files")), logger):
        rows = summary.collect()
    logger.info(rate_line("resize", len(listed), len(listed), time.monotonic() - started, "files"))
    for row in rows:
        n, example = counts.get((row["status"], row["reason"]), (0, row["example"]))
        counts[(row["status"], row["reason"])] = (n + row["files"], example)
    shared.unpersist()
    by_status: dict[str, int] = {}
    for (status, _), (n, _) in counts.items():
        by_status[status] = by_status.get(status, 0) + n
    return Resized(
        staging_uri=staging_uri,
        table_uri=table_uri,
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


def tables_now(inputs: dict[str, Any]) -> dict[str, str]:
    """Cache key part for resize: the versions of the tables the diff reads, so new commits are a miss."""
    settings: Settings = inputs["settings"]
    return {"table version": str(table_version(settings.table_uri)), "table version (quarantine)": str(table_version(settings.quarantine_uri))}


@stage(
    "resize",
    # max_bad_fraction too: a write that refused too many bad files took back the files this stage wrote.
    settings=(
        "image_size", "resize_mode", "max_file_bytes", "max_image_pixels", "max_bad_fraction", "retire_deleted", "start_date", "end_date",
        "table_uri", "quarantine_uri", "staging_uri",
    ),
    facts=tables_now,
    code=("tasks.ingest",),
)
def resize(listed: Listed, settings: Settings) -> Resized:
    """Prefect stage: find what is new or changed at this image size, then read, hash and resize it."""
    spark = spark_session(settings)
    engine = choose_engine(settings, spark)
    ingested = diff_against_table(
        spark, engine, listed, scope_of(settings), settings.table_uri, settings.image_size, settings.retire_deleted, settings.staging_uri,
        settings.quarantine_uri,
    )
    rules = DecodeRules(settings.image_size, settings.resize_mode, settings.max_file_bytes, settings.max_image_pixels)
    key = f"{ingested.content_fingerprint[:16]}-{settings.image_size}-{settings.resize_mode}"
    known = known_hashes(spark, engine, settings.table_uri, settings.image_size)
    return resize_images(spark, ingested, rules, known, f"{settings.staging_uri}/resize-{key}", settings.table_uri)
