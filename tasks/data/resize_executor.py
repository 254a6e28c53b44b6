"""The resize stage's executor side: read, hash and (only if new) decode one partition's files, and write the new
images as one uncommitted Parquet data file in the table's folder. This code runs inside Spark's Python workers."""

from __future__ import annotations

import hashlib
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Self

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image
from pyspark import TaskContext

from imagelake.tasks.rules.images import DECODE_SECONDS, ImageDecodeError, ResizeMode, decode_square
from imagelake.tasks.rules.schemas import IMAGE_TABLE_SCHEMA, STAGED_ARROW_SCHEMA, STAGED_IMAGE_COLUMNS

# Executors write how many files they have done every few seconds, for the driver's progress line.
PROGRESS_FOLDER, PROGRESS_SECONDS = "_progress", 2.0


@dataclass(frozen=True)
class DecodeRules:
    """What every executor needs to decode one run's files the same way."""

    size: int
    mode: ResizeMode
    max_file_bytes: int
    max_pixels: int
    read_attempts: int = 3  # a read that fails this many times is left for the next run, never quarantined
    read_backoff: float = 0.5  # seconds before the second attempt, doubled before each later one
    max_seconds: float = DECODE_SECONDS  # one file's decoding past this is quarantined as decode_timeout


class ReadFailed(OSError):
    """A file that could not be read in all its attempts: a fact about the store now, not about the file's content."""

    def __init__(self, path: str, attempts: int, last: OSError) -> None:
        super().__init__(f"{path}: {attempts} attempt(s) failed, the last with {type(last).__name__}: {last}")
        self.attempts = attempts


def read_bytes(path: str) -> bytes:
    """A file's bytes through fsspec (local paths and object stores alike)."""
    with fsspec.open(path, "rb") as handle:
        return handle.read()


def read_with_retries(path: str, attempts: int, backoff: float) -> tuple[bytes, int]:
    """A file's bytes and how many reads failed before they came; ReadFailed after ATTEMPTS failures. A file that is
    not there is no hiccup: FileNotFoundError is raised at once."""
    for attempt in range(attempts):
        try:
            return read_bytes(path), attempt
        except FileNotFoundError:
            raise
        except OSError as exc:
            if attempt + 1 == attempts:
                raise ReadFailed(path, attempts, exc) from exc
            time.sleep(backoff * 2**attempt)
    raise ValueError(f"read_attempts must be at least 1, not {attempts}")


def process_file(row: dict, rules: DecodeRules) -> tuple[dict, bytes | None]:
    """One listed file to one staged row (retired, quarantined, unread, already known, or new) and, if new, its pixels.

    Known: the content is what the table holds for this path (`known_sha256`: a file touched or copied over itself).
    Content the table holds under another path is decoded, and the write stage leaves it out. A read that fails is
    tried again (`read_retries` counts the failures); one that fails every time is `unread`, which no table records,
    so the next run reads it again. A file gone since the listing is unread too. Only content is quarantined.
    """
    out = {
        **row,
        "sha256": None,
        "width": None,
        "height": None,
        "status": "new",
        "reason": None,
        "detail": None,
        "data_file": None,
        "read_retries": 0,
    }
    if row["action"] == "delete":
        return {**out, "status": "delete"}, None
    if row["issue"]:
        return {**out, "status": "quarantined", "reason": row["issue"], "detail": row["issue"].replace("_", " ")}, None
    try:
        data, out["read_retries"] = read_with_retries(row["path"], rules.read_attempts, rules.read_backoff)
    except ReadFailed as exc:
        return {
            **out,
            "status": "unread",
            "reason": "read_error",
            "detail": str(exc),
            "read_retries": exc.attempts,
        }, None
    except FileNotFoundError as exc:
        return {**out, "status": "unread", "reason": "gone", "detail": f"{type(exc).__name__}: {exc}"}, None
    out["sha256"] = hashlib.sha256(data).hexdigest()
    if len(data) > rules.max_file_bytes:
        return {
            **out,
            "status": "quarantined",
            "reason": "file_too_large",
            "detail": f"{len(data)} bytes > max_file_bytes",
        }, None
    if out["sha256"] == row.get("known_sha256"):
        return {**out, "status": "known"}, None
    try:
        square, width, height = decode_square(data, rules.size, rules.mode, rules.max_pixels, rules.max_seconds)
    except ImageDecodeError as exc:
        return {**out, "status": "quarantined", "reason": exc.reason, "detail": str(exc)}, None
    return {**out, "width": width, "height": height}, square.tobytes()


SUMMARY_SCHEMA = "status string, reason string, files long, example string"
READ_RETRIES = "read_retries"  # the summary's row of failed reads (its `files` counts reads, not files)


def binary_column(values: list[bytes]) -> pa.Array:
    """A binary Arrow array over one joined buffer: the pixels are copied once, not once per value."""
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    return pa.Array.from_buffers(
        pa.binary(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(values))]
    )


def image_rows(staged: list[dict], pixels: list[bytes], image_size: int, ingested_at: datetime) -> pa.Table:
    """The table's rows for newly decoded files."""
    columns = {
        name: pa.array([row[name] for row in staged], IMAGE_TABLE_SCHEMA.field(name).type)
        for name in STAGED_IMAGE_COLUMNS
    }
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
                self.handle,
                IMAGE_TABLE_SCHEMA,
                compression={n: ("none" if n == "image" else "snappy") for n in IMAGE_TABLE_SCHEMA.names},
                use_dictionary=small,
                write_statistics=small,
            )
        self.writer.write_table(image_rows(self.rows, self.pixels, self.image_size, self.ingested_at))
        self.rows, self.pixels = [], []

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.flush()
        if self.writer is not None:
            self.writer.close()
            self.handle.close()


def report_progress(fs, path: str, files: int) -> None:
    """Write how many files this task has done, for the driver's progress line (a retried task overwrites its own).
    Best effort: a progress file that cannot be written never fails the task."""
    try:
        fs.pipe_file(path, str(files).encode())
    except OSError:
        pass


def files_done(folder_uri: str) -> int:
    """Files (or images) the executors have finished so far, from the progress files they write every few seconds."""
    fs, folder = fsspec.core.url_to_fs(f"{folder_uri}/{PROGRESS_FOLDER}")
    return sum(int(fs.cat_file(path) or 0) for path in fs.find(folder)) if fs.exists(folder) else 0


def process_partition(
    batches: Iterator[pa.RecordBatch],
    rules: DecodeRules,
    staging_uri: str,
    table_uri: str,
    ingested_at: datetime,
    progress_seconds: float = PROGRESS_SECONDS,
    partition: int | None = None,
) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: read, hash and (unless the table holds that content for its path) decode every listed file of
    one partition.

    New images are written here, in the table's own schema, as one Parquet data file in the
    table's folder; the write stage commits that file to the Delta log (or, if the run replaces
    rows, merges its rows). Uncommitted, it is invisible to every reader. Every listed file also
    gets a small staged row (no pixels) for the write stage's bookkeeping. The pixels never pass
    through the JVM: Spark gets back only counts by (status, reason) with an example path. The driver calls it
    itself, as PARTITION 0, for a list too short to be worth starting Spark's Python workers.
    """
    # Our own check quarantines at max_pixels; Pillow's (warning at 1x, error at 2x) stays as a backstop.
    Image.MAX_IMAGE_PIXELS = rules.max_pixels
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    partition = TaskContext.get().partitionId() if partition is None else partition
    staged: list[dict] = []
    fs, folder = fsspec.core.url_to_fs(staging_uri)
    reported = time.monotonic()
    with ImageFileWriter(table_uri, partition, rules.size, ingested_at) as images:
        for batch in batches:
            for row in batch.to_pylist():
                out, decoded = process_file(row, rules)
                staged.append(out)
                if decoded is not None:
                    images.add(out, decoded)
                if time.monotonic() - reported >= progress_seconds:
                    report_progress(fs, f"{folder}/{PROGRESS_FOLDER}/{partition:05d}", len(staged))
                    reported = time.monotonic()
    # Under a temporary name, then renamed: a retried task replaces its partition's file.
    final, temporary = (
        f"{folder}/part-{partition:05d}.parquet",
        f"{folder}/.part-{partition:05d}-{uuid.uuid4().hex}.tmp",
    )
    with fs.open(temporary, "wb") as out:
        pq.write_table(pa.Table.from_pylist(staged, schema=STAGED_ARROW_SCHEMA), out)
    fs.mv(temporary, final)
    counts: dict[tuple[str, str | None], list] = {}
    for row in staged:
        counts.setdefault((row["status"], row["reason"]), [0, row["path"]])[0] += 1
        if row["read_retries"]:
            counts.setdefault((READ_RETRIES, None), [0, row["path"]])[0] += row["read_retries"]
    yield pa.RecordBatch.from_pylist(
        [
            {"status": status, "reason": reason, "files": n, "example": example}
            for (status, reason), (n, example) in counts.items()
        ],
        schema=pa.schema(
            [("status", pa.string()), ("reason", pa.string()), ("files", pa.int64()), ("example", pa.string())]
        ),
    )
