"""Delta tables: the engine choice (Spark's Delta where its jars load, delta-rs everywhere else) and `Table`, the one
place where the two engines differ; below it, the delta-rs commits, merges and reads it uses."""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import ColumnProperties, CommitProperties, DeltaTable, WriterProperties, write_deltalake
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import AddAction, RemoveAction, create_table_with_add_actions
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from infra.compat import collect_arrow, delta_log_mentions
from infra.errors import PermanentError
from infra.settings import Settings
from infra.spark import delta_jars_loaded, spark_session

Engine = Literal["delta-rs", "spark"]
WRITE_ID_KEY = "imagelake.write_id"


class DeltaEngineUnavailable(PermanentError, RuntimeError):
    """The Delta engine the settings force cannot run here."""


def choose_engine(settings: Settings, spark: SparkSession) -> Engine:
    """Spark's Delta if its jars load (or forced), delta-rs otherwise."""
    jars = delta_jars_loaded(spark)
    if settings.delta_writer == "spark" and not jars:
        raise DeltaEngineUnavailable(
            "delta_writer is 'spark' but Spark cannot load Delta's classes (io.delta.sql.DeltaSparkSessionExtension): "
            "add the delta-spark jars through IMAGELAKE_SPARK_JARS, or set IMAGELAKE_DELTA_WRITER=auto to use delta-rs."
        )
    if settings.delta_writer == "delta-rs":
        return "delta-rs"
    return "spark" if jars else "delta-rs"


def append_arrow(table_uri: str, batches: pa.RecordBatchReader | pa.Table) -> int:
    """Append a stream of Arrow batches with delta-rs in one commit; return the version that commit made."""
    write_id = uuid.uuid4().hex
    write_deltalake(
        table_uri,
        batches,
        mode="append",
        commit_properties=CommitProperties(custom_metadata={WRITE_ID_KEY: write_id}),
    )
    return _version_of_write(table_uri, write_id)


MERGE_KEY = "t.path = s.path AND t.image_size = s.image_size"
# Pixels are large unique values: dictionaries and min/max statistics on them only cost time.
IMAGE_WRITER = WriterProperties(column_properties={"image": ColumnProperties(dictionary_enabled=False, statistics_enabled="NONE")})
CONFLICT_RETRIES = 8


def merge_arrow(table_uri: str, changes: pa.Table) -> int:
    """Upsert and delete rows keyed on (path, image_size) with delta-rs in one commit; return its version.

    `changes` carries an `_action` column ('upsert' or 'delete'). Concurrent writers conflict
    only at commit time: the losing one re-reads the table and merges again.
    """
    write_id = uuid.uuid4().hex
    properties = CommitProperties(custom_metadata={WRITE_ID_KEY: write_id})
    for attempt in range(CONFLICT_RETRIES):
        try:
            if not table_exists(table_uri):
                rows = changes.filter(pc.equal(changes["_action"], "upsert")).drop_columns(["_action"])
                write_deltalake(table_uri, rows, mode="append", commit_properties=properties, writer_properties=IMAGE_WRITER)
            else:
                (
                    DeltaTable(table_uri)
                    .merge(changes, MERGE_KEY, source_alias="s", target_alias="t", commit_properties=properties, writer_properties=IMAGE_WRITER)
                    .when_matched_update_all(predicate="s._action = 'upsert'", except_cols=["_action"])
                    .when_matched_delete(predicate="s._action = 'delete'")
                    .when_not_matched_insert_all(predicate="s._action = 'upsert'", except_cols=["_action"])
                    .execute()
                )
            return _version_of_write(table_uri, write_id)
        except (CommitFailedError, DeltaError) as exc:
            if attempt == CONFLICT_RETRIES - 1 or not _is_conflict(exc):
                raise
            time.sleep(0.2 * (attempt + 1) + random.random() * 0.3)
    raise AssertionError("unreachable")


def commit_files(table_uri: str, schema: pa.Schema, files: list[str]) -> int:
    """Commit Parquet files already written in the table's folder as one append (creating the table if needed).

    This is how executors' output lands without being rewritten: the files were written in the
    table's schema, and until this commit no reader sees them. Returns the commit's version.
    """
    fs, folder = fsspec.core.url_to_fs(table_uri)
    actions = [_add_action(fs, folder, name) for name in files]
    write_id = uuid.uuid4().hex
    properties = CommitProperties(custom_metadata={WRITE_ID_KEY: write_id})
    for attempt in range(CONFLICT_RETRIES):
        creating = not table_exists(table_uri)
        try:
            if creating:
                create_table_with_add_actions(table_uri, DeltaSchema.from_arrow(schema), actions, mode="append", commit_properties=properties)
            else:
                DeltaTable(table_uri).create_write_transaction(actions, "append", DeltaSchema.from_arrow(schema), commit_properties=properties)
            return _version_of_write(table_uri, write_id)
        except (CommitFailedError, DeltaError) as exc:
            # Two first writes race to create the table: the loser (whatever delta-rs calls its error) appends to the winner's.
            lost_create = creating and table_exists(table_uri)
            if attempt == CONFLICT_RETRIES - 1 or not (lost_create or _is_conflict(exc)):
                raise
            time.sleep(0.1 * (attempt + 1) + random.random() * 0.2)
    raise AssertionError("unreachable")


def uncommit_files(table_uri: str, files: list[str]) -> int:
    """Remove files this run committed (one commit); their rows leave the current version, older versions keep them."""
    now = int(time.time() * 1000)
    write_id = uuid.uuid4().hex
    table = DeltaTable(table_uri)
    actions = [RemoveAction(name, True, now) for name in files]
    table.create_write_transaction(actions, "append", table.schema(), commit_properties=CommitProperties(custom_metadata={WRITE_ID_KEY: write_id}))
    return _version_of_write(table_uri, write_id)


def ever_committed(table_uri: str, files: list[str]) -> set[str]:
    """Which of these data files any commit in the table's log added (the log's JSON commits are searched for their names)."""
    if not files or not table_exists(table_uri):
        return set()
    return delta_log_mentions(table_uri, files)


def _add_action(fs, folder: str, name: str) -> AddAction:
    """An add action with the statistics Delta uses to skip files: row count, and min/max of the small typed columns."""
    info = fs.info(f"{folder}/{name}")
    with fs.open(f"{folder}/{name}", "rb") as handle:
        meta = pq.ParquetFile(handle).metadata
    stats: dict = {"numRecords": meta.num_rows, "minValues": {}, "maxValues": {}, "nullCount": {}}
    for index in range(meta.num_columns):
        column = meta.schema.column(index)
        if column.path not in STATS_COLUMNS:
            continue
        groups = [meta.row_group(g).column(index).statistics for g in range(meta.num_row_groups)]
        if any(g is None for g in groups):
            continue
        stats["nullCount"][column.path] = sum(g.null_count for g in groups)
        valued = [g for g in groups if g.has_min_max]
        if valued:
            low, high = min(g.min for g in valued), max(g.max for g in valued)
            stats["minValues"][column.path] = low.isoformat() if hasattr(low, "isoformat") else low
            stats["maxValues"][column.path] = high.isoformat() if hasattr(high, "isoformat") else high
    mtime = info.get("mtime") or info.get("LastModified") or time.time()
    mtime = mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)
    return AddAction(name, int(info["size"]), {}, int(mtime * 1000), True, json.dumps(stats))


# Columns whose min/max go into a committed file's statistics (exact values of simple types).
STATS_COLUMNS = ("date", "image_size", "size", "width", "height")


def _is_conflict(exc: Exception) -> bool:
    text = str(exc).lower()
    return isinstance(exc, CommitFailedError) or "conflict" in text or "version already exists" in text or "already exists" in text


def merge_spark(spark: SparkSession, table_uri: str, changes: pa.Table) -> int:
    """The same merge through delta-spark, where Spark's Delta jars load."""
    from delta.tables import DeltaTable as SparkDeltaTable

    write_id = uuid.uuid4().hex
    source = spark.createDataFrame(changes.to_pandas())
    spark.conf.set("spark.databricks.delta.commitInfo.userMetadata", write_id)
    try:
        if not SparkDeltaTable.isDeltaTable(spark, table_uri):
            source.where("_action = 'upsert'").drop("_action").write.format("delta").mode("append").save(table_uri)
        else:
            (
                SparkDeltaTable.forPath(spark, table_uri).alias("t")
                .merge(source.alias("s"), MERGE_KEY)
                .whenMatchedUpdate(condition="s._action = 'upsert'", set={c: f"s.`{c}`" for c in changes.column_names if c != "_action"})
                .whenMatchedDelete(condition="s._action = 'delete'")
                .whenNotMatchedInsert(condition="s._action = 'upsert'", values={c: f"s.`{c}`" for c in changes.column_names if c != "_action"})
                .execute()
            )
    finally:
        spark.conf.unset("spark.databricks.delta.commitInfo.userMetadata")
    row = spark.sql(f"DESCRIBE HISTORY delta.`{table_uri}`").where(F.col("userMetadata") == write_id).select("version").first()
    return int(row["version"])


def _version_of_write(table_uri: str, write_id: str) -> int:
    # Another writer may have committed since ours: find our commit by its id, not by "latest".
    for commit in DeltaTable(table_uri).history():
        if commit.get(WRITE_ID_KEY) == write_id:
            return int(commit["version"])
    raise RuntimeError(f"the commit of write {write_id} is missing from the history of {table_uri}")


def read_version(spark: SparkSession, table_uri: str, version: int, engine: Engine) -> DataFrame:
    """The table exactly as it was at `version`, as a Spark DataFrame."""
    if engine == "spark":
        return spark.read.format("delta").option("versionAsOf", version).load(table_uri)
    # Through the log: a plain Parquet read of the folder would also see files later commits removed.
    files = DeltaTable(table_uri, version=version).file_uris()
    if not files:
        raise ValueError(f"Delta table {table_uri} has no data files at version {version}")
    return spark.read.parquet(*files)


def read_current(
    spark: SparkSession, table_uri: str, engine: Engine, columns: list[str], where: Column | None = None, version: int | None = None
) -> pa.Table:
    """Some columns of the table's current version (or of `version`), as Arrow on the driver (empty if there is no table).

    Spark reads the files: delta-rs rewrites (merge, optimize) store Arrow view types in the
    Parquet metadata, which the pyarrow that Petastorm needs (14) cannot open.
    """
    if not table_exists(table_uri):
        return pa.table({name: pa.array([], pa.string()) for name in columns})
    frame = read_version(spark, table_uri, DeltaTable(table_uri).version() if version is None else version, engine).select(*columns)
    if where is not None:
        frame = frame.where(where)
    batches = collect_arrow(frame)  # Spark 3.5's only Arrow collect (private: see infra/compat.py)
    return pa.Table.from_batches(batches) if batches else pa.table({name: pa.array([], pa.string()) for name in columns})


def table_version(table_uri: str) -> int | None:
    """The Delta table's current version, or None before its first write."""
    return DeltaTable(table_uri).version() if table_exists(table_uri) else None


def table_exists(table_uri: str) -> bool:
    """Whether a Delta table is at this URI."""
    try:
        DeltaTable(table_uri)
    except TableNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class Table:
    """One Delta table and the engine that reads it and merges into it: the one place where delta-rs and Spark's Delta differ.

    Spark reads the data files either way (through Spark's Delta source, or through the delta-rs log's file list);
    merges run in the engine; appends of small tables, commits of files already written, and maintenance use delta-rs.
    """

    uri: str
    spark: SparkSession | None = None  # None: a table that is only appended to or maintained, never read here
    engine: Engine = "delta-rs"

    @classmethod
    def open(cls, uri: str, settings: Settings, engine: Engine | None = None) -> "Table":
        """The table at URI with this process's Spark session; the engine is the settings' choice unless given."""
        spark = spark_session(settings)
        return cls(uri, spark, engine or choose_engine(settings, spark))

    def exists(self) -> bool:
        return table_exists(self.uri)

    def version(self) -> int | None:
        """The current version, or None before the first write."""
        return table_version(self.uri)

    def frame(self, version: int | None = None) -> DataFrame:
        """The table at VERSION (default: the current one) as a Spark DataFrame."""
        return read_version(self._reader(), self.uri, DeltaTable(self.uri).version() if version is None else version, self.engine)

    def read(self, columns: list[str], where: Column | None = None, version: int | None = None) -> pa.Table:
        """Some columns at the current version (or VERSION), as Arrow on the driver; empty if there is no table."""
        return read_current(self._reader(), self.uri, self.engine, columns, where, version)

    def _reader(self) -> SparkSession:
        if self.spark is None:
            raise RuntimeError(f"table {self.uri} was opened without a Spark session, which reading it needs")
        return self.spark

    @property
    def commits_files(self) -> bool:
        """Whether Parquet files already written in the table's folder can be committed as they are (delta-rs' write
        transactions); with Spark's Delta the rows are merged instead."""
        return self.engine == "delta-rs"

    def append(self, rows: pa.Table | pa.RecordBatchReader) -> int:
        """Append rows in one commit; return its version."""
        return append_arrow(self.uri, rows)

    def merge(self, changes: pa.Table) -> int:
        """Upsert and delete rows keyed on (path, image_size) (`_action` column) in one commit; return its version."""
        return merge_spark(self.spark, self.uri, changes) if self.engine == "spark" else merge_arrow(self.uri, changes)

    def commit_files(self, schema: pa.Schema, files: list[str]) -> int:
        return commit_files(self.uri, schema, files)

    def uncommit_files(self, files: list[str]) -> int:
        return uncommit_files(self.uri, files)

    def ever_committed(self, files: list[str]) -> set[str]:
        return ever_committed(self.uri, files)

    def compact(self) -> dict:
        """Rewrite small files into fewer large ones (a new version with the same rows)."""
        metrics = DeltaTable(self.uri).optimize.compact()
        return {"files_added": metrics.get("numFilesAdded", 0), "files_removed": metrics.get("numFilesRemoved", 0)}

    def vacuum(self, retention_hours: float, keep_versions: list[int]) -> list[str]:
        """Delete files no longer referenced by the recent versions or by any version in KEEP_VERSIONS.

        Full mode also deletes files that no commit ever added and that are older than the retention:
        data files left by a run killed between its resize and its write.
        """
        return DeltaTable(self.uri).vacuum(
            retention_hours=math.ceil(retention_hours), dry_run=False, enforce_retention_duration=False, keep_versions=keep_versions, full=True
        )
