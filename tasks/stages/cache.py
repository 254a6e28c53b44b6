"""Cache: the Petastorm-readable Parquet files of each split of a table version, grown version by version.

Its layout is data/cache_files.py's: a cache line (one per table, image size, partitioning, split fractions, labels
and seed) keeps its files under `data/<split>/g<generation>/` and one manifest per cached table version,
`<split>-v<version>.json`, naming the files that hold that version's rows of the split. A new version adds a generation
holding only its new rows; files holding rows the version retired or replaced are rewritten without them (into the new
generation); every other file is shared, never copied. A row's split follows from its content hash, so rows never move
between splits. A version whose rows are those of a cached one (a compaction) gets that cache back as it was, so the
stages after it (training, the gate) reuse their stored results. `clean_cache` (tasks/data/cache_files.py) removes what
no kept manifest names.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from imagelake.infra.compat import collect_arrow
from imagelake.infra.prefect_env import fence, one_at_a_time
from imagelake.infra.settings import Settings, stage_settings
from imagelake.infra.spark import SparkSource, on_demand, session_of
from imagelake.tasks.data.cache_files import (
    GENERATION_BITS,
    LAYOUT,
    CacheLine,
    cached_files,
    damaged_split,
    encode_jpeg,
    nearest,
)
from imagelake.tasks.data.table import DRIVER_BYTES, ImageTable, splits_of
from imagelake.tasks.progress import stage_logger
from imagelake.tasks.results import CachedSplits, SplitPlan
from imagelake.tasks.rules.splits import SPLITS
from imagelake.tasks.stage import stage

ROW_KEY = ("sha256", "label")


@dataclass(frozen=True)
class Stored:
    """How a cache holds its images: raw pixels, or JPEG files of a quality (tasks/data/cache_files.py:encode_jpeg)."""

    image_format: str = "raw"
    quality: int = 95

    @classmethod
    def of(cls, settings: Settings) -> Stored:
        return cls(settings.cache_format, settings.cache_jpeg_quality)

    def key(self) -> list[Any]:
        """What the line's key adds: nothing for raw pixels (the key lines had before JPEG caches), else the codec."""
        return [] if self.image_format == "raw" else [self.image_format, self.quality]

    def rows(self, rows: pa.Table, image_size: int) -> pa.Table:
        """ROWS (raw pixels in `image`) as the cache stores them."""
        if self.image_format == "raw":
            return rows
        return rows.set_column(
            rows.schema.get_field_index("image"), "image", encode_jpeg(rows["image"], image_size, self.quality)
        )

    def frame(self, frame: DataFrame, image_size: int) -> DataFrame:
        """FRAME's rows (raw pixels in `image`) as the cache stores them, encoded by Spark's Python workers."""
        if self.image_format == "raw":
            return frame
        quality, column = self.quality, frame.columns.index("image")

        def encode(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            for batch in batches:
                arrays = list(batch.columns)
                arrays[column] = encode_jpeg(arrays[column], image_size, quality)
                yield pa.RecordBatch.from_arrays(arrays, schema=batch.schema)

        return frame.mapInArrow(encode, frame.schema)


RAW = Stored()


def line_key(plan: SplitPlan, image_size: int, seed: int, stored: Stored = RAW) -> str:
    """Everything a cache line's bytes depend on besides the table version, hashed."""
    parts = [
        plan.table_uri,
        image_size,
        plan.num_partitions,
        plan.val_fraction,
        plan.test_fraction,
        plan.labels,
        seed,
        LAYOUT,
        *stored.key(),
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def write_split(frame: DataFrame, uri: str, partitions: int, seed: int, generation: int) -> None:
    """Rows of one split as up to `partitions` Parquet files of 8 MB row groups, in a seeded random order.

    Rows are dealt to files by content hash and ordered inside each file by a seeded hash, so no
    row group holds a run of one label (the table's order follows the source folders); `position`
    (generation, then file, then row) lets the loader name the row group it was given.
    """
    (
        frame.repartition(partitions, "sha256")
        .sortWithinPartitions(F.xxhash64("sha256", F.lit(seed)))
        .withColumn("position", F.monotonically_increasing_id() + F.lit(generation << GENERATION_BITS))
        .write.mode("overwrite")
        .option("parquet.block.size", 8 * 1024 * 1024)
        .parquet(uri)
    )


def version_rows(spark: SparkSource, plan: SplitPlan, image_size: int, files: list[str] | None = None) -> DataFrame:
    """The version's rows (those FILES hold, if given) as the cache stores them (image, label index, sha256) with their
    split."""
    frame = ImageTable.of_version(spark, plan, image_size).with_split(
        plan.version, plan.val_fraction, plan.test_fraction, files
    )
    index_of = F.create_map(*[F.lit(item) for index, label in enumerate(plan.labels) for item in (label, index)])
    return frame.select("image", index_of[F.col("label")].cast("long").alias("label"), "sha256", "split")


def cache_splits(
    spark: SparkSource,
    plan: SplitPlan,
    image_size: int,
    cache_root: str,
    seed: int = 42,
    lock: str | None = None,
    stored: Stored = RAW,
) -> CachedSplits:
    """The cache of every split of the plan's version, its images as STORED says: reused if cached, grown from the
    nearest cached version, or written whole. The manifest that commits it is written under LOCK's fence
    (infra/prefect_env.py:fence), if given. SPARK may be a function that starts the session: a reuse, or a growth the
    driver makes alone, never calls it."""
    key = line_key(plan, image_size, seed, stored)
    line = CacheLine(f"{cache_root.rstrip('/')}/{key}")
    versions = line.versions()
    if plan.version in versions:
        problem = line.problem(plan.version)
        if problem is None:
            return line.cached(plan.version, reused=True)
        stage_logger().warning(f"cache: v{plan.version} is cached, but {problem}: written again")
        versions.remove(plan.version)
    base = nearest(versions, plan.version)
    if base is not None and line.problem(base) is not None:
        base = None  # a damaged version is not grown from
    grown = grow(spark, line, base, plan, image_size, seed, stored) if base is not None else None
    if grown is None:  # nothing cached to grow from, or the grown files do not hold the plan's rows
        generation = 1 + max((line.read(v)["test"]["generation"] for v in versions), default=-1)
        rows, files = version_rows(spark, plan, image_size), {}
        for split in SPLITS:
            folder = line.generation_folder(split, generation)
            write_split(
                stored.frame(rows.where(F.col("split") == split).drop("split"), image_size),
                f"{line.uri}/{folder}",
                plan.num_partitions,
                seed,
                generation,
            )
            files[split] = line.files_in(folder)
        grown = files, generation, False
    files, generation, same_rows = grown
    if same_rows:
        # The rows of a cached version (a compaction made this one): the same cache, so training reuses its result too.
        cached = line.cached(base, reused=True)
    else:
        cached = CachedSplits(
            table_uri=plan.table_uri,
            table_version=plan.version,
            cache_dir=line.fs.unstrip_protocol(line.root),
            key=f"{key}-v{plan.version}",
            splits={split: line.fs.unstrip_protocol(line.manifest(split, plan.version)) for split in SPLITS},
            counts=plan.counts,
            labels=plan.labels,
            image_size=image_size,
            num_partitions=plan.num_partitions,
            reused=False,
            label_counts=plan.label_counts,
            quarantined=plan.quarantined,
            image_format=stored.image_format,
        )
    if lock is not None:
        fence(lock)  # the line's lock lapsed: another run may be writing this version's manifest; commit nothing
    line.write(plan.version, files, generation, cached)
    return cached.model_copy(update={"reused": same_rows, "quarantined": plan.quarantined})


def row_changes(
    spark: SparkSource, line: CacheLine, manifests: dict[str, Any], plan: SplitPlan, image_size: int
) -> pa.Table:
    """Keys (sha256, label) of the rows the version has and the base's cache lacks (`split` and the `data_file` that
    holds each) and of those the cache holds and the version lost (the cache `file` that holds each): one join of keys,
    no pixels,
    and only the differences reach the driver."""
    old_files = [f"{line.uri}/{name}" for split in SPLITS for name in manifests[split]["files"]]
    now = version_rows(spark, plan, image_size).select(*ROW_KEY, "split", F.input_file_name().alias("data_file"))
    if old_files:
        old = session_of(spark).read.parquet(*old_files).select(*ROW_KEY, F.input_file_name().alias("file"))
    else:
        old = now.select(*ROW_KEY, F.lit(None).cast("string").alias("file")).limit(0)
    differences = now.join(old, list(ROW_KEY), "full_outer").where(F.col("file").isNull() | F.col("split").isNull())
    batches = collect_arrow(differences)
    if not batches:
        return pa.table(
            {
                "sha256": pa.array([], pa.string()),
                "label": pa.array([], pa.int64()),
                "split": pa.array([], pa.string()),
                "data_file": pa.array([], pa.string()),
                "file": pa.array([], pa.string()),
            }
        )
    return pa.Table.from_batches(batches)


CACHE_SCHEMA = pa.schema(
    [
        ("image", pa.binary()),
        ("label", pa.int64()),
        ("sha256", pa.string()),
        pa.field("position", pa.int64(), nullable=False),
    ]
)


def row_key(sha256: pa.ChunkedArray | pa.Array, label: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """One string per (sha256, label index) row key, to compare keys as one column."""
    return pc.binary_join_element_wise(sha256, pc.cast(label, pa.string()), "\x00")


def label_index(plan: SplitPlan, labels: pa.ChunkedArray | pa.Array) -> pa.Array:
    """The cache's label (its index in the plan's labels; -1 for one the plan lacks) of each label name."""
    return pc.fill_null(pc.index_in(labels, pa.array(plan.labels, pa.string())), -1).cast(pa.int64())


def log_changes(
    table: ImageTable, line: CacheLine, manifests: dict[str, Any], base: int, plan: SplitPlan
) -> pa.Table | None:
    """`row_changes` from the Delta log instead of a join (`ImageTable.rows_between`): keys of the rows in the data
    files the plan's version has and BASE lacks, less those in the files BASE has and it lacks, and the reverse (a
    rewritten file's unchanged rows cancel out); no Spark job, no unchanged file read. None where that cannot be had
    (then the
    join runs)."""
    between = table.rows_between(base, plan.version, ["sha256", "label"], max_bytes=DRIVER_BYTES)
    if between is None:
        return None
    added, removed = (side.set_column(1, "label", label_index(plan, side["label"])) for side in between)
    added_keys, removed_keys = row_key(added["sha256"], added["label"]), row_key(removed["sha256"], removed["label"])
    added = added.filter(pc.invert(pc.is_in(added_keys, removed_keys)))
    gone = removed.filter(pc.invert(pc.is_in(removed_keys, added_keys)))
    added = added.append_column(
        "split", splits_of(added["sha256"], plan.val_fraction, plan.test_fraction)
    ).append_column("file", pa.nulls(added.num_rows, pa.string()))
    lost = cache_files_holding(line, manifests, gone, plan)
    lost = lost.append_column("split", pa.nulls(lost.num_rows, pa.string())).append_column(
        "data_file", pa.nulls(lost.num_rows, pa.string())
    )
    columns = ["sha256", "label", "split", "data_file", "file"]
    return pa.concat_tables([added.select(columns), lost.select(columns)])


def cache_files_holding(line: CacheLine, manifests: dict[str, Any], rows: pa.Table, plan: SplitPlan) -> pa.Table:
    """(sha256, label, file) of ROWS' keys in the cached files of their split that hold them (only the key columns of
    the splits that lost rows are read)."""
    found = []
    wanted = row_key(rows["sha256"], rows["label"])
    for split in sorted(set(splits_of(rows["sha256"], plan.val_fraction, plan.test_fraction).to_pylist())):
        for name in manifests[split]["files"]:
            with line.fs.open(f"{line.root}/{name}", "rb") as handle:
                keys = pq.read_table(handle, columns=list(ROW_KEY))
            here = keys.filter(pc.is_in(row_key(keys["sha256"], keys["label"]), wanted))
            found.append(here.append_column("file", pa.array([name] * here.num_rows, pa.string())))
    return (
        pa.concat_tables(found)
        if found
        else pa.table(
            {"sha256": pa.array([], pa.string()), "label": pa.array([], pa.int64()), "file": pa.array([], pa.string())}
        )
    )


def new_rows_arrow(table: ImageTable, plan: SplitPlan, added: pa.Table) -> pa.Table | None:
    """The cache's columns (image, label index, sha256) and split of the ADDED rows, read by pyarrow from the data files
    that hold them (their `data_file`)."""
    read = table.images.read_files_arrow(
        pc.unique(added["data_file"]).to_pylist(),
        pa.schema(
            [("image", pa.binary()), ("label", pa.string()), ("sha256", pa.string()), ("image_size", pa.int32())]
        ),
    )
    if read is None:
        return None
    read = read.filter(pc.equal(read["image_size"], table.image_size))
    rows = pa.table({"image": read["image"], "label": label_index(plan, read["label"]), "sha256": read["sha256"]})
    rows = rows.filter(pc.is_in(row_key(rows["sha256"], rows["label"]), row_key(added["sha256"], added["label"])))
    return rows.append_column("split", splits_of(rows["sha256"], plan.val_fraction, plan.test_fraction))


def write_split_arrow(rows: pa.Table, fs: Any, folder: str, partitions: int, seed: int, generation: int) -> None:
    """`write_split` by the driver, for few rows: the same layout (rows dealt to files by content hash, a seeded order
    inside each file, `position` = generation, then file, then row; row groups of about 8 MB)."""
    if fs.exists(folder):
        fs.rm(folder, recursive=True)  # what a crashed attempt left (Spark's overwrite does the same)
    fs.makedirs(folder, exist_ok=True)
    run = uuid.uuid4().hex  # file names unique across splits and generations, as Spark's are
    shas = rows["sha256"].to_pylist()
    dealt = [int(sha[:8], 16) % partitions for sha in shas]
    order = [hashlib.sha256(f"{seed}:{sha}".encode()).hexdigest() for sha in shas]
    for part in range(partitions):
        mine = sorted((i for i, p in enumerate(dealt) if p == part), key=order.__getitem__)
        if not mine:
            continue
        chunk = rows.take(pa.array(mine, pa.int64())).select(["image", "label", "sha256"])
        start = (generation << GENERATION_BITS) + (part << 33)
        chunk = chunk.append_column("position", pa.array(range(start, start + chunk.num_rows), pa.int64())).cast(
            CACHE_SCHEMA
        )
        per_row = max(1, chunk.nbytes // max(1, chunk.num_rows))
        with fs.open(f"{folder}/part-{part:05d}-{run}.parquet", "wb") as out:
            pq.write_table(chunk, out, row_group_size=max(1, (8 * 1024 * 1024) // per_row))


def grow(
    spark: SparkSource, line: CacheLine, base: int, plan: SplitPlan, image_size: int, seed: int, stored: Stored
) -> tuple[dict[str, list[str]], int, bool] | None:
    """Files for the plan's version made from BASE's: its new rows in a new generation (read from the data files that
    hold them alone), files that hold rows it lost rewritten without them. None if the result would not hold exactly the
    plan's rows (then it is written whole).

    What changed comes from the Delta log and is cached by the driver when that is little (`log_changes`), else from
    one Spark join of keys (`row_changes`) with Spark writing the new rows."""
    manifests = line.read(base)
    generation = 1 + max(m["generation"] for m in manifests.values())
    table = ImageTable.of_version(spark, plan, image_size)
    changes = log_changes(table, line, manifests, base, plan)
    in_driver = changes is not None
    if changes is None:
        changes = row_changes(spark, line, manifests, plan, image_size)
    added, lost = changes.filter(pc.is_null(changes["file"])), changes.filter(pc.is_null(changes["split"]))
    fresh = None
    if added.num_rows and in_driver:
        fresh = new_rows_arrow(table, plan, added)
    if added.num_rows and fresh is None:
        keys = session_of(spark).createDataFrame(added.select(list(ROW_KEY)).to_pandas())
        data_files = pc.unique(added["data_file"]).to_pylist()
        fresh = version_rows(spark, plan, image_size, data_files).join(F.broadcast(keys), list(ROW_KEY), "left_semi")
    files = {}
    for split in SPLITS:
        keep = list(manifests[split]["files"])
        new_rows = pc.sum(pc.equal(added["split"], split)).as_py() or 0
        if new_rows:  # first: Spark's overwrite empties the generation's folder
            folder = line.generation_folder(split, generation)
            partitions = max(
                1, min(plan.num_partitions, math.ceil(plan.num_partitions * new_rows / max(1, plan.counts[split])))
            )
            if isinstance(fresh, pa.Table):
                write_split_arrow(
                    stored.rows(fresh.filter(pc.equal(fresh["split"], split)), image_size),
                    line.fs,
                    f"{line.root}/{folder}",
                    partitions,
                    seed,
                    generation,
                )
            else:
                write_split(
                    stored.frame(fresh.where(F.col("split") == split).drop("split"), image_size),
                    f"{line.uri}/{folder}",
                    partitions,
                    seed,
                    generation,
                )
            keep += line.files_in(folder)
        if lost.num_rows:
            keep = rewrite_without(line, split, generation, keep, lost)
        if line.rows_in(keep) != plan.counts[split]:
            return None
        files[split] = keep
    return files, generation, not changes.num_rows


def rewrite_without(line: CacheLine, split: str, generation: int, old_files: list[str], lost: pa.Table) -> list[str]:
    """OLD_FILES with the files that hold LOST rows (sha256, label, file) replaced by copies without them."""
    keep = []
    prefix = f"{line.generation_folder(split, generation)}/rewritten"
    # Spark spells a file's URI its own way: the base name (a Spark part name, unique) is what compares.
    lost_in = pa.array([uri.rsplit("/", 1)[-1] for uri in lost.column("file").to_pylist()], pa.string())
    for name in old_files:
        here = lost.filter(pc.equal(lost_in, name.rsplit("/", 1)[-1]))
        if not here.num_rows:
            keep.append(name)
            continue
        with line.fs.open(f"{line.root}/{name}", "rb") as handle:
            table = pq.read_table(handle)
        kept = table.filter(
            pc.invert(pc.is_in(row_key(table["sha256"], table["label"]), row_key(here["sha256"], here["label"])))
        )
        if kept.num_rows:
            target = f"{prefix}-{name.rsplit('/', 1)[-1]}"
            line.fs.makedirs(f"{line.root}/{target.rsplit('/', 1)[0]}", exist_ok=True)
            with line.fs.open(f"{line.root}/{target}", "wb") as out:
                pq.write_table(kept, out)
            keep.append(target)
    return keep


def cache_one_at_a_time(spark: SparkSource, plan: SplitPlan, settings: Settings) -> CachedSplits:
    """cache_splits under the lock of its cache line. Two runs caching one line at once (the nightly run and an ad-hoc
    one) would write the same generation's folder and each list the other's files in its manifest: the second waits,
    then reuses (or grows from) what the first wrote. It waits cache_lock_wait_minutes at most, then fails naming the
    first."""
    stored = Stored.of(settings)
    lock = f"cache-{line_key(plan, settings.image_size, settings.seed, stored)}"
    with one_at_a_time(settings, lock, timeout=settings.lock_wait_seconds("cache")):
        return cache_splits(spark, plan, settings.image_size, settings.cache_uri, settings.seed, lock, stored)


@stage(
    "cache",
    settings=stage_settings("cache"),
    needs=cached_files,
    unfinished=damaged_split,
)
def cache(plan: SplitPlan, settings: Settings) -> CachedSplits:
    """Prefect stage: materialise (or reuse, or grow) the Petastorm cache of every split."""
    return cache_one_at_a_time(on_demand(settings), plan, settings)
