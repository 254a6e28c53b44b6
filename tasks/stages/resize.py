"""Resize: find what is new or changed at this image size, then decode it on the Spark executors
(tasks/data/resize_executor.py)
in balanced tasks, with a progress line from the driver; pixels go into uncommitted data files, the rest to staging."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow.parquet as pq
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from imagelake.infra.delta import Table
from imagelake.infra.settings import Settings, stage_settings
from imagelake.tasks.data.changes import diff_against_table
from imagelake.tasks.data.resize_executor import (
    PROGRESS_FOLDER,
    PROGRESS_SECONDS,
    READ_RETRIES,
    SUMMARY_SCHEMA,
    DecodeRules,
    files_done,
    process_partition,
)
from imagelake.tasks.data.table import ImageTable, hold_resize_mode
from imagelake.tasks.progress import Every, rate_line, stage_logger
from imagelake.tasks.results import Listed, ListingDiff, Resized, left_unread
from imagelake.tasks.rules.listed_files import scope_of
from imagelake.tasks.rules.partitions import ROWS_PER_DECODE_TASK, balanced_partitions
from imagelake.tasks.rules.schemas import CHANGES_SCHEMA
from imagelake.tasks.stage import stage


def resize_images(
    table: ImageTable,
    ingested: ListingDiff,
    rules: DecodeRules,
    staging_uri: str,
    progress_seconds: float = PROGRESS_SECONDS,
    in_driver_up_to: int = 0,
) -> Resized:
    """Decode and resize every new or changed file on the executors: pixels into uncommitted table files, the rest to
    staging.

    A file whose content is what the table already holds for its path is not decoded again. Each task writes how
    many files it has done every `progress_seconds` for the driver's progress line. Nothing to do asks for no Spark
    session (a process that has none starts none); a list of at most `in_driver_up_to` files is decoded by the driver
    itself, the same way.
    """
    table_uri = table.uri  # a plain value: the executors' closure carries no session
    fs, folder = fsspec.core.url_to_fs(staging_uri)
    if fs.exists(folder):
        fs.rm(folder, recursive=True)
    fs.makedirs(
        f"{folder}/{PROGRESS_FOLDER}", exist_ok=True
    )  # local folders must exist before the executors write into them
    # Only what changed is listed here: the driver reads it, so Spark itself never needs access to the staging store.
    with fsspec.open(ingested.manifest_uri, "rb") as handle:
        listed = pq.read_table(handle)
    counts: dict[tuple[str, str | None], tuple[int, str]] = {}
    if 0 < listed.num_rows <= in_driver_up_to:
        batches = iter(listed.to_batches())
        summary = with_progress(
            listed.num_rows,
            staging_uri,
            lambda: [
                row
                for batch in process_partition(
                    batches, rules, staging_uri, table_uri, datetime.now(UTC), progress_seconds, partition=0
                )
                for row in batch.to_pylist()
            ],
        )
        counts = count_by_status(summary)
    elif listed.num_rows:
        counts = decode_on_executors(table.spark, listed.to_pylist(), rules, staging_uri, table_uri, progress_seconds)
    by_status: dict[str, int] = {}
    for (status, _), (n, _) in counts.items():
        by_status[status] = by_status.get(status, 0) + n
    if by_status.get("unread"):
        example = next(example for (status, _), (_, example) in counts.items() if status == "unread")
        stage_logger().warning(
            f"resize: {by_status['unread']} file(s) could not be read after {rules.read_attempts} attempt(s) "
            f"(e.g. {example}); "
            "this version leaves them out and the next run reads them again"
        )
    return Resized(
        staging_uri=staging_uri,
        table_uri=table_uri,
        image_size=rules.size,
        decoded=by_status.get("new", 0),
        known=by_status.get("known", 0),
        retired=by_status.get("delete", 0),
        quarantined={reason: n for (status, reason), (n, _) in counts.items() if status == "quarantined"},
        examples={
            reason: example for (status, reason), (_, example) in counts.items() if status in ("quarantined", "unread")
        },
        unread={reason: n for (status, reason), (n, _) in counts.items() if status == "unread"},
        read_retries=by_status.get(READ_RETRIES, 0),
        content_fingerprint=ingested.content_fingerprint,
        basis=ingested.basis,
        versions_seen=(ingested.table_version_seen, ingested.quarantine_version_seen),
        in_sync_folder=ingested.in_sync_folder,
        listing_uri=ingested.listing_uri,
        state_key=ingested.state_key,
    )


def decode_on_executors(
    spark: SparkSession,
    listed: list[dict],
    rules: DecodeRules,
    staging_uri: str,
    table_uri: str,
    progress_seconds: float,
) -> dict[tuple[str, str | None], tuple[int, str]]:
    """Run process_partition over the listed entries in balanced tasks; files per (status, reason), with an example
    path."""
    # One task per core, more for a long list; each gets a fair share of the bytes to decode.
    cores = spark.sparkContext.defaultParallelism
    groups = balanced_partitions(listed, cores * max(1, math.ceil(len(listed) / (cores * ROWS_PER_DECODE_TASK))))
    names = CHANGES_SCHEMA.names
    rows = spark.sparkContext.parallelize(groups, max(1, len(groups))).flatMap(
        lambda group: [tuple(r[n] for n in names) for r in group]
    )
    frame = spark.createDataFrame(rows, schema=from_arrow_schema(CHANGES_SCHEMA))
    ingested_at = datetime.now(UTC)
    summary = frame.mapInArrow(
        lambda batches: process_partition(batches, rules, staging_uri, table_uri, ingested_at, progress_seconds),
        SUMMARY_SCHEMA,
    )
    return count_by_status(row.asDict() for row in with_progress(len(listed), staging_uri, summary.collect))


def with_progress(total: int, staging_uri: str, decode: Callable[[], list]) -> list:
    """Run DECODE with the driver's progress line every few seconds (from the decoders' progress files), and a last
    one."""
    logger, started = stage_logger(), time.monotonic()
    with Every(
        lambda: logger.info(rate_line("resize", files_done(staging_uri), total, time.monotonic() - started, "files")),
        logger,
    ):
        rows = decode()
    logger.info(rate_line("resize", total, total, time.monotonic() - started, "files"))
    return rows


def count_by_status(rows: Iterable[dict]) -> dict[tuple[str, str | None], tuple[int, str]]:
    """The tasks' summary rows added up: files per (status, reason), with the first example path."""
    counts: dict[tuple[str, str | None], tuple[int, str]] = {}
    for row in rows:
        n, example = counts.get((row["status"], row["reason"]), (0, row["example"]))
        counts[(row["status"], row["reason"])] = (n + row["files"], example)
    return counts


def tables_now(inputs: dict[str, Any]) -> dict[str, str]:
    """Key part for resize: the versions of the tables the diff reads, so new commits run the stage again."""
    settings: Settings = inputs["settings"]
    return {
        "table version": str(Table(settings.table_uri).version()),
        "table version (quarantine)": str(Table(settings.quarantine_uri).version()),
    }


def staged_for_write(resized: Resized) -> list[str]:
    """What a resize result names that its write reads: the staging folder of its bookkeeping rows, when it staged
    any."""
    return (
        [resized.staging_uri]
        if resized.decoded or resized.known or resized.retired or resized.bad or resized.unread_files
        else []
    )


@stage(
    "resize",
    settings=stage_settings("resize"),
    facts=tables_now,
    needs=staged_for_write,
    unfinished=left_unread,
)
def resize(listed: Listed, settings: Settings) -> Resized:
    """Prefect stage: find what is new or changed at this image size, then read, hash and resize it."""
    hold_resize_mode(settings.table_uri, settings.image_size, settings.resize_mode)
    table = ImageTable.of(settings)
    ingested = diff_against_table(table, listed, scope_of(settings), settings.retire_deleted, settings.staging_uri)
    rules = DecodeRules(
        settings.image_size,
        settings.resize_mode,
        settings.max_file_bytes,
        settings.max_image_pixels,
        settings.read_attempts,
        max_seconds=settings.max_decode_seconds,
    )
    # A folder of this run's own: an identical run started at the same time must not wipe the rows this one's write
    # reads.
    folder = (
        f"resize-{ingested.content_fingerprint[:16]}-{settings.image_size}-{settings.resize_mode}-"
        f"{uuid.uuid4().hex[:12]}"
    )
    # Spark's Python workers take seconds to start; the driver decodes a short list in a fraction of that.
    return resize_images(
        table, ingested, rules, f"{settings.staging_uri}/{folder}", in_driver_up_to=settings.decode_in_driver_up_to
    )
