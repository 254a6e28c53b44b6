"""A table, a quarantine table and staging in one temp folder, and the data stages run against them."""

from __future__ import annotations

import shutil
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from imagelake.infra.delta import Table, read_version
from imagelake.tasks.data.changes import ingest_listing
from imagelake.tasks.data.listing import source_uri
from imagelake.tasks.data.resize_executor import DecodeRules
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.rules.listed_files import Scope
from imagelake.tasks.stages.resize import resize_images
from imagelake.tasks.stages.write import write_images

SCOPE = Scope((".png", ".jpg", ".jpeg"))
RULES = DecodeRules(size=24, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000)


class LostMount(LocalFileSystem):
    """The local file system as lostmount://, but a folder whose path ends with `lost` cannot be listed (a lost mount,
    its permissions changed). Registered with fsspec below; set `LostMount.lost` and reset it to None."""

    protocol = ("lostmount",)
    root_marker = "/"
    lost: str | None = None

    def ls(self, path, detail=False, **kwargs):
        if self.lost and str(path).rstrip("/").endswith(self.lost):
            raise PermissionError(13, "Permission denied", str(path))
        return super().ls(path, detail=detail, **kwargs)


fsspec.register_implementation("lostmount", LostMount, clobber=True)


class Lake:
    """A table, a quarantine and a staging folder in one temp directory, and one run of the data stages."""

    def __init__(self, spark, root: Path | str, engine: str = "delta-rs") -> None:
        """ROOT: a folder, or an object-store URI such as s3://bucket/prefix."""
        self.spark, self.engine = spark, engine
        self.root = str(root).rstrip("/")
        self.table, self.quarantine = f"{self.root}/tables/images", f"{self.root}/tables/quarantine"
        self.runs = 0

    def run(
        self,
        source: Path | str,
        scope: Scope = SCOPE,
        rules: DecodeRules = RULES,
        retire: bool = False,
        max_bad: float = 0.5,
        in_driver_up_to: int = 0,
        max_retire: float = 1.0,
    ):
        self.runs += 1
        table = ImageTable.at(self.spark, self.table, rules.size, self.engine, self.quarantine)
        ingested = ingest_listing(table, source_uri(str(source)), scope, retire, f"{self.root}/staging")
        resized = resize_images(
            table, ingested, rules, f"{self.root}/staging/resized-{self.runs}", in_driver_up_to=in_driver_up_to
        )
        written = write_images(table, resized, max_bad, max_retire)
        return ingested, resized, written

    def read(self, table: str, columns: list[str], version: int | None = None) -> dict[str, list]:
        """Columns of a table version, read by Spark (through the Delta log, with this lake's engine)."""
        version = Table(table).version() if version is None else version
        rows = read_version(self.spark, table, version, self.engine).select(*columns).collect()
        return {name: [row[name] for row in rows] for name in columns}

    def rows(self, version: int | None = None) -> dict[str, str]:
        data = self.read(self.table, ["path", "sha256"], version)
        return dict(zip(data["path"], data["sha256"], strict=True))

    def quarantined(self) -> dict[str, str]:
        """File name -> reason of the files the quarantine holds (not those requeued, which the next run reads
        again)."""
        requeued = "requeued_at" in Table(self.quarantine).columns()
        data = self.read(self.quarantine, ["path", "reason", *(["requeued_at"] if requeued else [])])
        held = [not requeued or at is None for at in data.get("requeued_at", data["path"])]
        return {Path(p).name: r for p, r, keep in zip(data["path"], data["reason"], held, strict=True) if keep}


def copy_digits(
    digits_dir: Path, target: Path, labels=("0", "1", "2", "3"), per_label: int = 10, skip: int = 0
) -> None:
    for label in labels:
        (target / label).mkdir(parents=True, exist_ok=True)
        for png in sorted((digits_dir / label).glob("*.png"))[skip : skip + per_label]:
            shutil.copy(png, target / label / png.name)
