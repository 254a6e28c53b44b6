"""Write: merge new and changed images into the Delta table, retire what the source lost, quarantine bad files.

The merge is keyed on (path, image_size) and skips rows whose content hash the table already
holds for that path, so re-running a write after a crash at any point adds nothing twice.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.delta import Engine, append_arrow, choose_engine, merge_arrow, merge_spark, read_current, table_exists
from infra.settings import Settings
from infra.spark import spark_session
from tasks.resize import STAGED_ARROW_SCHEMA
from tasks.results import Resized, Written
from tasks.stage import stage

TABLE_COLUMNS = ["path", "label", "date", "size", "mtime", "sha256", "width", "height", "image_size", "image", "ingested_at"]


class TooManyBadFiles(ValueError):
    """More of a run's files are bad than max_bad_fraction allows: nothing is written."""


def check_bad_fraction(resized: Resized, max_bad_fraction: float) -> None:
    """Fail before writing anything when too large a share of the run's files is bad."""
    considered = resized.decoded + resized.known + resized.bad
    if considered and resized.bad / considered > max_bad_fraction:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(resized.quarantined.items()))
        examples = "; ".join(f"{reason} e.g. {path}" for reason, path in sorted(resized.examples.items()))
        raise TooManyBadFiles(
            f"{resized.bad} of {considered} files are bad ({reasons}), over max_bad_fraction={max_bad_fraction}; "
            f"nothing was written. Fix or remove them ({examples}) or raise IMAGELAKE_MAX_BAD_FRACTION."
        )


def staged_rows(resized: Resized) -> ds.Dataset:
    """The resize stage's output (a folder of Parquet files, possibly none when nothing was new)."""
    return ds.dataset(resized.staging_uri, format="parquet", schema=STAGED_ARROW_SCHEMA)


def image_changes(spark: SparkSession, engine: Engine, resized: Resized, table_uri: str) -> pa.Table:
    """Rows to upsert (new content at a path) and to delete (path gone), minus what the table already says."""
    staged = staged_rows(resized)
    present = read_current(spark, table_uri, engine, ["path", "sha256"], F.col("image_size") == resized.image_size)
    keys = pc.binary_join_element_wise(present.column("path"), present.column("sha256"), "\x00")
    upserts = staged.to_table(filter=pc.field("status") == "new")
    if upserts.num_rows:
        # Masks come from the small columns, and the pixels are copied at most once, by a single filter.
        # The same (path, content) is never re-added; when one run sees the same new content twice, the first path wins.
        fresh = pc.invert(pc.is_in(pc.binary_join_element_wise(upserts["path"], upserts["sha256"], "\x00"), keys))
        first = upserts.select(["sha256", "path"]).group_by("sha256").aggregate([("path", "min")]).column("path_min")
        keep = pc.and_(fresh, pc.is_in(upserts["path"], first))
        if not pc.all(keep).as_py():
            upserts = upserts.filter(keep)
    rows = upserts.num_rows
    upserts = upserts.append_column("image_size", pa.array([resized.image_size] * rows, pa.int32()))
    upserts = upserts.append_column("ingested_at", pa.array([datetime.now(timezone.utc)] * rows, pa.timestamp("us", tz="UTC")))
    upserts = upserts.append_column("_action", pa.array(["upsert"] * rows, pa.string())).select(TABLE_COLUMNS + ["_action"])
    deletes = staged.to_table(columns=["path"], filter=pc.field("status") == "delete").column("path")
    deletes = deletes.filter(pc.is_in(deletes, present.column("path"))).to_pylist()
    gone = pa.Table.from_pylist(
        [{"path": path, "image_size": resized.image_size, "_action": "delete"} for path in deletes], schema=upserts.schema
    )
    return pa.concat_tables([upserts, gone])


def quarantine_rows(spark: SparkSession, resized: Resized, quarantine_uri: str) -> pa.Table:
    """The run's bad files, minus those already quarantined for the same content and reason."""
    bad = staged_rows(resized).to_table(
        columns=["path", "size", "mtime", "sha256", "reason", "detail", "issue"], filter=pc.field("status") == "quarantined"
    )
    now = datetime.now(timezone.utc)
    # Problems seen in the listing carry an `issue`; the rest were found while reading or decoding.
    bad = bad.append_column("stage", pc.if_else(pc.is_null(bad["issue"]), "resize", "ingest")).drop_columns(["issue"])
    bad = bad.append_column("quarantined_at", pa.array([now] * bad.num_rows, pa.timestamp("us", tz="UTC")))
    if bad.num_rows and table_exists(quarantine_uri):
        seen = read_current(spark, quarantine_uri, "delta-rs", ["path", "sha256", "reason"])
        key = lambda t: pc.binary_join_element_wise(t["path"], pc.fill_null(t["sha256"], ""), t["reason"], "\x00")  # noqa: E731
        bad = bad.filter(pc.invert(pc.is_in(key(bad), key(seen))))
    return bad


def write_images(spark: SparkSession, resized: Resized, table_uri: str, quarantine_uri: str, engine: Engine, max_bad_fraction: float) -> Written:
    """Check the bad share, then merge the images and append the quarantine; return the images table's version."""
    check_bad_fraction(resized, max_bad_fraction)
    changes = image_changes(spark, engine, resized, table_uri)
    if changes.num_rows == 0 and not table_exists(table_uri):
        raise TooManyBadFiles(f"no image could be written to {table_uri}: no file of this run is a usable image ({resized.quarantined})")
    bad = quarantine_rows(spark, resized, quarantine_uri)
    if bad.num_rows:
        append_arrow(quarantine_uri, bad)
    added = int(pc.sum(pc.equal(changes["_action"], "upsert")).as_py() or 0)
    removed = changes.num_rows - added
    if changes.num_rows == 0:
        version = DeltaTable(table_uri).version()
        return Written(table_uri=table_uri, version=version, engine=engine, rows=0, retired=0, quarantined=bad.num_rows)
    if engine == "spark":
        version = merge_spark(spark, table_uri, changes)
    else:
        version = merge_arrow(table_uri, changes)
    return Written(table_uri=table_uri, version=version, engine=engine, rows=added, retired=removed, quarantined=bad.num_rows)


@stage("write")
def write(resized: Resized, settings: Settings) -> Written:
    """Prefect stage: merge into the Delta table with the engine that can run here."""
    spark = spark_session(settings)
    return write_images(spark, resized, settings.table_uri, settings.quarantine_uri, choose_engine(settings, spark), settings.max_bad_fraction)
