"""Split: plan a table version's train/val/test split by content hash, and the partition count the cache stage
repartitions it into."""

from __future__ import annotations

import hashlib
import json
import uuid

import fsspec

from infra.delta import Table
from infra.settings import Settings
from infra.spark import SparkSource, on_demand
from tasks.results import SplitPlan, TableVersion
from tasks.rules.splits import SPLITS, check_splits
from tasks.stage import stage
from tasks.table import DRIVER_BYTES, ImageTable, splits_of


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


SPLIT_COUNTS = "split-counts"  # staging's folder of PlanRecords, one folder per key


def record_version(name: str) -> int | None:
    """The table version of a split-count record's file name (vN.json); None for any other name."""
    return int(name[1:-5]) if name.startswith("v") and name.endswith(".json") and name[1:-5].isdigit() else None


class PlanRecords:
    """Each planned version's images per (split, label), for one table, image size and pair of fractions, in staging."""

    def __init__(self, settings: Settings, written: TableVersion) -> None:
        self.val_fraction, self.test_fraction = settings.val_fraction, settings.test_fraction
        # Keyed by the table's id too: a table made anew at the same place does not carry on from the old one's counts.
        key = hashlib.sha256(
            json.dumps(
                [
                    written.table_uri,
                    Table(written.table_uri).table_id(),
                    settings.image_size,
                    self.val_fraction,
                    self.test_fraction,
                ]
            ).encode()
        ).hexdigest()[:20]
        self.fs, self.folder = fsspec.core.url_to_fs(f"{settings.staging_uri.rstrip('/')}/{SPLIT_COUNTS}/{key}")

    def versions(self) -> list[int]:
        if not self.fs.exists(self.folder):
            return []
        versions = [record_version(path.rsplit("/", 1)[-1]) for path in self.fs.ls(self.folder, detail=False)]
        return sorted(v for v in versions if v is not None)

    def save(self, version: int, label_counts: dict[str, dict[str, int]]) -> None:
        self.fs.makedirs(self.folder, exist_ok=True)
        aside = f"{self.folder}/.v{version}.{uuid.uuid4().hex}"
        self.fs.pipe_file(aside, json.dumps(label_counts, sort_keys=True).encode())
        self.fs.mv(aside, f"{self.folder}/v{version}.json")

    def carried_forward(self, table: ImageTable, version: int) -> dict[str, dict[str, int]] | None:
        """VERSION's counts from the latest recorded version before it and the rows of the files that changed since;
        None
        if there is none, or the change cannot be read without Spark or its new files hold more than DRIVER_BYTES."""
        earlier = [v for v in self.versions() if v <= version]
        if not earlier:
            return None
        base = earlier[-1]
        counts = json.loads(self.fs.cat_file(f"{self.folder}/v{base}.json"))
        if base == version:
            return counts
        between = table.rows_between(base, version, ["sha256", "label"], max_bytes=DRIVER_BYTES)
        if between is None:
            return None
        for side, sign in zip(between, (1, -1), strict=True):
            for split, label in zip(
                splits_of(side["sha256"], self.val_fraction, self.test_fraction).to_pylist(),
                side["label"].to_pylist(),
                strict=True,
            ):
                by_label = counts.setdefault(split, {})
                by_label[label] = by_label.get(label, 0) + sign
        if any(n < 0 for by_label in counts.values() for n in by_label.values()):
            return None  # not the record of this table's history (a table made anew at the same place): count again
        return {split: {label: n for label, n in counts.get(split, {}).items() if n} for split in SPLITS}


def quarantine_now(inputs: dict) -> dict[str, str]:
    """Key part for split: the quarantine table's version, which the dataset card reports."""
    return {"table version (quarantine)": str(Table(inputs["settings"].quarantine_uri).version())}


@stage(
    "split",
    settings=("image_size", "val_fraction", "test_fraction", "partitions_per_worker", "num_workers"),
    facts=quarantine_now,
    code=("tasks.rules.splits",),
)
def split(table: TableVersion, settings: Settings) -> SplitPlan:
    """Prefect stage: plan the split and the partition count of one table version."""
    return plan_splits(on_demand(settings), table, settings)
