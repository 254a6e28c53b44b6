"""Split: plan a table version's train/val/test split by content hash, and the partition count the cache stage repartitions it into."""

from __future__ import annotations

from pyspark.sql import SparkSession

from infra.delta import Table
from infra.settings import Settings
from infra.spark import spark_session
from tasks.results import SplitPlan, TableVersion
from tasks.rules.splits import SPLITS, check_splits
from tasks.stage import stage
from tasks.table import ImageTable


def plan_splits(spark: SparkSession, written: TableVersion, settings: Settings) -> SplitPlan:
    """Count each split and the labels at the written version; fail early if a split or label set is unusable."""
    table = ImageTable.of_version(spark, written, settings.image_size, settings.quarantine_uri)
    frame = table.with_split(written.version, settings.val_fraction, settings.test_fraction)
    label_counts: dict[str, dict[str, int]] = {split: {} for split in SPLITS}
    for row in frame.groupBy("split", "label").count().collect():
        label_counts[row["split"]][row["label"]] = row["count"]
    counts, labels = check_splits(label_counts, f"{written.table_uri} v{written.version}", settings.image_size)
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
        quarantined=table.quarantined_by_reason(),
    )


def quarantine_now(inputs: dict) -> dict[str, str]:
    """Cache key part for split: the quarantine table's version, which the dataset card reports."""
    return {"table version (quarantine)": str(Table(inputs["settings"].quarantine_uri).version())}


@stage("split", settings=("image_size", "val_fraction", "test_fraction", "partitions_per_worker", "num_workers"), facts=quarantine_now, code=("tasks.rules.splits",))
def split(table: TableVersion, settings: Settings) -> SplitPlan:
    """Prefect stage: plan the split and the partition count of one table version."""
    return plan_splits(spark_session(settings), table, settings)
