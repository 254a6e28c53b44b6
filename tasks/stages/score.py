"""Score: a registered model's answers for a folder, an object-store prefix or a Delta table version, made on Spark's
executors (tasks/inference/batch_scorer.py) with the model loaded once per worker process, and kept in the Delta table
`predictions`: one row per image content and model version, so a run answers only what is new to that version."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect.cache_policies import NO_CACHE
from prefect.utilities.hashing import hash_objects
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from imagelake.infra.delta import Table, table_exists
from imagelake.infra.prefect_env import fence, one_at_a_time
from imagelake.infra.settings import Settings, stage_settings
from imagelake.infra.spark import spark_session
from imagelake.infra.tracking import mlflow_client
from imagelake.tasks.data.listing import link_issue, modified_seconds, source_uri, walk_files
from imagelake.tasks.data.resize_executor import PROGRESS_FOLDER, files_done
from imagelake.tasks.inference.batch_scorer import WRITTEN_SCHEMA, ScoreJob, score_partition
from imagelake.tasks.progress import Every, rate_line, stage_logger
from imagelake.tasks.rules.schemas import PREDICTIONS_SCHEMA
from imagelake.tasks.stage import stage

ROWS_PER_SCORE_TASK = 2_000  # images per Spark task, beyond one task per core
_TABLE_VERSION = re.compile(r"^(?P<uri>.+)@(?P<version>\d+)$")


class ScoreSourceError(ValueError):
    """The source to score is neither a folder of images nor a Delta table of them."""


def table_source(source: str) -> tuple[str, int | None] | None:
    """(table URI, version or None for the current one) when SOURCE names a Delta table (`URI[@VERSION]`), else None."""
    match = _TABLE_VERSION.match(source)
    uri, version = (match["uri"], int(match["version"])) if match else (source, None)
    uri = source_uri(uri) if "://" not in uri and fsspec.core.url_to_fs(uri)[0].exists(uri) else uri
    if table_exists(uri):
        return uri, version
    if match:
        raise ScoreSourceError(
            f"--source {source}: {uri} is not a Delta table, so it has no version {version}; give a table's "
            "folder@VERSION, or a folder of images"
        )
    return None


def image_files(uri: str, extensions: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every image file under a folder or object-store prefix (any layout; labels are not needed to score), as its URI
    and the store's info on it."""
    fs, root = fsspec.core.url_to_fs(uri)
    suffixes = tuple(e.lower() for e in extensions)
    for path, info in walk_files(fs, root):
        if path.lower().endswith(suffixes) and "/_" not in path[len(root) :]:
            yield fs.unstrip_protocol(path), {**info, "issue": link_issue(path, root, info)}


def unread_reason(info: dict[str, Any], max_bytes: int | None) -> str | None:
    """Why scoring does not read a listed file, with ingest's reasons: a link out of the source or to nothing, an empty
    file, one over max_file_bytes. Such a file is not read: it gets a row whose error names the reason (unread_rows),
    and is looked at again by no run until it changes."""
    size = int(info.get("size") or 0)
    if info.get("issue"):
        return info["issue"]
    if size == 0:
        return "empty_file"
    return "file_too_large" if max_bytes and size > max_bytes else None


UNREAD_WHY = {
    "file_too_large": "the file is larger than max_file_bytes",
    "empty_file": "the file is empty",
    "symlink_outside_source": "a link leading out of the source folder is not followed",
    "unreadable": "a link to nothing",
}


def unread_rows(
    listed: list[tuple[str, dict[str, Any]]], max_bytes: int | None, known: frozenset[str], run: dict[str, Any]
) -> list[dict[str, Any]]:
    """A predictions row for each listed file scoring does not read (unread_reason), whose error says why: every listed
    file gets a row. Its sha256 stands for the file as listed (`unread:` and a digest of its path, size and time),
    never read: the same file unchanged gets no second row, a changed one is looked at again."""
    rows = []
    for path, info in listed:
        reason = unread_reason(info, max_bytes)
        if reason is None:
            continue
        size = int(info.get("size") or 0)
        marker = "unread:" + hashlib.sha256(f"{path}\0{size}\0{modified_seconds(info)}".encode()).hexdigest()
        if marker in known:
            continue
        why = UNREAD_WHY.get(reason, "not read")
        if reason == "file_too_large":
            why = f"{size} bytes > max_file_bytes {max_bytes}"
        row = {"path": path, "sha256": marker, "label": None, "probability": None, "top_k": [], "error": None}
        rows.append({**row, "error": f"{reason}: {why}", **run})
    return rows


def answered_before(settings: Settings, spark: SparkSession, run_id: str) -> frozenset[str]:
    """The content this model version has answered already: the predictions table's sha256 for its MLflow run (never
    its name and number, which a re-created model issues again). Rows from before the run id was kept have none, and
    are answered again once."""
    predictions = Table(settings.predictions_uri, spark)
    if not predictions.exists() or "model_run_id" not in predictions.columns():
        return frozenset()
    rows = predictions.read(["sha256"], F.col("model_run_id") == run_id)
    return frozenset(rows.column("sha256").to_pylist())


def score_images(source: str, model: str, settings: Settings) -> dict[str, Any]:
    """Answer every image of SOURCE that MODEL (NAME@ALIAS or NAME/VERSION) has not answered before, and append the
    answers to the predictions table: written by the executors, committed every score_commit_images images, so that
    a run that fails keeps what it committed and the next goes on from there. Returns what it did.

    Two runs of one model version at once (the CLI beside the nightly) take turns on the predictions table, so the
    second reads what the first committed and answers none of the same content again."""
    from imagelake.tasks.registry.lineage import resolve

    client = mlflow_client(settings)
    name, version = resolve(client, model)
    what = f"score {settings.predictions_uri} {name}/{version}"
    with one_at_a_time(settings, what, timeout=None):
        return score_as_one(source, client, name, version, settings, what)


def score_as_one(source: str, client: Any, name: str, version: str, settings: Settings, what: str) -> dict[str, Any]:
    """score_images' work, under the lock on WHAT."""
    meta = served_meta(client, name, version)
    spark = spark_session(settings)
    run_id = client.get_model_version(name, version).run_id
    known = answered_before(settings, spark, run_id)
    unread: dict[str, int] = {}  # files of a folder source not read, by ingest's reasons
    table = table_source(source)
    if table is not None:
        uri, table_version = table
        images = Table(uri, spark)
        table_version = images.version() if table_version is None else table_version
        frame = (
            images.frame(table_version)
            .where(F.col("image_size") == meta["image_size"])
            .select("path", "sha256", "image")
        )
        size, where, files = meta["image_size"], f"{uri}@{table_version}", None
        total = frame.count()
        if not total:
            raise ScoreSourceError(
                f"--source {source}: version {table_version} holds no images at the model's size {size}; "
                "score the source folder instead"
            )
    else:
        uri, table_version, size = source_uri(source), None, None
        listed = list(image_files(uri, settings.image_extensions))
        files = [path for path, info in listed if unread_reason(info, settings.max_file_bytes) is None]
        for reason in (unread_reason(info, settings.max_file_bytes) for _, info in listed):
            if reason:
                unread[reason] = unread.get(reason, 0) + 1
        if not listed:
            raise ScoreSourceError(
                f"--source {source} holds no image files ({', '.join(settings.image_extensions)}): give a "
                "folder or prefix of images, or a Delta table"
            )
        frame, images, where, total = None, None, uri, len(files)
    run = {
        "model_name": name,
        "model_version": int(version),
        "model_run_id": run_id,
        "source": where,
        "source_version": table_version,
        "scored_at": datetime.now(UTC),
    }
    job = ScoreJob(
        f"models:/{name}/{version}",
        settings.tracking_uri,
        settings.mlflow_registry_uri,
        size,
        known,
        settings.score_top_k,
        read_attempts=settings.read_attempts,
        max_file_bytes=settings.max_file_bytes,
        table_uri=settings.predictions_uri,
        constants=tuple(run.items()),
    )
    predictions = Table(settings.predictions_uri)
    if predictions.exists():
        predictions.add_columns(PREDICTIONS_SCHEMA)  # a predictions table from before model_run_id gets it first
    answered = errors = 0
    committed = None
    rounds = list(score_rounds(spark, frame, files, images, table_version, size, total, settings.score_commit_images))
    logger, started, done = stage_logger(), time.monotonic(), 0
    for number, (part, count) in enumerate(rounds):
        round_job = replace(
            job,
            known=frozenset(known),
            prefix=f"part-score-{uuid.uuid4().hex[:12]}",
            progress=f"{settings.staging_uri}/score-{uuid.uuid4().hex[:12]}",
        )
        files_kept = answer_round(spark, part, count, round_job, (logger, started, done, total))
        done += count
        if files_kept.written:
            fence(what)  # the lock's lease lapsed: another run of this version may be committing the same answers
            committed = predictions.commit_files(PREDICTIONS_SCHEMA, files_kept.written)
            known |= files_kept.content
            answered += files_kept.rows
            errors += files_kept.errors
        if len(rounds) > 1:
            logger.info(f"score: round {number + 1} of {len(rounds)} committed ({answered} answers so far)")
    if files is not None:
        unanswered = unread_rows(listed, settings.max_file_bytes, frozenset(known), run)
        if unanswered:
            committed = commit_rows(predictions, unanswered, what)
            errors += len(unanswered)
    logger.info(rate_line("score", total, total, time.monotonic() - started, "images"))
    return {
        "model": f"{name}/{version}",
        "source": where,
        "images": total,
        "answered": answered,
        "errors": errors,
        "unread": unread,
        "predictions_uri": settings.predictions_uri,
        "predictions_version": committed,
    }


def commit_rows(predictions: Table, rows: list[dict[str, Any]], what: str) -> int:
    """Write ROWS as one data file of the predictions table and commit it (under the lock on WHAT); the commit's
    version."""
    fs, folder = fsspec.core.url_to_fs(predictions.uri)
    fs.makedirs(folder, exist_ok=True)
    name = f"part-unread-{uuid.uuid4().hex}-c000.imagelake.parquet"
    with fs.open(f"{folder}/{name}", "wb") as out:
        pq.write_table(pa.Table.from_pylist(rows, schema=PREDICTIONS_SCHEMA), out)
    fence(what)
    return predictions.commit_files(PREDICTIONS_SCHEMA, [name])


def score_rounds(
    spark: SparkSession,
    frame: Any,
    files: list[str] | None,
    images: Table | None,
    table_version: int | None,
    size: int | None,
    total: int,
    per_round: int,
) -> Iterator[tuple[Any, int]]:
    """The run's work in rounds of about PER_ROUND images, each committed before the next starts: (frame, images) each.
    A folder's FILES go in path order; a table version's data files (FRAME the whole version) in groups."""
    if not total:
        return
    rounds = math.ceil(total / per_round)
    if files is not None:
        ordered = sorted(files)
        for start in range(0, len(ordered), per_round):
            part = ordered[start : start + per_round]
            yield (
                spark.createDataFrame(
                    [(path, None, None) for path in part], "path string, sha256 string, image binary"
                ),
                len(part),
            )
        return
    if rounds == 1:
        yield frame, total
        return
    names = images.files(table_version)
    step = math.ceil(len(names) / rounds)
    for start in range(0, len(names), step):
        part = images.frame(table_version, files=names[start : start + step]).where(F.col("image_size") == size)
        part = part.select("path", "sha256", "image")
        yield part, part.count()


@dataclass
class Written:
    """A round's answers as the executors wrote them: the data files to commit, and what they hold."""

    written: list[str]
    content: set[str]
    rows: int
    errors: int


def answer_round(spark: SparkSession, frame: Any, count: int, job: ScoreJob, progress: tuple) -> Written:
    """One round: score_partition over FRAME in tasks of at most ROWS_PER_SCORE_TASK images (one per core at least),
    answers written by the executors into data files of the predictions table; the driver gets a (path, sha256, file)
    line per answer, keeps one answer per content (the first path in path order; rewriting a file that held a
    second), and removes every file of the round it does not return."""
    logger, started, done_before, total = progress
    fs, folder = fsspec.core.url_to_fs(job.progress)
    fs.makedirs(f"{folder}/{PROGRESS_FOLDER}", exist_ok=True)
    cores = spark.sparkContext.defaultParallelism
    tasks = max(1, min(count, cores * max(1, math.ceil(count / (cores * ROWS_PER_SCORE_TASK)))))
    lines = frame.repartition(tasks).mapInArrow(
        lambda batches: score_partition(batches, job), from_arrow_schema(WRITTEN_SCHEMA)
    )
    try:
        with Every(
            lambda: logger.info(
                rate_line("score", done_before + files_done(job.progress), total, time.monotonic() - started, "images")
            ),
            logger,
        ):
            written = pa.Table.from_pylist([row.asDict() for row in lines.collect()], schema=WRITTEN_SCHEMA)
        return keep_one_per_content(job, written)
    except BaseException:
        remove_round_files(job, [])
        raise
    finally:
        fs.rm(folder, recursive=True)


def keep_one_per_content(job: ScoreJob, written: pa.Table) -> Written:
    """Drop the rows of a content written twice in a round (the same image at two paths: the first path in path order
    stays) from their data files, and every data file of the round not among the written ones (a retried task's)."""
    table_fs, table_folder = fsspec.core.url_to_fs(job.table_uri)
    written = written.sort_by([("sha256", "ascending"), ("path", "ascending")])
    sha = written.column("sha256").to_pylist()
    paths = written.column("path").to_pylist()
    data_files = written.column("data_file").to_pylist()
    second = {(data_files[i], paths[i]) for i in range(1, len(sha)) if sha[i] == sha[i - 1]}
    kept = sorted(set(data_files))
    for name in sorted({name for name, _ in second}):
        rows = pq.read_table(table_fs.open(f"{table_folder}/{name}", "rb"), schema=PREDICTIONS_SCHEMA)
        drop = {path for file, path in second if file == name}
        rows = rows.filter(pc.invert(pc.is_in(rows.column("path"), pa.array(sorted(drop)))))
        kept.remove(name)
        if rows.num_rows:
            renamed = f"{job.prefix}-{uuid.uuid4()}-c000.imagelake.parquet"
            with table_fs.open(f"{table_folder}/{renamed}", "wb") as out:
                pq.write_table(rows, out)
            kept.append(renamed)
    remove_round_files(job, kept)
    clean = 0  # rows with no error
    for name in kept:
        with table_fs.open(f"{table_folder}/{name}", "rb") as handle:
            clean += pq.read_table(handle, columns=["error"]).column("error").null_count
    rows = len(sha) - len(second)
    return Written(sorted(kept), set(sha), rows, rows - clean)


def remove_round_files(job: ScoreJob, keep: list[str]) -> None:
    """Delete the round's data files (by its name prefix) other than KEEP: none was committed."""
    fs, folder = fsspec.core.url_to_fs(job.table_uri)
    for path in fs.glob(f"{folder}/{job.prefix}-*"):
        if path.rsplit("/", 1)[-1] not in keep:
            fs.rm(path)


def served_meta(client: Any, name: str, version: str) -> dict[str, Any]:
    """The served model's meta (labels, image size, resize mode) from its files; a version older than the served pyfunc
    is refused."""
    from imagelake.tasks.registry.loading import check_program, model_files, served_files

    folder = model_files(client, name, version)
    found = served_files(folder)
    if found is None:
        raise ScoreSourceError(
            f"{name} version {version} was registered before models answered image bytes: register it again "
            "(imagelake retrain) to score with it"
        )
    check_program(found[0], name, version)  # before any executor loads it
    return json.loads(found[1].read_text())


def source_state(inputs: dict[str, Any]) -> dict[str, str]:
    """Key part for score: the source as it is now (a table's version, or every image file's path, size and
    modification time), and the model version's MLflow run. A run answers all of its source that is new to the model
    version, so the same source and version again (its result reused) has nothing new to answer, as long as the
    predictions table is still there (`needs`). The version is known by its run, not by its name and number, which a
    model deleted and registered again issues anew."""
    settings: Settings = inputs["settings"]
    try:
        table = table_source(inputs["source"])
        if table is not None:
            state = f"table {table[0]}@{table[1] if table[1] is not None else Table(table[0]).version()}"
        else:
            files = image_files(source_uri(inputs["source"]), settings.image_extensions)
            state = hash_objects(
                [(path, info.get("size"), info.get("mtime") or info.get("LastModified")) for path, info in files]
            )
    except (
        ScoreSourceError,
        OSError,
        ValueError,
    ):  # the stage itself raises it, where the run reports a stage's failure
        state = "unreadable"
    return {"source": str(state), "model_run": model_run(inputs["model"], settings)}


def model_run(model: str, settings: Settings) -> str:
    """The MLflow run of the model version MODEL (NAME/VERSION), or "unknown" where the registry does not say (the stage
    itself then fails, naming why)."""
    name, _, version = model.rpartition("/")
    try:
        return str(mlflow_client(settings).get_model_version(name, version).run_id)
    except Exception:  # noqa: BLE001 - a key part; the stage reports the registry's error itself
        return "unknown"


@stage("score-model", cache_policy=NO_CACHE)
def score_model(model: str, settings: Settings) -> str:
    """Prefect stage: the registered version MODEL names now (NAME@ALIAS moves), as NAME/VERSION."""
    from imagelake.tasks.registry.lineage import resolve

    name, version = resolve(mlflow_client(settings), model)
    return f"{name}/{version}"


@stage(
    "score",
    settings=stage_settings("score"),
    facts=source_state,
    needs=lambda scored: (
        [f"{scored['predictions_uri']}/_delta_log"] if scored["predictions_version"] is not None else []
    ),
)
def score(source: str, model: str, settings: Settings) -> dict[str, Any]:
    """Prefect stage: answer what is new in SOURCE to the model version MODEL (NAME/VERSION) into the predictions
    table."""
    return score_images(source, model, settings)
