"""Repartition: a deterministic train/val/test split by content hash, sized to the training workers."""

from __future__ import annotations

from collections import Counter

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from infra.delta import Engine, read_current, read_version, table_version
from infra.settings import Settings
from infra.spark import spark_session
from tasks.results import SplitPlan, Written
from tasks.stage import stage

SPLITS = ("train", "val", "test")
_BUCKETS = float(2**32)


def split_of(sha256_hex: str, val_fraction: float, test_fraction: float) -> str:
    """The split of an image by its content hash: stable as data grows, independent of order."""
    prefix = sha256_hex[:8]
    if len(prefix) < 8 or any(c not in "0123456789abcdefABCDEF" for c in prefix):
        raise ValueError(f"not a sha256 hex digest: {sha256_hex!r}")
    bucket = int(prefix, 16) / _BUCKETS
    if bucket < test_fraction:
        return "test"
    return "val" if bucket < test_fraction + val_fraction else "train"


def split_column(val_fraction: float, test_fraction: float, sha_col: str = "sha256") -> Column:
    """split_of() as a Spark column expression (same arithmetic in doubles)."""
    bucket = F.conv(F.substring(sha_col, 1, 8), 16, 10).cast("double") / F.lit(_BUCKETS)
    return (
        F.when(bucket < F.lit(test_fraction), "test")
        .when(bucket < F.lit(test_fraction + val_fraction), "val")
        .otherwise("train")
    )


def images_with_split(
    spark: SparkSession, table_uri: str, version: int, engine: Engine, image_size: int, val_fraction: float, test_fraction: float
) -> DataFrame:
    """The table at `version`, rows of one image size, with a `split` column."""
    table = read_version(spark, table_uri, version, engine)
    return table.where(F.col("image_size") == image_size).withColumn("split", split_column(val_fraction, test_fraction))


def plan_splits(spark: SparkSession, written: Written, settings: Settings) -> SplitPlan:
    """Count each split and the labels at the written version; fail early if a split or label set is unusable."""
    frame = images_with_split(
        spark, written.table_uri, written.version, written.engine, settings.image_size, settings.val_fraction, settings.test_fraction
    )
    label_counts: dict[str, dict[str, int]] = {split: {} for split in SPLITS}
    for row in frame.groupBy("split", "label").count().collect():
        label_counts[row["split"]][row["label"]] = row["count"]
    counts = {split: sum(by_label.values()) for split, by_label in label_counts.items() if by_label}
    labels = sorted({label for by_label in label_counts.values() for label in by_label})
    empty = [split for split in SPLITS if counts.get(split, 0) == 0]
    if empty:
        raise ValueError(
            f"split(s) {', '.join(empty)} of {written.table_uri} v{written.version} are empty "
            f"({sum(counts.values())} images of size {settings.image_size}): add images or raise val_fraction/test_fraction"
        )
    if len(labels) < 2:
        raise ValueError(f"{written.table_uri} v{written.version} has {len(labels)} label(s): a classifier needs at least 2 label folders")
    return SplitPlan(
        table_uri=written.table_uri,
        version=written.version,
        engine=written.engine,
        labels=labels,
        counts={split: counts[split] for split in SPLITS},
        num_partitions=settings.partitions_per_worker * settings.num_workers,
        val_fraction=settings.val_fraction,
        test_fraction=settings.test_fraction,
        label_counts={split: dict(sorted(label_counts[split].items())) for split in SPLITS},
        quarantined=quarantined_by_reason(spark, settings.quarantine_uri),
    )


def quarantined_by_reason(spark: SparkSession, quarantine_uri: str) -> dict[str, int]:
    """Files in the quarantine table now, by reason."""
    reasons = Counter(read_current(spark, quarantine_uri, "delta-rs", ["reason"]).column("reason").to_pylist())
    return dict(sorted(reasons.items()))


def quarantine_now(inputs: dict) -> dict[str, str]:
    """Cache key part for repartition: the quarantine table's version, which the dataset card reports."""
    return {"table version (quarantine)": str(table_version(inputs["settings"].quarantine_uri))}


@stage("repartition", settings=("image_size", "val_fraction", "test_fraction", "partitions_per_worker", "num_workers"), facts=quarantine_now)
def repartition(written: Written, settings: Settings) -> SplitPlan:
    """Prefect stage: plan the split and the partition count of the written table version."""
    return plan_splits(spark_session(settings), written, settings)
