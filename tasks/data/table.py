"""The images table at one image size, with its quarantine: everything the stages ask of them, in one object.

A stage builds one `ImageTable` from its settings (`ImageTable.of(settings)`): the Spark session and the Delta engine
are chosen there, once, and travel with it; the session starts only when something first needs a Spark job, so a run
that can answer from the Delta log and staging alone starts none. Which engine reads, merges or commits is
`imagelake.infra.delta.Table`'s business.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from imagelake.infra.compat import collect_arrow
from imagelake.infra.delta import Engine, Table, check_plain_files
from imagelake.infra.errors import PermanentError
from imagelake.infra.settings import Settings
from imagelake.infra.spark import SparkSource
from imagelake.tasks.results import TableVersion
from imagelake.tasks.rules.schemas import IMAGE_TABLE_SCHEMA
from imagelake.tasks.rules.splits import BUCKETS, split_of


def split_column(val_fraction: float, test_fraction: float, sha_col: str = "sha256") -> Column:
    """imagelake.tasks.rules.splits.split_of as a Spark column expression (the same arithmetic in doubles)."""
    bucket = F.conv(F.substring(sha_col, 1, 8), 16, 10).cast("double") / F.lit(BUCKETS)
    return (
        F.when(bucket < F.lit(test_fraction), "test")
        .when(bucket < F.lit(test_fraction + val_fraction), "val")
        .otherwise("train")
    )


def splits_of(sha256: pa.ChunkedArray | pa.Array, val_fraction: float, test_fraction: float) -> pa.Array:
    """tasks/rules/splits.py:split_of of each content hash, as an Arrow column (for rows the driver reads itself)."""
    return pa.array([split_of(sha, val_fraction, test_fraction) for sha in sha256.to_pylist()], pa.string())


@dataclass(frozen=True)
class ImageTable:
    """The images table (rows of one image size) and the quarantine table beside it (None: not consulted)."""

    images: Table
    quarantine: Table | None
    image_size: int

    def __post_init__(self) -> None:
        # A table another writer gave deletion vectors or column mapping: refused before anything is read or written,
        # saying what to do.
        for table in (self.images, self.quarantine):
            if table is not None:
                check_plain_files(table.uri)

    @classmethod
    def of(cls, settings: Settings, engine: Engine | None = None) -> ImageTable:
        """The settings' tables at the settings' image size (Spark started on first use); the engine is chosen here
        unless given."""
        images = Table.open(settings.table_uri, settings, engine)
        return cls(images, Table(settings.quarantine_uri, images.session, images.engine), settings.image_size)

    @classmethod
    def at(
        cls,
        spark: SparkSource,
        table_uri: str,
        image_size: int,
        engine: Engine = "delta-rs",
        quarantine_uri: str | None = None,
    ) -> ImageTable:
        """The table at TABLE_URI (and quarantine, if given) read with ENGINE, for callers that hold their own Spark
        session
        (or a function that starts it on first use: `imagelake.infra.spark.on_demand`)."""
        return cls(
            Table(table_uri, spark, engine),
            Table(quarantine_uri, spark, engine) if quarantine_uri else None,
            image_size,
        )

    @classmethod
    def of_version(
        cls, spark: SparkSource, table: TableVersion, image_size: int, quarantine_uri: str | None = None
    ) -> ImageTable:
        """The table a TableVersion names, read with the engine it was written with."""
        return cls.at(spark, table.table_uri, image_size, table.engine, quarantine_uri)  # type: ignore[arg-type]

    @property
    def uri(self) -> str:
        return self.images.uri

    @property
    def spark(self) -> SparkSession:
        """The Spark session, started now if this is the process's first ask."""
        return self.images.spark

    @property
    def engine(self) -> Engine:
        return self.images.engine

    def this_size(self) -> Column:
        return F.col("image_size") == self.image_size

    def rows_matching(self, keys: dict[str, pa.Array], columns: list[str], version: int | None = None) -> pa.Table:
        """Columns of this size's rows (at VERSION, default current) whose value in any column of KEYS is one of its
        values.

        A semi-join against the given values (which come from one run, so they are few): only the matching rows are
        kept, never the table's keys. Up to DRIVER_SCAN_ROWS rows, the driver scans the key columns one data file at a
        time (no Spark job); larger tables, or files this pyarrow cannot open, are joined by Spark."""
        if not self.images.exists():
            return pa.table({name: pa.array([], pa.string()) for name in columns})
        version = self.images.version() if version is None else version
        scanned = self._scan_matching(keys, columns, version)
        return scanned if scanned is not None else matching(self.images, keys, columns, self.this_size(), version)

    def _scan_matching(self, keys: dict[str, pa.Array], columns: list[str], version: int) -> pa.Table | None:
        rows = self.images.row_count(version)
        if rows is None or rows > DRIVER_SCAN_ROWS:
            return None
        wanted = wanted_keys(keys)
        schema = pa.schema(
            [IMAGE_TABLE_SCHEMA.field(name) for name in dict.fromkeys([*columns, *wanted, "image_size"])]
        )
        parts = [schema.empty_table().select(columns)]
        for uri in self.images.files(version) if wanted else []:
            data = self.images.read_files_arrow([uri], schema)
            if data is None:
                return None
            hit = None
            for column, values in wanted.items():
                known = pc.is_in(data[column], values)
                hit = known if hit is None else pc.or_(hit, known)
            parts.append(data.filter(pc.and_(pc.equal(data["image_size"], self.image_size), hit)).select(columns))
        return pa.concat_tables(parts)

    def rows_by_date(self, version: int, dates: list) -> dict:
        """This size's rows at VERSION of each of these dates (None: rows without a date), counted by Spark."""
        wanted = [d for d in dates if d is not None]
        where = F.col("date").isin(wanted) if wanted else F.lit(False)
        if None in dates:
            where = where | F.col("date").isNull()
        counted = self.images.frame(version).where(self.this_size() & where).groupBy("date").count().collect()
        return {row["date"]: row["count"] for row in counted}

    def rows_between(
        self, base: int, version: int, columns: list[str], max_bytes: int | None = None
    ) -> tuple[pa.Table, pa.Table] | None:
        """COLUMNS (with `data_file`, the file's URI) of this size's rows in the data files VERSION has and BASE lacks,
        and in those BASE has and VERSION lacks: what changed between two versions, from the Delta log's file lists,
        read by pyarrow with no Spark job and no unchanged file opened. A rewritten file is on both sides, so rows it
        kept appear twice. None where that cannot be had: a version the log no longer holds, a file this pyarrow cannot
        open, new files of more than MAX_BYTES."""
        try:
            now, then = set(self.images.files(version)), set(self.images.files(base))
        except Exception:  # noqa: BLE001 - delta-rs' error for a version whose commit is gone: the caller reads the data
            return None
        new, old = sorted(now - then), sorted(then - now)
        if max_bytes is not None:
            fs, _ = fsspec.core.url_to_fs(self.uri)
            if sum(fs.size(uri) for uri in new) > max_bytes:
                return None
        schema = pa.schema([IMAGE_TABLE_SCHEMA.field(name) for name in dict.fromkeys([*columns, "image_size"])])
        sides = []
        for files in (new, old):
            parts = []
            for uri in files:
                rows = self.images.read_files_arrow([uri], schema)
                if rows is None:
                    return None
                rows = rows.filter(pc.equal(rows["image_size"], self.image_size)).select(columns)
                parts.append(rows.append_column("data_file", pa.array([uri] * rows.num_rows, pa.string())))
            empty = schema.empty_table().select(columns).append_column("data_file", pa.array([], pa.string()))
            sides.append(pa.concat_tables([empty, *parts]))
        return sides[0], sides[1]

    def with_split(
        self, version: int, val_fraction: float, test_fraction: float, files: list[str] | None = None
    ) -> DataFrame:
        """The table at VERSION, rows of this image size (of FILES only, if given), with a `split` column."""
        return (
            self.images.frame(version, files)
            .where(self.this_size())
            .withColumn("split", split_column(val_fraction, test_fraction))
        )

    def quarantined_by_reason(self) -> dict[str, int]:
        """Files in the quarantine table now, by reason (those requeued, which the next run reads again, apart)."""
        if self.quarantine is None:
            return {}
        rows = self.quarantine.read_small(
            pa.schema([("reason", pa.string()), ("requeued_at", pa.timestamp("us", tz="UTC"))])
        )
        held = rows.filter(pc.is_null(rows["requeued_at"])) if "requeued_at" in rows.column_names else rows
        return dict(sorted(Counter(held.column("reason").to_pylist()).items()))


# The driver reads changed data files of up to this many bytes itself; more are read by Spark.
DRIVER_BYTES = 256 * 1024 * 1024
# A semi-join against a table of up to this many rows is a scan by the driver of its key columns, a file at a time.
DRIVER_SCAN_ROWS = 2_000_000
# Up to this many keys go into the query as literals; more are joined as a broadcast table.
INLINE_KEYS = 1000


def wanted_keys(keys: dict[str, pa.Array]) -> dict[str, pa.Array]:
    """Each key column's distinct non-null values (columns with none left out)."""
    return {column: pc.unique(values.drop_null()) for column, values in keys.items() if len(values.drop_null())}


def matching(
    table: Table, keys: dict[str, pa.Array], columns: list[str], where: Column | None = None, version: int | None = None
) -> pa.Table:
    """COLUMNS of TABLE's rows (those WHERE selects) whose value in a column of KEYS is one of that column's values
    (each matching row once, as often as the table holds it)."""
    empty = pa.table({name: pa.array([], pa.string()) for name in columns})
    frame = table.frame(version)
    if where is not None:
        frame = frame.where(where)
    wanted = wanted_keys(keys)
    if not wanted:
        return empty
    hit = None
    for column, values in wanted.items():
        known = F.col(column).isin(values.to_pylist()) if len(values) <= INLINE_KEYS else None
        if known is None:  # many keys: a broadcast semi-join marks the rows
            marks = table.spark.createDataFrame(pa.table({column: values}).to_pandas()).withColumn(
                f"_hit_{column}", F.lit(True)
            )
            frame = frame.join(F.broadcast(marks), column, "left")
            known = F.col(f"_hit_{column}").isNotNull()
        hit = known if hit is None else hit | known
    batches = collect_arrow(frame.where(hit).select(*columns))
    return pa.Table.from_batches(batches) if batches else empty


class ResizeModeChanged(PermanentError, ValueError):
    """A run would decode new images at a size the table holds in another resize mode: one table version, two crops."""


MODES_RECORD = "_imagelake/resize_modes.json"  # beside the Delta log; Delta's readers and vacuum pass `_` folders by


def hold_resize_mode(table_uri: str, image_size: int, mode: str) -> None:
    """Keep each image size of the table in one resize mode: the first run at a size records its mode beside the table;
    a later run at that size in another mode is refused before it decodes anything (its new images would be cut one
    way and the rest another, the cache reused, and the registered version would say the new mode)."""
    fs, folder = fsspec.core.url_to_fs(table_uri)
    path = f"{folder}/{MODES_RECORD}"
    modes = json.loads(fs.cat_file(path)) if fs.exists(path) else {}
    held = modes.get(str(image_size))
    if held is None:
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        aside = f"{path}.{uuid.uuid4().hex}"
        fs.pipe_file(aside, json.dumps({**modes, str(image_size): mode}, indent=1, sort_keys=True).encode())
        fs.mv(aside, path)
    elif held != mode:
        raise ResizeModeChanged(
            f"the table {table_uri} holds its {image_size} px images cut by resize_mode={held}; resize_mode={mode} "
            f"would train on one crop and serve another. Keep resize_mode={held}, or decode the images anew at "
            "another image_size or into another table (table_name)"
        )
