"""Cache: repartition each split of a table version into Petastorm-readable Parquet files (rows in a seeded order), in a
folder keyed by table, version, size, partitioning and seed."""

from __future__ import annotations

import hashlib
import json

import fsspec
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from infra.settings import Settings
from infra.spark import spark_session
from tasks.rules.splits import SPLITS
from tasks.results import CachedSplits, SplitPlan
from tasks.stage import stage
from tasks.table import ImageTable

META_FILE = "meta.json"
# The cache's layout: rows shuffled by seed, with a `position` column. A new layout is a new folder.
LAYOUT = 2


def cache_key(plan: SplitPlan, image_size: int, seed: int) -> str:
    """Everything the cached bytes depend on, hashed."""
    parts = [plan.table_uri, plan.version, image_size, plan.num_partitions, plan.val_fraction, plan.test_fraction, plan.labels, seed, LAYOUT]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def write_split(frame: DataFrame, uri: str, partitions: int, seed: int) -> None:
    """One split as `partitions` Parquet files of 8 MB row groups, rows in a seeded random order.

    Rows are dealt to files by content hash and ordered inside each file by a seeded hash, so no
    row group holds a run of one label (the table's order follows the source folders); `position`
    (file in the high bits, row in the low bits) lets the loader name the row group it was given.
    """
    (
        frame.repartition(partitions, "sha256")
        .sortWithinPartitions(F.xxhash64("sha256", F.lit(seed)))
        .withColumn("position", F.monotonically_increasing_id())
        .write.mode("overwrite")
        .option("parquet.block.size", 8 * 1024 * 1024)
        .parquet(uri)
    )


def _as_uri(path: str) -> str:
    return path if "://" in path else f"file://{path}"


def cache_splits(spark: SparkSession, plan: SplitPlan, image_size: int, cache_root: str, seed: int = 42) -> CachedSplits:
    """Write each split as Parquet with `num_partitions` files, unless a complete cache for this key is there."""
    key = cache_key(plan, image_size, seed)
    base = f"{cache_root.rstrip('/')}/{key}"
    splits = {split: _as_uri(f"{base}/{split}") for split in SPLITS}
    fs, root = fsspec.core.url_to_fs(base)
    reused = fs.exists(f"{root}/{META_FILE}")
    if not reused:
        frame = ImageTable.of_version(spark, plan, image_size).with_split(plan.version, plan.val_fraction, plan.test_fraction)
        index_of = F.create_map(*[F.lit(item) for index, label in enumerate(plan.labels) for item in (label, index)])
        label_index = index_of[F.col("label")]
        for split, uri in splits.items():
            rows = frame.where(F.col("split") == split).select("image", label_index.cast("long").alias("label"), "sha256")
            write_split(rows, uri, plan.num_partitions, seed)
        # The meta file is written last: its presence means every split is complete.
        meta = {"key": key, "labels": plan.labels, "counts": plan.counts, "image_size": image_size, "plan": plan.model_dump()}
        with fs.open(f"{root}/{META_FILE}", "w") as out:
            json.dump(meta, out, indent=2)
    return CachedSplits(
        table_uri=plan.table_uri,
        table_version=plan.version,
        cache_dir=_as_uri(base),
        key=key,
        splits=splits,
        counts=plan.counts,
        labels=plan.labels,
        image_size=image_size,
        num_partitions=plan.num_partitions,
        reused=reused,
        label_counts=plan.label_counts,
        quarantined=plan.quarantined,
    )


@stage("cache", settings=("image_size", "cache_uri", "seed"), code=("tasks.table",))
def cache(plan: SplitPlan, settings: Settings) -> CachedSplits:
    """Prefect stage: materialise (or reuse) the Petastorm cache of every split."""
    return cache_splits(spark_session(settings), plan, settings.image_size, settings.cache_uri, settings.seed)
