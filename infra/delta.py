"""Delta tables: the engine choice (Spark's Delta where its jars load, delta-rs everywhere else) and `Table`, the one
place where the two engines differ; below it, the delta-rs commits, merges and reads it uses."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
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
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from imagelake.infra.compat import collect_arrow, delta_log_commits, delta_log_mentions
from imagelake.infra.errors import PermanentError
from imagelake.infra.settings import Settings
from imagelake.infra.spark import SparkSource, delta_jars_loaded, on_demand, s3_endpoint, session_of

Engine = Literal["delta-rs", "spark"]
WRITE_ID_KEY = "imagelake.write_id"


class DeltaEngineUnavailable(PermanentError, RuntimeError):
    """The Delta engine the settings force cannot run here."""


def choose_engine(settings: Settings, spark: SparkSource) -> Engine:
    """The Delta engine for reads, merges, compaction, vacuum and history: the settings' `delta_writer`.

    "auto" is delta-rs on an embedded Spark (local[...]), where bench/delta_ops.py measured it faster at every
    one of those operations, and Spark's Delta on a Spark cluster whose driver loads Delta's jars, where that
    work runs on the executors instead of the driver. SPARK is asked only where the answer depends on its jars.
    """
    known = engine_without_spark(settings)
    if known is not None:
        return known
    jars = delta_jars_loaded(session_of(spark))
    if settings.delta_writer == "spark" and not jars:
        raise DeltaEngineUnavailable(
            "delta_writer is 'spark' but Spark cannot load Delta's classes (io.delta.sql.DeltaSparkSessionExtension): "
            "run `make install` (it fetches Delta's jars with mvn), or list them in IMAGELAKE_SPARK_JARS, "
            "or set IMAGELAKE_DELTA_WRITER=auto to use delta-rs."
        )
    if settings.delta_writer != "auto":
        return settings.delta_writer
    return "spark" if jars and not settings.spark_master.startswith("local") else "delta-rs"


def engine_without_spark(settings: Settings) -> Engine | None:
    """The engine `choose_engine` picks where Spark's jars do not matter: delta-rs when the settings name it, or name
    "auto" on an embedded Spark. None where Spark must be asked (delta_writer=spark, or auto on a Spark cluster): the
    answer is the same as Spark's, without the seconds a process takes to start Spark only to be told."""
    if settings.delta_writer == "delta-rs" or (
        settings.delta_writer == "auto" and settings.spark_master.startswith("local")
    ):
        return "delta-rs"
    return None


def spark_merge_bound(settings: Settings) -> int | None:
    """Where delta_writer=auto makes delta-rs the engine (an embedded Spark), the most new rows a merge leaves to
    delta-rs, which gathers them in the driver: a larger one goes through Spark's Delta (`Table.merge`). None elsewhere:
    an engine named, or Spark's Delta already, takes every merge."""
    auto_rs = settings.delta_writer == "auto" and engine_without_spark(settings) == "delta-rs"
    return settings.spark_merge_min_rows if auto_rs else None


def storage_options(table_uri: str) -> dict[str, str] | None:
    """delta-rs' options for a table on S3. Credentials, region and endpoint come from the environment (AWS_*), which
    delta-rs reads itself; commits use conditional puts (If-None-Match), so two writers never both take a version."""
    if not table_uri.startswith(("s3://", "s3a://")):
        return None
    options = {"AWS_CONDITIONAL_PUT": os.environ.get("AWS_CONDITIONAL_PUT", "etag")}
    if (s3_endpoint() or "").startswith("http://"):
        options["AWS_ALLOW_HTTP"] = "true"  # an S3-compatible server without TLS, e.g. on loopback
    return options


def _rs(table_uri: str, version: int | None = None) -> DeltaTable:
    """The table through delta-rs, with the options its store needs."""
    return DeltaTable(table_uri, version=version, storage_options=storage_options(table_uri))


def column_values(table_uri: str, column: str, version: int | None = None) -> list:
    """One column of a version (default: the current one) as Python values, read by delta-rs' own query engine, which
    opens every data file delta-rs wrote: the files of its merges and compactions store Arrow view types that this
    pyarrow (14) cannot open, whether through `DeltaTable.to_pyarrow_table` or `pq.ParquetFile`. For small checks (a
    table's paths, say): the values pass through Python one by one."""
    from deltalake import QueryBuilder

    quoted = '"' + column.replace('"', '""') + '"'
    rows = QueryBuilder().register("t", _rs(table_uri, version)).execute(f"SELECT {quoted} FROM t").read_all()
    return rows.column(0).to_pylist()


def append_arrow(table_uri: str, batches: pa.RecordBatchReader | pa.Table) -> int:
    """Append a stream of Arrow batches with delta-rs in one commit; return the version that commit made."""
    write_id = uuid.uuid4().hex
    write_deltalake(
        table_uri,
        batches,
        mode="append",
        schema_mode="merge",  # rows with a column the table lacks add it (tables written by older versions)
        storage_options=storage_options(table_uri),
        commit_properties=CommitProperties(custom_metadata={WRITE_ID_KEY: write_id}),
    )
    return _version_of_write(table_uri, write_id)


MERGE_KEY = "t.path = s.path AND t.image_size = s.image_size"
# Pixels are large unique values: dictionaries and min/max statistics on them only cost time.
IMAGE_WRITER = WriterProperties(
    column_properties={"image": ColumnProperties(dictionary_enabled=False, statistics_enabled="NONE")}
)
CONFLICT_RETRIES = 8
# A merge's source is read for delta-rs this many rows at a time (the resize stage writes row groups of 16 images).
STREAM_ROWS = 16


@dataclass(frozen=True)
class FileRows:
    """A merge's source where the run left it: the rows of ROWS (a `path` and the `data_file`, named relative to the
    table's folder, that holds it: data files already written there, in SCHEMA) are upserted, then the rows at DELETES
    (of IMAGE_SIZE) deleted. Spark's executors read the files themselves, so the new rows' pixels never reach the
    driver. delta-rs is handed them as a stream, a row group at a time, but gathers a merge's source (and any write's
    rows) in the driver's memory before it writes: only the copies a table built for it took are spared."""

    schema: pa.Schema
    rows: pa.Table
    deletes: list[str]
    image_size: int

    @property
    def files(self) -> list[str]:
        return sorted(set(self.rows.column("data_file").to_pylist()))

    def batches(self, table_uri: str, actions: bool = True) -> pa.RecordBatchReader:
        """The rows as a stream, with an `_action` column ('upsert' or 'delete'); without ACTIONS, the upserts alone."""
        fs, folder = fsspec.core.url_to_fs(table_uri)
        schema = self.schema.append(pa.field("_action", pa.string())) if actions else self.schema

        def stream():
            for name in self.files:
                wanted = self.rows.filter(pc.equal(self.rows["data_file"], name)).column("path").combine_chunks()
                with fs.open(f"{folder}/{name}", "rb") as handle:
                    for batch in pq.ParquetFile(handle).iter_batches(STREAM_ROWS, columns=self.schema.names):
                        batch = batch.filter(pc.is_in(batch.column("path"), wanted))
                        action = [pa.array(["upsert"] * batch.num_rows, pa.string())] if actions else []
                        yield pa.RecordBatch.from_arrays([*batch.columns, *action], schema=schema)
            if actions and self.deletes:
                gone = [{"path": path, "image_size": self.image_size, "_action": "delete"} for path in self.deletes]
                yield pa.RecordBatch.from_pylist(gone, schema=schema)

        return pa.RecordBatchReader.from_batches(schema, stream())

    def frame(self, spark: SparkSession, table_uri: str) -> DataFrame:
        """The rows as a Spark DataFrame whose plan reads the files (on the executors), with an `_action` column."""
        schema = from_arrow_schema(self.schema)
        uris = [f"{table_uri.rstrip('/')}/{name}" for name in self.files]
        rows = spark.read.schema(schema).parquet(*uris) if uris else spark.createDataFrame([], schema)
        wanted = spark.createDataFrame(self.rows.select(["path"]).to_pandas(), "path string")
        upserts = rows.join(F.broadcast(wanted), "path", "left_semi").withColumn("_action", F.lit("upsert"))
        values = {"image_size": F.lit(self.image_size)}
        gone = spark.createDataFrame([(path,) for path in self.deletes], "path string").select(
            *[
                F.col("path") if f.name == "path" else values.get(f.name, F.lit(None)).cast(f.dataType).alias(f.name)
                for f in schema.fields
            ],
            F.lit("delete").alias("_action"),
        )
        return upserts.unionByName(gone)


def merge_arrow(table_uri: str, changes: pa.Table | FileRows) -> int:
    """Upsert and delete rows keyed on (path, image_size) with delta-rs in one commit; return its version.

    `changes` carries an `_action` column ('upsert' or 'delete'), or is a FileRows, streamed to delta-rs. Concurrent
    writers conflict only at commit time: the losing one re-reads the table and merges again.
    """
    write_id = uuid.uuid4().hex
    properties = CommitProperties(custom_metadata={WRITE_ID_KEY: write_id})
    for attempt in range(CONFLICT_RETRIES):
        try:
            if not table_exists(table_uri):
                rows = (
                    changes.batches(table_uri, actions=False)
                    if isinstance(changes, FileRows)
                    else changes.filter(pc.equal(changes["_action"], "upsert")).drop_columns(["_action"])
                )
                write_deltalake(
                    table_uri,
                    rows,
                    mode="append",
                    commit_properties=properties,
                    writer_properties=IMAGE_WRITER,
                    storage_options=storage_options(table_uri),
                )
            else:
                (
                    _rs(table_uri)
                    .merge(
                        changes.batches(table_uri) if isinstance(changes, FileRows) else changes,
                        MERGE_KEY,
                        source_alias="s",
                        target_alias="t",
                        commit_properties=properties,
                        writer_properties=IMAGE_WRITER,
                    )
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
                create_table_with_add_actions(
                    table_uri,
                    DeltaSchema.from_arrow(schema),
                    actions,
                    mode="append",
                    commit_properties=properties,
                    storage_options=storage_options(table_uri),
                )
            else:
                # The table's own schema (which holds SCHEMA's columns): columns another writer added stay.
                table = _rs(table_uri)
                table.create_write_transaction(actions, "append", table.schema(), commit_properties=properties)
            return _version_of_write(table_uri, write_id)
        except (CommitFailedError, DeltaError) as exc:
            # Two first writes race to create the table: the loser (whatever delta-rs calls its error) appends to the
            # winner's.
            lost_create = creating and table_exists(table_uri)
            if attempt == CONFLICT_RETRIES - 1 or not (lost_create or _is_conflict(exc)):
                raise
            time.sleep(0.1 * (attempt + 1) + random.random() * 0.2)
    raise AssertionError("unreachable")


def uncommit_files(table_uri: str, files: list[str]) -> int:
    """Remove files this run committed (one commit); their rows leave the current version, older versions keep them."""
    now = int(time.time() * 1000)
    write_id = uuid.uuid4().hex
    table = _rs(table_uri)
    actions = [RemoveAction(name, True, now) for name in files]
    table.create_write_transaction(
        actions, "append", table.schema(), commit_properties=CommitProperties(custom_metadata={WRITE_ID_KEY: write_id})
    )
    return _version_of_write(table_uri, write_id)


def ever_committed(table_uri: str, files: list[str]) -> set[str]:
    """Which of these data files any commit in the table's log added (the log's JSON commits are searched for their
    names)."""
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
    return (
        isinstance(exc, CommitFailedError)
        or "conflict" in text
        or "version already exists" in text
        or "already exists" in text
    )


_spark_commits = threading.Lock()  # userMetadata is a session setting: one Spark commit at a time per process


def merge_spark(spark: SparkSession, table_uri: str, changes: pa.Table | FileRows) -> int:
    """The same merge through Spark's Delta (`DeltaTable.merge`); return its version. A FileRows source is read by
    the executors from its files."""
    from delta.tables import DeltaTable as SparkDeltaTable

    if isinstance(changes, FileRows):
        columns, source = changes.schema.names, changes.frame(spark, table_uri)
    else:
        columns = [c for c in changes.column_names if c != "_action"]
        source = spark.createDataFrame(changes.to_pandas())
    write_id = uuid.uuid4().hex
    with _spark_commits, _session_conf(spark, "spark.databricks.delta.commitInfo.userMetadata", write_id):
        if not SparkDeltaTable.isDeltaTable(spark, table_uri):
            source.where("_action = 'upsert'").drop("_action").write.format("delta").mode("append").save(table_uri)
        else:
            (
                SparkDeltaTable.forPath(spark, table_uri)
                .alias("t")
                .merge(source.alias("s"), MERGE_KEY)
                .whenMatchedUpdate(condition="s._action = 'upsert'", set={c: f"s.`{c}`" for c in columns})
                .whenMatchedDelete(condition="s._action = 'delete'")
                .whenNotMatchedInsert(condition="s._action = 'upsert'", values={c: f"s.`{c}`" for c in columns})
                .execute()
            )
    return _version_of_write(table_uri, write_id)


def compact_spark(spark: SparkSession, table_uri: str) -> dict:
    """Spark's Delta bin-packing (`optimize().executeCompaction()`); the files it added and removed."""
    from delta.tables import DeltaTable as SparkDeltaTable

    metrics = SparkDeltaTable.forPath(spark, table_uri).optimize().executeCompaction().select("metrics.*").first()
    return {"files_added": int(metrics["numFilesAdded"]), "files_removed": int(metrics["numFilesRemoved"])}


def vacuum_spark(spark: SparkSession, table_uri: str, retention_hours: float, keep_versions: list[int]) -> list[str]:
    """Spark's Delta `vacuum`: it has no per-version keep list, so the retention reaches back to the oldest version to
    keep.

    Like delta-rs' full mode it also deletes files no commit added that are older than the retention.
    Returns the data files it deleted (the folder's Parquet files before minus after).
    """
    from delta.tables import DeltaTable as SparkDeltaTable

    if keep_versions:
        committed = {c["version"]: c["timestamp"] for c in history_spark(spark, table_uri)}
        oldest = min((committed[v] for v in keep_versions if v in committed), default=None)
        if oldest is not None:
            retention_hours = max(retention_hours, (time.time() - oldest.timestamp()) / 3600 + 1)
    before = _data_files(table_uri)
    # Vacuum lists the table folder as one Spark job with this many tasks (10,000 unless set): one per core is plenty.
    with (
        _spark_commits,
        _session_conf(
            spark,
            "spark.sql.sources.parallelPartitionDiscovery.parallelism",
            str(spark.sparkContext.defaultParallelism),
        ),
    ):
        SparkDeltaTable.forPath(spark, table_uri).vacuum(float(math.ceil(retention_hours)))
    return sorted(before - _data_files(table_uri))


@contextmanager
def _session_conf(spark: SparkSession, key: str, value: str):
    """Set a Spark SQL setting for the block, then restore it."""
    previous = spark.conf.get(key, None)
    spark.conf.set(key, value)
    try:
        yield
    finally:
        spark.conf.unset(key) if previous is None else spark.conf.set(key, previous)


def history_spark(spark: SparkSession, table_uri: str) -> list[dict]:
    """The table's commits through `DeltaTable.history()`, newest first, in `history`'s shape."""
    from delta.tables import DeltaTable as SparkDeltaTable

    rows = (
        SparkDeltaTable.forPath(spark, table_uri)
        .history()
        .select("version", "timestamp", "operation", "userMetadata")
        .collect()
    )
    return [
        {
            "version": int(r["version"]),
            "timestamp": r["timestamp"].astimezone(UTC),
            "operation": r["operation"],
            "write_id": r["userMetadata"],
        }
        for r in rows
    ]


def history_rs(table_uri: str) -> list[dict]:
    """The table's commits as its log files give them, newest first (delta-rs' own `history()` can misnumber them
    while another writer commits: see `delta_log_commits`)."""
    return [_commit_row(version, info) for version, info in delta_log_commits(table_uri)]


def _commit_row(version: int, info: dict) -> dict:
    stamp = info.get("timestamp")
    return {
        "version": version,
        "timestamp": None if stamp is None else datetime.fromtimestamp(stamp / 1000, UTC),
        "operation": info.get("operation"),
        "write_id": _write_id(info),
    }


def _write_id(info: dict) -> str | None:
    """The id this project gives a commit: delta-rs' commits carry it as custom metadata, Spark's as userMetadata."""
    return info.get(WRITE_ID_KEY) or info.get("userMetadata")


def _data_files(table_uri: str) -> set[str]:
    fs, folder = fsspec.core.url_to_fs(table_uri)
    return {
        path.removeprefix(folder).lstrip("/")
        for path in fs.find(folder)
        if path.endswith(".parquet") and "/_delta_log/" not in path
    }


def _version_of_write(table_uri: str, write_id: str) -> int:
    # Another writer may have committed since ours: find our commit by its id, not by "latest". Our commit is
    # recent, so the newest-first walk stops early.
    for version, info in delta_log_commits(table_uri):
        if _write_id(info) == write_id:
            return version
    raise RuntimeError(f"the commit of write {write_id} is missing from the history of {table_uri}")


def read_version(spark: SparkSession, table_uri: str, version: int, engine: Engine) -> DataFrame:
    """The table exactly as it was at `version`, as a Spark DataFrame."""
    if engine == "spark":
        return spark.read.format("delta").option("versionAsOf", version).load(table_uri)
    # Through the log: a plain Parquet read of the folder would also see files later commits removed.
    table = _plain(table_uri, version)
    files = table.file_uris()
    # The version's schema, not one file's: files written before a column was added read it as null.
    # (Delta's schema JSON is Spark's StructType JSON.) A version whose rows were all deleted has no files, and no rows.
    schema = StructType.fromJson(json.loads(table.schema().to_json()))
    return spark.read.schema(schema).parquet(*files) if files else spark.createDataFrame([], schema)


def read_files(spark: SparkSession, table_uri: str, version: int, files: list[str]) -> DataFrame:
    """The rows that some of a version's data files hold (URIs as Spark's `input_file_name` spells them), with the
    version's schema: a plain Parquet read of those files alone. Neither engine here writes deletion vectors, so a
    data file of a version holds rows of that version only (a version another writer gave them is refused)."""
    table = _plain(table_uri, version)
    return spark.read.schema(StructType.fromJson(json.loads(table.schema().to_json()))).parquet(*files)


def version_files(table_uri: str, version: int) -> list[str]:
    """The data files of one version, as URIs (delta-rs' `file_uris`), whose plain read gives the version's rows."""
    return _plain(table_uri, version).file_uris()


def read_files_arrow(table_uri: str, files: list[str], schema: pa.Schema) -> pa.Table | None:
    """SCHEMA's columns of these data files (URIs as `version_files` gives them) read by this process's pyarrow, no
    Spark job; None if one of them is in a form this pyarrow cannot open (delta-rs' merges and compactions store Arrow
    view types in the Parquet metadata, which pyarrow 14 rejects): the caller then reads them with Spark. Files that
    lack a column
    (written before it was added) give nulls."""
    fs, _ = fsspec.core.url_to_fs(table_uri)
    parts = []
    for uri in files:
        try:
            with fs.open(uri, "rb") as handle:
                data = pq.ParquetFile(handle)
                present = [name for name in schema.names if name in data.schema_arrow.names]
                part = data.read(columns=present)
        except pa.ArrowInvalid:
            return None
        for field in schema:
            if field.name not in present:
                part = part.append_column(field.name, pa.nulls(part.num_rows, field.type))
        parts.append(part.select(schema.names).cast(schema))
    return pa.concat_tables(parts) if parts else schema.empty_table()


def read_current(
    spark: SparkSession,
    table_uri: str,
    engine: Engine,
    columns: list[str],
    where: Column | None = None,
    version: int | None = None,
) -> pa.Table:
    """Some columns of the table's current version (or of `version`), as Arrow on the driver (empty if there is no
    table).

    Spark reads the files: delta-rs rewrites (merge, optimize) store Arrow view types in the
    Parquet metadata, which the pyarrow that Petastorm needs (14) cannot open.
    """
    if not table_exists(table_uri):
        return pa.table({name: pa.array([], pa.string()) for name in columns})
    frame = read_version(spark, table_uri, _rs(table_uri).version() if version is None else version, engine).select(
        *columns
    )
    if where is not None:
        frame = frame.where(where)
    batches = collect_arrow(frame)  # Spark 3.5's only Arrow collect (private: see infra/compat.py)
    return (
        pa.Table.from_batches(batches) if batches else pa.table({name: pa.array([], pa.string()) for name in columns})
    )


def sql_in(column: str, values: list[str]) -> str:
    """A predicate for `Table.delete_where` and `update_where`: COLUMN is one of VALUES (quoted as SQL string
    literals)."""
    if not values:
        return "FALSE"
    return f"{column} IN (" + ", ".join("'" + value.replace("'", "''") + "'" for value in values) + ")"


class UnsupportedTable(PermanentError, ValueError):
    """A Delta table in a form whose data files imagelake cannot read as plain Parquet."""


def plain_files_problem(table_uri: str, version: int | None = None) -> str | None:
    """Why the data files of the table's VERSION (default: current) do not hold its rows as plain Parquet, or None.
    imagelake's driver and delta-rs paths read data files by column name and in full: column mapping renames the
    columns in the files, and a deletion vector deletes rows without rewriting its file."""
    return _files_problem(_rs(table_uri, version), table_uri)


def _files_problem(table: DeltaTable, table_uri: str) -> str | None:
    mode = table.metadata().configuration.get("delta.columnMapping.mode", "none")
    if mode != "none":
        return (
            f"it uses column mapping (mode '{mode}': its data files name columns by id), which imagelake does not "
            "read. Copy it into a table without column mapping (in Spark: CREATE TABLE delta.`<new folder>` AS "
            f"SELECT * FROM delta.`{table_uri}`) and set table_root to that table's folder"
        )
    if "deletionVectors" in set(table.protocol().reader_features or []):
        carrying = pa.table(table.deletion_vectors()).num_rows  # the data files that have one
        if carrying:
            return (
                f"{carrying} of its data files carry deletion vectors (rows deleted without rewriting their file), "
                f"which imagelake does not apply. Rewrite those files (in Spark: REORG TABLE delta.`{table_uri}` "
                f"APPLY (PURGE)), and to keep it so, ALTER TABLE delta.`{table_uri}` SET TBLPROPERTIES "
                "('delta.enableDeletionVectors' = 'false'); then run again"
            )
    return None


def _plain(table_uri: str, version: int | None) -> DeltaTable:
    """The table at VERSION, refused (UnsupportedTable, naming it, the version and what to do) where a plain read of its
    data files would not give its rows: an older version from before a REORG, the quarantine or history table too."""
    table = _rs(table_uri, version)
    problem = _files_problem(table, table_uri)
    if problem:
        raise UnsupportedTable(f"Delta table {table_uri} v{table.version()}: {problem}")
    return table


def check_plain_files(table_uri: str) -> None:
    """Refuse a table whose current version's data files are not plain Parquet of its rows (see `plain_files_problem`),
    naming it, its version and what to do."""
    if table_exists(table_uri):
        _plain(table_uri, None)


def table_version(table_uri: str) -> int | None:
    """The Delta table's current version, or None before its first write."""
    return _rs(table_uri).version() if table_exists(table_uri) else None


def table_exists(table_uri: str) -> bool:
    """Whether a Delta table is at this URI."""
    try:
        _rs(table_uri)
    except TableNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class Table:
    """One Delta table and the engine that reads it and merges into it: the one place where delta-rs and Spark's Delta
    differ.

    With engine "spark", reads go through Spark's Delta source (versionAsOf), merges through `DeltaTable.merge`,
    compaction, vacuum and history through Spark's `DeltaTable`. With "delta-rs", Spark reads the files the delta-rs
    log lists and delta-rs does the rest, but for a merge of a run's files with more new rows than `spark_merge_above`
    (delta_writer=auto on an embedded Spark), which Spark's Delta takes where its jars load. Either way, appends of
    small tables and commits of data files the executors already wrote are delta-rs commits: Spark's Delta has no
    public API for the latter, and both engines read the result.
    """

    uri: str
    # The session, or the function that starts it on first use (`open`); None: a table only appended to or maintained
    # here.
    session: SparkSource | None = None
    engine: Engine = "delta-rs"
    # With delta-rs: a merge of more new rows of a run's files than this goes through Spark's Delta (None: none does).
    spark_merge_above: int | None = None

    @classmethod
    def open(cls, uri: str, settings: Settings, engine: Engine | None = None) -> Table:
        """The table at URI with this process's Spark session, started only when a read or a Spark merge first needs it:
        a run that finds nothing to do starts no Spark. The engine is the settings' choice unless given."""
        session = on_demand(settings)
        return cls(uri, session, engine or choose_engine(settings, session), spark_merge_bound(settings))

    @property
    def spark(self) -> SparkSession | None:
        """The Spark session (started now if the table was opened with settings and this is the process's first ask)."""
        return None if self.session is None else session_of(self.session)

    def exists(self) -> bool:
        return table_exists(self.uri)

    def columns(self) -> list[str]:
        """The current version's column names ([] before the first write)."""
        try:
            return [field.name for field in _rs(self.uri).schema().fields]
        except TableNotFoundError:
            return []

    def add_columns(self, schema: pa.Schema) -> list[str]:
        """Add SCHEMA's columns that the table lacks, as nullable (one metadata commit, through delta-rs, which both
        engines read); old rows read them as null. Returns the names added."""
        from deltalake.schema import Field

        present = set(self.columns())
        missing = [field for field in schema if field.name not in present] if present else []
        if missing:
            _rs(self.uri).alter.add_columns(
                [Field(f.name, DeltaSchema.from_arrow(pa.schema([f])).fields[0].type, nullable=True) for f in missing]
            )
        return [f.name for f in missing]

    def version(self) -> int | None:
        """The current version, or None before the first write."""
        return table_version(self.uri)

    def frame(self, version: int | None = None, files: list[str] | None = None) -> DataFrame:
        """The table at VERSION (default: the current one) as a Spark DataFrame; with FILES, only the rows those data
        files hold."""
        version = _rs(self.uri).version() if version is None else version
        if files is not None:
            return read_files(self._reader(), self.uri, version, files)
        return read_version(self._reader(), self.uri, version, self.engine)

    def table_id(self) -> str:
        """The id Delta gives the table when it is created: a table made anew at the same place has another."""
        return _rs(self.uri).metadata().id

    def row_count(self, version: int) -> int | None:
        """Rows of VERSION by the log's file statistics (no data read); None where a file was committed without them."""
        counts = pa.table(_rs(self.uri, version).get_add_actions(flatten=True)).column("num_records")
        return None if counts.null_count else (pc.sum(counts).as_py() or 0)

    def files(self, version: int) -> list[str]:
        """The data files of VERSION, as URIs."""
        return version_files(self.uri, version)

    def read_files_arrow(self, files: list[str], schema: pa.Schema) -> pa.Table | None:
        """SCHEMA's columns of some data files, read without Spark; None where this pyarrow cannot open one (see
        `read_files_arrow`)."""
        return read_files_arrow(self.uri, files, schema)

    def read_small(self, schema: pa.Schema, version: int | None = None) -> pa.Table:
        """SCHEMA's columns of a small table at VERSION (default: the current one), read by this process's pyarrow with
        no Spark job, or by Spark where pyarrow cannot open one of its files (see `read_files_arrow`): pyarrow gives the
        columns the table lacks as nulls, Spark leaves them out. Empty before the first write."""
        version = self.version() if version is None else version
        if version is None:
            return schema.empty_table()
        rows = self.read_files_arrow(self.files(version), schema)
        if rows is None:
            rows = self.read([name for name in schema.names if name in self.columns()], version=version)
        return rows

    def read(self, columns: list[str], where: Column | None = None, version: int | None = None) -> pa.Table:
        """Some columns at the current version (or VERSION), as Arrow on the driver; empty if there is no table."""
        return read_current(self._reader(), self.uri, self.engine, columns, where, version)

    def _reader(self) -> SparkSession:
        spark = self.spark
        if spark is None:
            raise RuntimeError(f"table {self.uri} was opened without a Spark session, which reading it needs")
        return spark

    def append(self, rows: pa.Table | pa.RecordBatchReader) -> int:
        """Append rows in one commit (delta-rs, either engine: small tables, no JVM round trip); return its version."""
        return append_arrow(self.uri, rows)

    def delete_where(self, predicate: str) -> int:
        """Delete the rows PREDICATE (SQL; see `sql_in`) selects in one commit (delta-rs, either engine, like `append`:
        small tables); return how many went."""
        return int(_rs(self.uri).delete(predicate).get("num_deleted_rows") or 0)

    def update_where(self, predicate: str, values: dict[str, object]) -> int:
        """Set columns to VALUES in the rows PREDICATE selects, in one commit (delta-rs, as `delete_where`); return how
        many."""
        return int(_rs(self.uri).update(new_values=values, predicate=predicate).get("num_updated_rows") or 0)

    def merge(self, changes: pa.Table | FileRows) -> int:
        """Upsert and delete rows keyed on (path, image_size) (`_action` column) in one commit; return its version.
        A FileRows source (rows of a run's data files) is read by Spark's executors, or streamed to delta-rs."""
        if self._merge_engine(changes) == "spark":
            return merge_spark(self._reader(), self.uri, changes)
        return merge_arrow(self.uri, changes)

    def _merge_engine(self, changes: pa.Table | FileRows) -> Engine:
        """The table's engine, but Spark's Delta for a FileRows merge of more new rows than `spark_merge_above` where
        Spark loads Delta's jars: delta-rs would gather every new row in the driver. Where Spark cannot, delta-rs
        merges, and says what that holds."""
        bound, rows = self.spark_merge_above, changes.rows.num_rows if isinstance(changes, FileRows) else 0
        if self.engine == "spark" or bound is None or rows <= bound:
            return self.engine
        if delta_jars_loaded(self._reader()):
            return "spark"
        logging.getLogger("imagelake").warning(
            f"merging {rows} new rows into {self.uri} with delta-rs, which holds them all in the driver (about 620 KB "
            "a 224 px image): Spark cannot load Delta's jars, whose executors would read them. `make install` fetches "
            "them (or list them in IMAGELAKE_SPARK_JARS); spark_merge_min_rows=none says nothing of it"
        )
        return "delta-rs"

    def commit_files(self, schema: pa.Schema, files: list[str]) -> int:
        return commit_files(self.uri, schema, files)

    def uncommit_files(self, files: list[str]) -> int:
        return uncommit_files(self.uri, files)

    def ever_committed(self, files: list[str]) -> set[str]:
        return ever_committed(self.uri, files)

    def history(self) -> list[dict]:
        """The commits, newest first: version, timestamp (UTC), operation, and the write id this project gives its
        commits."""
        return history_spark(self._reader(), self.uri) if self.engine == "spark" else history_rs(self.uri)

    def compact(self) -> dict:
        """Rewrite small files into fewer large ones (a new version with the same rows)."""
        if self.engine == "spark":
            return compact_spark(self._reader(), self.uri)
        metrics = _rs(self.uri).optimize.compact()
        return {"files_added": metrics.get("numFilesAdded", 0), "files_removed": metrics.get("numFilesRemoved", 0)}

    def vacuum(self, retention_hours: float, keep_versions: list[int]) -> list[str]:
        """Delete files no longer referenced by the recent versions or by any version in KEEP_VERSIONS.

        Both engines also delete files that no commit ever added and that are older than the retention:
        data files left by a run killed between its resize and its write.
        """
        if self.engine == "spark":
            return vacuum_spark(self._reader(), self.uri, retention_hours, keep_versions)
        return _rs(self.uri).vacuum(
            retention_hours=math.ceil(retention_hours),
            dry_run=False,
            enforce_retention_duration=False,
            keep_versions=keep_versions,
            full=True,
        )
