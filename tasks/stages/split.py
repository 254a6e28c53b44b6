"""Split: plan a table version's train/val/test split by content hash, and the partition count the cache stage
repartitions it into."""

from __future__ import annotations

from imagelake.infra.delta import Table
from imagelake.infra.settings import Settings, stage_settings
from imagelake.infra.spark import SparkSource, on_demand
from imagelake.tasks.data.split_records import PlanRecords
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.results import SplitPlan, TableVersion
from imagelake.tasks.rules.splits import SPLITS, check_splits
from imagelake.tasks.stage import stage


def plan_splits(spark: SparkSource, written: TableVersion, settings: Settings) -> SplitPlan:
    """Count each split and the labels at the written version; fail early if a split or label set is unusable.

    The counts of an earlier version planned with the same fractions (recorded in staging) are brought forward by the
    rows of the data files that changed since (`ImageTable.rows_between`, no Spark job); otherwise one Spark query
    counts.
    SPARK may be a function that starts the session: only that query calls it."""
    table = ImageTable.of_version(spark, written, settings.image_size, settings.quarantine_uri)
    records = PlanRecords(settings, written)
    label_counts = records.carried_forward(table, written.version)
    if label_counts is None:
        label_counts = {split: {} for split in SPLITS}
        frame = table.with_split(written.version, settings.val_fraction, settings.test_fraction)
        for row in frame.groupBy("split", "label").count().collect():
            label_counts[row["split"]][row["label"]] = row["count"]
    counts, labels = check_splits(label_counts, f"{written.table_uri} v{written.version}", settings.image_size)
    records.save(written.version, label_counts)
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
    """Key part for split: the quarantine table's version, which the dataset card reports."""
    return {"table version (quarantine)": str(Table(inputs["settings"].quarantine_uri).version())}


@stage(
    "split",
    settings=stage_settings("split"),
    facts=quarantine_now,
)
def split(table: TableVersion, settings: Settings) -> SplitPlan:
    """Prefect stage: plan the split and the partition count of one table version."""
    return plan_splits(on_demand(settings), table, settings)
