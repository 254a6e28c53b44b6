"""The Delta engine choice: Spark's Delta writer where its jars load, delta-rs (deltalake) everywhere else."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import TableNotFoundError
from pyspark.sql import DataFrame, SparkSession

from infra.settings import Settings
from infra.spark import delta_jars_loaded

Engine = Literal["delta-rs", "spark"]
WRITE_ID_KEY = "imagelake.write_id"


class DeltaEngineUnavailable(RuntimeError):
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


@dataclass(frozen=True)
class WrittenVersion:
    table_uri: str
    version: int
    engine: Engine


def append_arrow(table_uri: str, batches: pa.RecordBatchReader) -> WrittenVersion:
    """Append a stream of Arrow batches with delta-rs in one commit; return the version that commit made."""
    write_id = uuid.uuid4().hex
    write_deltalake(
        table_uri,
        batches,
        mode="append",
        commit_properties=CommitProperties(custom_metadata={WRITE_ID_KEY: write_id}),
    )
    return WrittenVersion(table_uri, _version_of_write(table_uri, write_id), "delta-rs")


def append_spark(table_uri: str, frame: DataFrame) -> WrittenVersion:
    """Append a DataFrame with Spark's Delta writer; return the version that commit made."""
    write_id = uuid.uuid4().hex
    frame.write.format("delta").mode("append").option("userMetadata", write_id).save(table_uri)
    spark = frame.sparkSession
    row = (
        spark.sql(f"DESCRIBE HISTORY delta.`{table_uri}`")
        .where(f"userMetadata = '{write_id}'")
        .select("version")
        .first()
    )
    return WrittenVersion(table_uri, int(row["version"]), "spark")


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


def table_exists(table_uri: str) -> bool:
    """Whether a Delta table is at this URI."""
    try:
        DeltaTable(table_uri)
    except TableNotFoundError:
        return False
    return True
