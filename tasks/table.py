"""The images table at one image size, with its quarantine: everything the stages ask of them, in one object.

A stage builds one `ImageTable` from its settings (`ImageTable.of(settings)`): the Spark session and the Delta engine
are chosen there, once, and travel with it. Which engine reads, merges or commits is `infra.delta.Table`'s business.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from infra.delta import Engine, Table
from infra.settings import Settings
from tasks.results import TableVersion
from tasks.rules.listing import Known, Scope
from tasks.rules.splits import BUCKETS


def split_column(val_fraction: float, test_fraction: float, sha_col: str = "sha256") -> Column:
    """tasks.rules.splits.split_of as a Spark column expression (the same arithmetic in doubles)."""
    bucket = F.conv(F.substring(sha_col, 1, 8), 16, 10).cast("double") / F.lit(BUCKETS)
    return (
        F.when(bucket < F.lit(test_fraction), "test")
        .when(bucket < F.lit(test_fraction + val_fraction), "val")
        .otherwise("train")
    )


@dataclass(frozen=True)
class ImageTable:
    """The images table (rows of one image size) and the quarantine table beside it (None: not consulted)."""

    images: Table
    quarantine: Table | None
    image_size: int

    @classmethod
    def of(cls, settings: Settings, engine: Engine | None = None) -> ImageTable:
        """The settings' tables at the settings' image size; the engine is chosen here unless given."""
        images = Table.open(settings.table_uri, settings, engine)
        return cls(images, Table(settings.quarantine_uri, images.spark, images.engine), settings.image_size)

    @classmethod
    def at(cls, spark: SparkSession, table_uri: str, image_size: int, engine: Engine = "delta-rs", quarantine_uri: str | None = None) -> ImageTable:
        """The table at TABLE_URI (and quarantine, if given) read with ENGINE, for callers that hold their own Spark session."""
        return cls(Table(table_uri, spark, engine), Table(quarantine_uri, spark, engine) if quarantine_uri else None, image_size)

    @classmethod
    def of_version(cls, spark: SparkSession, table: TableVersion, image_size: int, quarantine_uri: str | None = None) -> ImageTable:
        """The table a TableVersion names, read with the engine it was written with."""
        return cls.at(spark, table.table_uri, image_size, table.engine, quarantine_uri)  # type: ignore[arg-type]

    @property
    def uri(self) -> str:
        return self.images.uri

    @property
    def spark(self) -> SparkSession:
        return self.images.spark

    @property
    def engine(self) -> Engine:
        return self.images.engine

    def this_size(self) -> Column:
        return F.col("image_size") == self.image_size

    def rows(self, columns: list[str], where: Column | None = None, version: int | None = None) -> pa.Table:
        """Columns of this image size's rows at the current version (or VERSION), as Arrow on the driver."""
        return self.images.read(columns, self.this_size() if where is None else self.this_size() & where, version)

    def known_files(self) -> tuple[int | None, Known, set[str]]:
        """The table's version; each path's (size, mtime, stamp) in the table (this image size) or the quarantine; the table's paths.

        Tables written before stamps were recorded have no `stamp` column: their rows give None.
        """
        known: Known = {}
        if self.quarantine is not None:
            known.update(_known(self.quarantine.read(_stamped(self.quarantine))))
        rows = self.rows(_stamped(self.images))
        known.update(_known(rows))
        return self.images.version(), known, set(rows.column("path").to_pylist())

    def paths_in_dates(self, scope: Scope) -> set[str]:
        """Paths whose date lies in the run's date range (what a date-limited run replaces)."""
        predicate = F.lit(True)
        if scope.start:
            predicate &= F.col("date") >= F.lit(scope.start)
        if scope.end:
            predicate &= F.col("date") <= F.lit(scope.end)
        return set(self.rows(["path"], predicate).column("path").to_pylist())

    def known_hashes(self) -> frozenset[str]:
        """Content hashes already in the table at this image size: those files are not decoded again."""
        return frozenset(self.rows(["sha256"]).column("sha256").to_pylist())

    def with_split(self, version: int, val_fraction: float, test_fraction: float) -> DataFrame:
        """The table at VERSION, rows of this image size, with a `split` column."""
        return self.images.frame(version).where(self.this_size()).withColumn("split", split_column(val_fraction, test_fraction))

    def quarantined_by_reason(self) -> dict[str, int]:
        """Files in the quarantine table now, by reason."""
        if self.quarantine is None:
            return {}
        return dict(sorted(Counter(self.quarantine.read(["reason"]).column("reason").to_pylist()).items()))


def _stamped(table: Table) -> list[str]:
    return ["path", "size", "mtime"] + (["stamp"] if "stamp" in table.columns() else [])


def _known(rows: pa.Table) -> Known:
    columns = rows.to_pydict()
    stamps = columns.get("stamp") or [None] * rows.num_rows
    return {p: (s, m, t) for p, s, m, t in zip(columns["path"], columns["size"], columns["mtime"], stamps)}
