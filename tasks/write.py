"""Write: append resized images to the Delta table, through Spark's Delta writer or delta-rs, and return the version."""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.delta import Engine, append_arrow, append_spark, choose_engine, table_exists
from infra.settings import Settings
from infra.spark import spark_session
from tasks.results import Resized, Written
from tasks.stage import stage

TABLE_COLUMNS = ["path", "label", "sha256", "width", "height", "image_size", "image", "ingested_at"]


def _new_rows_arrow(resized: Resized, table_uri: str) -> tuple[pa.RecordBatchReader, int]:
    staged = ds.dataset(resized.staging_uri, format="parquet")
    wanted = pc.field("error").is_null()
    if table_exists(table_uri):
        # Rows already in the table (same content, same size) are not written twice.
        present = DeltaTable(table_uri).to_pyarrow_dataset().to_table(
            columns=["sha256"], filter=pc.field("image_size") == resized.image_size
        )
        wanted = wanted & ~pc.field("sha256").isin(present.column("sha256"))
    now = pa.scalar(datetime.now(timezone.utc), pa.timestamp("us", tz="UTC"))
    projection = {name: pc.field(name) for name in ["path", "label", "sha256", "width", "height"]}
    projection |= {"image_size": pc.scalar(pa.scalar(resized.image_size, pa.int32())), "image": pc.field("image")}
    projection |= {"ingested_at": pc.scalar(now)}
    rows = staged.count_rows(filter=wanted)
    return staged.scanner(columns=projection, filter=wanted, batch_size=256).to_reader(), rows


def write_images(spark: SparkSession, resized: Resized, table_uri: str, engine: Engine) -> Written:
    """Append the resized images not yet in the table; the version returned holds all of them."""
    if engine == "delta-rs":
        reader, rows = _new_rows_arrow(resized, table_uri)
        if rows == 0:
            return Written(table_uri=table_uri, version=DeltaTable(table_uri).version(), engine=engine, rows=0)
        written = append_arrow(table_uri, reader)
        return Written(table_uri=table_uri, version=written.version, engine=engine, rows=rows)
    frame = (
        spark.read.parquet(resized.staging_uri)
        .where(F.col("error").isNull())
        .withColumn("image_size", F.lit(resized.image_size).cast("int"))
        .withColumn("ingested_at", F.current_timestamp())
        .select(*TABLE_COLUMNS)
    )
    if table_exists(table_uri):
        present = spark.read.format("delta").load(table_uri).select("sha256", "image_size")
        frame = frame.join(present, ["sha256", "image_size"], "left_anti").select(*TABLE_COLUMNS)
    rows = frame.count()
    if rows == 0:
        version = spark.sql(f"DESCRIBE HISTORY delta.`{table_uri}` LIMIT 1").first()["version"]
        return Written(table_uri=table_uri, version=int(version), engine=engine, rows=0)
    written = append_spark(table_uri, frame)
    return Written(table_uri=table_uri, version=written.version, engine=engine, rows=rows)


@stage("write")
def write(resized: Resized, settings: Settings) -> Written:
    """Prefect stage: append to the Delta table with the engine that can run here."""
    spark = spark_session(settings)
    return write_images(spark, resized, settings.table_uri, choose_engine(settings, spark))
