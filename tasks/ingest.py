"""Ingest: list the source (a folder tree or a manifest CSV); diff a listing against the table.

Only new or changed files go on to be read and decoded; unchanged files cost a listing.
The ingest stage lists; the resize stage diffs, since what is new depends on the image size.
The listing is done with fsspec rather than Spark's file sources, which skip folders whose
names start with `_` or `.` and read `name=value` folders as partition columns.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
from dataclasses import dataclass
from datetime import date
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.delta import Engine, read_current, table_version
from infra.settings import Settings
from tasks.results import Ingested, Listed
from tasks.stage import stage

DATE_FOLDER = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$")

LISTING_SCHEMA = pa.schema(
    [
        ("path", pa.string()),
        ("label", pa.string()),
        ("date", pa.date32()),
        ("size", pa.int64()),
        ("mtime", pa.float64()),
        ("issue", pa.string()),
        ("action", pa.string()),
    ]
)


class SourceError(ValueError):
    """The source folder or manifest is missing, unreadable or holds no images."""


@dataclass(frozen=True)
class Scope:
    """Which files a run looks at: the extensions, an optional date range, the size limit."""

    extensions: tuple[str, ...]
    start: date | None = None
    end: date | None = None
    max_file_bytes: int | None = None

    def in_range(self, day: date | None) -> bool:
        if self.start is None and self.end is None:
            return True
        return day is not None and (self.start is None or day >= self.start) and (self.end is None or day <= self.end)


def scope_of(settings: Settings) -> Scope:
    return Scope(tuple(e.lower() for e in settings.image_extensions), settings.start_date, settings.end_date, settings.max_file_bytes)


def source_uri(source: str) -> str:
    """A URI that fsspec reads: local paths become absolute file:// URIs; a folder or a .csv manifest."""
    if "://" in source:
        return source
    path = Path(source).expanduser().resolve()
    if not (path.is_dir() or (path.is_file() and path.suffix.lower() == ".csv")):
        raise SourceError(
            f"source {source!r} is not a folder or a manifest .csv: pass a folder of images laid out as "
            "[date=YYYY-MM-DD/]<label>/<file>, or a CSV with columns path,label[,date]"
        )
    return "file://" + str(path)


def _entry(path: str, label: str | None, day: date | None, size: int, mtime: float, issue: str | None, max_bytes: int | None = None) -> dict[str, Any]:
    if issue is None and size == 0:
        issue = "empty_file"
    elif issue is None and max_bytes and size > max_bytes:
        issue = "file_too_large"
    elif issue is None and not label:
        issue = "no_label"
    return {"path": path, "label": label or "", "date": day, "size": size, "mtime": mtime, "issue": issue, "action": "upsert"}


def _parse_day(text: str) -> date | None:
    try:
        return date.fromisoformat(text)
    except ValueError:
        return None


def _folder_entry(fs: Any, root: str, path: str, info: dict[str, Any], scope: Scope) -> dict[str, Any] | None:
    parts = PurePosixPath(path).relative_to(root).parts
    folders = parts[:-1]
    day, issue = None, None
    for folder in folders:
        match = DATE_FOLDER.match(folder)
        if match:
            day = _parse_day(match.group(1))
            issue = issue or (None if day else "bad_date_folder")
    if not scope.in_range(day):
        return None
    label_folders = [f for f in folders if not DATE_FOLDER.match(f)]
    if any(part.startswith(".") for part in parts):
        issue = "hidden_path"
    elif info.get("islink") and not os.path.realpath(path).startswith(os.path.realpath(root) + os.sep):
        issue = "symlink_outside_source"
    elif info.get("islink") and not os.path.exists(path):
        issue = "unreadable"
    size, mtime = int(info.get("size") or 0), float(info.get("mtime") or 0)
    return _entry(fs.unstrip_protocol(path), label_folders[-1] if label_folders else None, day, size, mtime, issue, scope.max_file_bytes)


def list_folder(uri: str, scope: Scope) -> list[dict[str, Any]]:
    """Every file with an image extension under a folder tree, with label, date and any problem seen so far."""
    fs, root = fsspec.core.url_to_fs(uri)
    entries = []
    for path, info in sorted(fs.find(root, detail=True, withdirs=False).items()):
        if not path.lower().endswith(scope.extensions):
            continue
        entry = _folder_entry(fs, root, path, info, scope)
        if entry is not None:
            entries.append(entry)
    return entries


def list_manifest(uri: str, scope: Scope) -> list[dict[str, Any]]:
    """Files named by a manifest CSV (path,label[,date]); relative paths are relative to the manifest."""
    fs, manifest = fsspec.core.url_to_fs(uri)
    base = manifest.rsplit("/", 1)[0]
    with fs.open(manifest, "r", encoding="utf-8") as handle:
        rows = list(csv.DictReader(io.StringIO(handle.read())))
    if rows and not {"path", "label"} <= set(rows[0]):
        raise SourceError(f"manifest {uri} needs the columns path,label[,date]; it has {', '.join(rows[0])}")
    entries = []
    for number, row in enumerate(rows, start=2):
        day = _parse_day(row["date"]) if row.get("date") else None
        if row.get("date") and day is None:
            raise SourceError(f"manifest {uri} line {number}: date {row['date']!r} is not YYYY-MM-DD")
        if not scope.in_range(day):
            continue
        target = row["path"] if "://" in row["path"] or row["path"].startswith("/") else f"{base}/{row['path']}"
        file_fs, file_path = fsspec.core.url_to_fs(target) if "://" in target else (fs, target)
        try:
            info = file_fs.info(file_path)
        except (FileNotFoundError, OSError):
            entries.append(_entry(file_fs.unstrip_protocol(file_path), row["label"], day, 0, 0.0, "unreadable"))
            continue
        size, mtime = int(info.get("size") or 0), float(info.get("mtime") or 0)
        entries.append(_entry(file_fs.unstrip_protocol(file_path), row["label"], day, size, mtime, None, scope.max_file_bytes))
    return entries


def list_source(uri: str, scope: Scope) -> list[dict[str, Any]]:
    """List a folder tree or a manifest CSV."""
    return list_manifest(uri, scope) if uri.lower().endswith(".csv") else list_folder(uri, scope)


def listing_fingerprint(entries: list[dict[str, Any]]) -> str:
    """A hash of the listing (paths, sizes, stamps, labels, dates): changes when a file is added, removed or rewritten."""
    digest = hashlib.sha256()
    for e in entries:
        digest.update(f"{e['path']}\t{e['size']}\t{e['mtime']}\t{e['label']}\t{e['date']}\t{e['issue']}\n".encode())
    return digest.hexdigest()


def known_files(spark: SparkSession, engine: Engine, table_uri: str, image_size: int, quarantine_uri: str | None = None) -> tuple[int | None, dict[str, tuple[int, float]], set[str]]:
    """The table's version; each path's (size, mtime) in the table (this image size) or the quarantine; the table's paths."""
    known: dict[str, tuple[int, float]] = {}
    if quarantine_uri:
        rows = read_current(spark, quarantine_uri, "delta-rs", ["path", "size", "mtime"]).to_pydict()
        known.update({p: (s, m) for p, s, m in zip(rows["path"], rows["size"], rows["mtime"])})
    rows = read_current(spark, table_uri, engine, ["path", "size", "mtime"], F.col("image_size") == image_size).to_pydict()
    known.update({p: (s, m) for p, s, m in zip(rows["path"], rows["size"], rows["mtime"])})
    return table_version(table_uri), known, set(rows["path"])


def diff_listing(entries: list[dict[str, Any]], known: dict[str, tuple[int, float]], retire_missing: bool, scoped_paths: set[str]) -> tuple[list[dict[str, Any]], int]:
    """Entries that are new or changed, plus `delete` entries for table rows whose file is gone; and the unchanged count."""
    changed = [e for e in entries if known.get(e["path"]) != (e["size"], e["mtime"])]
    unchanged = len(entries) - len(changed)
    if retire_missing:
        listed = {e["path"] for e in entries}
        gone = sorted(path for path in scoped_paths if path not in listed)
        changed += [{**_entry(path, "-", None, 0, 0.0, None), "action": "delete"} for path in gone]
    return changed, unchanged


def paths_in_dates(spark: SparkSession, engine: Engine, table_uri: str, image_size: int, scope: Scope) -> set[str]:
    """Table paths whose date lies in the run's date range (what a date-limited run replaces)."""
    predicate = F.col("image_size") == image_size
    if scope.start:
        predicate &= F.col("date") >= F.lit(scope.start)
    if scope.end:
        predicate &= F.col("date") <= F.lit(scope.end)
    return set(read_current(spark, table_uri, engine, ["path"], predicate).column("path").to_pylist())


def stage_listing(uri: str, scope: Scope, staging_dir: str) -> Listed:
    """List the source and keep the listing in staging, named by its fingerprint."""
    entries = list_source(uri, scope)
    if not entries:
        where = f" dated {scope.start or '...'} to {scope.end or '...'}" if (scope.start or scope.end) else ""
        raise SourceError(f"no image files ({', '.join(scope.extensions)}){where} under {uri}: lay images out as [date=YYYY-MM-DD/]<label>/<file>")
    fingerprint = listing_fingerprint(entries)
    manifest = write_manifest(entries, f"{staging_dir.rstrip('/')}/listing-{fingerprint[:20]}.parquet")
    return Listed(manifest_uri=manifest, source_uri=uri, listed=len(entries), listing_fingerprint=fingerprint)


def write_manifest(entries: list[dict[str, Any]], manifest: str) -> str:
    fs, path = fsspec.core.url_to_fs(manifest)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as out:
        pq.write_table(pa.Table.from_pylist(entries, schema=LISTING_SCHEMA), out)
    return manifest


def diff_against_table(
    spark: SparkSession, engine: Engine, listed: Listed, scope: Scope, table_uri: str, image_size: int, retire_deleted: bool,
    staging_dir: str, quarantine_uri: str | None = None,
) -> Ingested:
    """Keep what is new or changed in a listing since the table's current version (at this image size), and stage that list."""
    with fsspec.open(listed.manifest_uri, "rb") as handle:
        entries = pq.read_table(handle).to_pylist()
    version, known, table_paths = known_files(spark, engine, table_uri, image_size, quarantine_uri)
    dated = scope.start is not None or scope.end is not None
    # A date-limited run replaces exactly its dates: files gone from those dates are retired.
    scoped = paths_in_dates(spark, engine, table_uri, image_size, scope) if dated and version is not None else table_paths
    todo, unchanged = diff_listing(entries, known, retire_deleted or dated, scoped)
    fingerprint = hashlib.sha256(f"{listed.listing_fingerprint}|{table_uri}|{version}|{image_size}".encode()).hexdigest()
    return Ingested(
        manifest_uri=write_manifest(todo, f"{staging_dir.rstrip('/')}/ingest-{fingerprint[:20]}.parquet"),
        source_uri=listed.source_uri,
        listed=listed.listed,
        unchanged=unchanged,
        candidates=sum(1 for e in todo if e["action"] == "upsert"),
        retired=sum(1 for e in todo if e["action"] == "delete"),
        table_version_seen=version,
        content_fingerprint=fingerprint,
    )


def ingest_listing(
    spark: SparkSession, engine: Engine, uri: str, scope: Scope, table_uri: str, image_size: int, retire_deleted: bool,
    staging_dir: str, quarantine_uri: str | None = None,
) -> Ingested:
    """List the source and keep what is new or changed since the table's current version (both steps at once)."""
    listed = stage_listing(uri, scope, staging_dir)
    return diff_against_table(spark, engine, listed, scope, table_uri, image_size, retire_deleted, staging_dir, quarantine_uri)


def source_listing(inputs: dict[str, Any]) -> dict[str, str]:
    """Cache key part for ingest: the listing itself, so new or changed files are a miss without reading them."""
    return {"source listing": listing_fingerprint(list_source(source_uri(inputs["source"]), scope_of(inputs["settings"])))}


@stage("ingest", settings=("image_extensions", "start_date", "end_date", "max_file_bytes", "staging_uri"), facts=source_listing)
def ingest(source: str, settings: Settings) -> Listed:
    """Prefect stage: list the source (what changed since the table is resize's to find, at its image size)."""
    return stage_listing(source_uri(source), scope_of(settings), settings.staging_uri)
