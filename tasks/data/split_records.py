"""The split stage's records in staging: each table version's split counts, kept so that the next version's plan
counts only what changed. The split stage writes and reads them; retention keeps each table's newest."""

from __future__ import annotations

import hashlib
import json
import uuid

import fsspec

from imagelake.infra.delta import Table
from imagelake.infra.settings import Settings
from imagelake.tasks.data.table import DRIVER_BYTES, ImageTable, splits_of
from imagelake.tasks.results import TableVersion
from imagelake.tasks.rules.splits import SPLITS

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
        None if there is none, or the change cannot be read without Spark or its new files hold more than
        DRIVER_BYTES."""
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
