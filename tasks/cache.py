"""Cache: Petastorm-readable Parquet of each split, in a folder keyed by table, version, size and partitioning."""

from __future__ import annotations

import hashlib
import json

import fsspec
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.settings import Settings
from infra.spark import spark_session
from tasks.repartition import SPLITS, images_with_split
from tasks.results import CachedSplits, SplitPlan
from tasks.stage import stage

META_FILE = "meta.json"


def cache_key(plan: SplitPlan, image_size: int) -> str:
    """Everything the cached bytes depend on, hashed."""
    parts = [plan.table_uri, plan.version, image_size, plan.num_partitions, plan.val_fraction, plan.test_fraction, plan.labels]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def _as_uri(path: str) -> str:
    return path if "://" in path else f"file://{path}"


def cache_splits(spark: SparkSession, plan: SplitPlan, image_size: int, cache_root: str) -> CachedSplits:
    """Write each split as Parquet with `num_partitions` files, unless a complete cache for this key is there."""
    key = cache_key(plan, image_size)
    base = f"{cache_root.rstrip('/')}/{key}"
    splits = {split: _as_uri(f"{base}/{split}") for split in SPLITS}
    fs, root = fsspec.core.url_to_fs(base)
    reused = fs.exists(f"{root}/{META_FILE}")
    if not reused:
        frame = images_with_split(
            spark, plan.table_uri, plan.version, plan.engine, image_size, plan.val_fraction, plan.test_fraction
        )
        index_of = F.create_map(*[F.lit(item) for index, label in enumerate(plan.labels) for item in (label, index)])
        label_index = index_of[F.col("label")]
        for split, uri in splits.items():
            (
                frame.where(F.col("split") == split)
                .select("image", label_index.cast("long").alias("label"), "sha256")
                .repartition(plan.num_partitions, "sha256")
                .write.mode("overwrite")
                .option("parquet.block.size", 8 * 1024 * 1024)
                .parquet(uri)
            )
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
    )


@stage("cache", settings=("image_size", "cache_uri"))
def cache(plan: SplitPlan, settings: Settings) -> CachedSplits:
    """Prefect stage: materialise (or reuse) the Petastorm cache of every split."""
    return cache_splits(spark_session(settings), plan, settings.image_size, settings.cache_uri)
