"""The score stage's executor side: answer one partition's images with a registered model, loaded once per Python
worker process, and write the answers as an uncommitted data file of the predictions table. This code runs inside
Spark's Python workers; the driver gets back only each answer's path, content hash and file."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import TaskContext

from imagelake.tasks.data.resize_executor import (
    PROGRESS_FOLDER,
    PROGRESS_SECONDS,
    ReadFailed,
    read_with_retries,
    report_progress,
)
from imagelake.tasks.rules.schemas import PREDICTIONS_SCHEMA

_models: dict[
    tuple[str, str | None, str], Any
] = {}  # (tracking, registry, model URI) -> the served model, for the worker process's life


@dataclass(frozen=True)
class ScoreJob:
    """What every executor needs to answer one run's images the same way."""

    model_uri: str  # models:/NAME/VERSION
    tracking_uri: str
    registry_uri: str | None
    image_size: int | None  # a table source's: its rows hold pixels at this size; None for image files
    known: frozenset[str]  # content already answered by this model version
    top_k: int = 3
    batch_size: int = 64
    read_attempts: int = 3
    read_backoff: float = 0.5
    progress: str | None = None  # folder where each partition reports how many images it has done
    max_file_bytes: int | None = None  # a file read larger than this (grown since it was listed) is not decoded
    table_uri: str | None = None  # the predictions table, whose folder the answers' data files are written into
    prefix: str = "part"  # the start of this round's data file names (the driver removes the round's uncommitted ones)
    constants: tuple[tuple[str, Any], ...] = ()  # the run's columns of every row (model, run id, source, time)


# What score_partition hands back to the driver: a line per answer, never the answer itself.
WRITTEN_SCHEMA = pa.schema([("path", pa.string()), ("sha256", pa.string()), ("data_file", pa.string())])


# Errors that say nothing final about the image: the next run tries it again rather than store them as its answer.
TRANSIENT = ("decode_timeout",)


def loaded_model(job: ScoreJob) -> Any:
    """The job's model, loaded the first time this process asks (every later partition reuses it). A Python worker
    outlives its job, so the model is known by its stores too: models:/NAME/1 of two registries are two models."""
    key = (job.tracking_uri, job.registry_uri, job.model_uri)
    if key not in _models:
        import mlflow
        import torch

        # One Spark task per core it was given: torch's threads would otherwise contend with the other tasks' for the
        # cores.
        context = TaskContext.get()
        torch.set_num_threads(max(1, context.cpus() if context is not None else 1))
        from imagelake.tasks.registry.loading import own_served_model

        mlflow.set_tracking_uri(job.tracking_uri)
        mlflow.set_registry_uri(job.registry_uri or job.tracking_uri)  # as the driver's client does (infra/tracking.py)
        # The version's program and labels, answered by this installation's served model: never the code it carries.
        folder = Path(mlflow.artifacts.download_artifacts(job.model_uri))
        name, _, version = job.model_uri.removeprefix("models:/").rpartition("/")
        _models[key] = own_served_model(folder, name, version)
    return _models[key]


def answer_rows(job: ScoreJob, items: list[tuple[str, str, Any]]) -> list[dict]:
    """(path, sha256, image) -> a predictions row each; images are file bytes, or pixels for a table source."""
    if not items:
        return []
    model = loaded_model(job)
    params = {"top_k": job.top_k}
    if job.image_size is None:
        import pandas as pd  # in the Spark task that scores, not in every flow run that imports this stage

        answers = model.predict(None, pd.DataFrame({"image": [image for _, _, image in items]}), params=params)
    else:  # decoded already, as the table stores them: (N, size, size, 3) uint8
        pixels = np.stack(
            [np.frombuffer(image, dtype=np.uint8).reshape(job.image_size, job.image_size, 3) for _, _, image in items]
        )
        answers = model.predict(None, pixels, params=params)
    return [
        {
            "path": path,
            "sha256": sha,
            "label": answer["label"],
            "probability": answer["probability"],
            "top_k": answer["top_k"] or [],
            "error": answer["error"],
        }
        for (path, sha, _), answer in zip(items, answers.to_dict("records"), strict=True)
        if is_final(answer["error"])
    ]


def is_final(error: str | None) -> bool:
    """Whether an answer may be stored as the model version's answer for its content: any but a transient error (a
    decode that ran out of time says nothing of the image; the next run tries it again)."""
    return not (error or "").startswith(TRANSIENT)


class AnswerFile:
    """One task's answers, written as they come into a data file of the predictions table (created with its first
    answer; uncommitted, no reader sees it), in the table's schema with the run's constants."""

    def __init__(self, job: ScoreJob, partition: int) -> None:
        self.job = job
        self.name = f"{job.prefix}-{partition:05d}-{uuid.uuid4()}-c000.imagelake.parquet"
        self.handle = self.writer = None

    def write(self, rows: list[dict]) -> Iterator[pa.RecordBatch]:
        """Append ROWS (answered rows) to the file; yields the driver's line for each."""
        if not rows:
            return
        if self.writer is None:
            fs, folder = fsspec.core.url_to_fs(self.job.table_uri)
            fs.makedirs(folder, exist_ok=True)
            self.handle = fs.open(f"{folder}/{self.name}", "wb")
            self.writer = pq.ParquetWriter(self.handle, PREDICTIONS_SCHEMA)
        constants = dict(self.job.constants)
        self.writer.write_table(pa.Table.from_pylist([{**row, **constants} for row in rows], schema=PREDICTIONS_SCHEMA))
        yield pa.RecordBatch.from_pylist(
            [{"path": row["path"], "sha256": row["sha256"], "data_file": self.name} for row in rows],
            schema=WRITTEN_SCHEMA,
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.handle.close()


def score_partition(
    batches: Iterator[pa.RecordBatch], job: ScoreJob, partition: int | None = None
) -> Iterator[pa.RecordBatch]:
    """mapInArrow's function: rows of (path, sha256, image) in; answers written into one data file of the predictions
    table, and a (path, sha256, data_file) line out for each. A folder's rows come with neither image nor sha256: the
    file is read here. Content this model version answered before is skipped; a file that cannot be read in all its
    attempts is left out (no row), so a later run tries it again."""
    partition = TaskContext.get().partitionId() if partition is None else partition
    fs = fsspec.core.url_to_fs(job.progress)[0] if job.progress else None
    done, reported = 0, time.monotonic()
    pending: list[tuple[str, str, Any]] = []
    out = AnswerFile(job, partition)
    try:
        for batch in batches:
            for row in batch.to_pylist():
                image, sha = row["image"], row["sha256"]
                if image is None:
                    try:
                        image, _ = read_with_retries(row["path"], job.read_attempts, job.read_backoff)
                    except (ReadFailed, FileNotFoundError):
                        continue
                    sha = hashlib.sha256(image).hexdigest()
                if sha in job.known:
                    continue
                if job.max_file_bytes and row["image"] is None and len(image) > job.max_file_bytes:
                    error = f"file_too_large: {len(image)} bytes > max_file_bytes"
                    too_large = {"label": None, "probability": None, "top_k": [], "error": error}
                    yield from out.write([{**too_large, "path": row["path"], "sha256": sha}])
                    continue
                pending.append((row["path"], sha, image))
                if len(pending) == job.batch_size:
                    yield from out.write(answer_rows(job, pending))
                    done += len(pending)
                    pending.clear()
                if fs is not None and time.monotonic() - reported >= PROGRESS_SECONDS:
                    report_progress(fs, f"{job.progress}/{PROGRESS_FOLDER}/{partition:05d}", done)
                    reported = time.monotonic()
        if pending:
            yield from out.write(answer_rows(job, pending))
            done += len(pending)
    finally:
        out.close()
    if fs is not None:
        report_progress(fs, f"{job.progress}/{PROGRESS_FOLDER}/{partition:05d}", done)
