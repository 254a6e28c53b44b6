"""Ingest: list the source (a folder tree or a manifest CSV, through fsspec) and keep the listing in staging, named by its
fingerprint. Which files count, and with which label, date and problem, is decided by tasks/rules/listing.py.

The ingest stage only lists: what is new or changed depends on the image size, so the resize stage diffs the listing
against the table (tasks/changes.py). The listing rules are in tasks/rules/listing.py.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from infra.settings import Settings
from tasks.results import Listed
from tasks.rules.listing import DATE_FOLDER, Scope, SourceError, change_stamp, file_entry, listing_fingerprint, parse_day, scope_of
from tasks.rules.schemas import LISTING_SCHEMA
from tasks.stage import stage


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


def _folder_entry(fs: Any, root: str, path: str, info: dict[str, Any], scope: Scope) -> dict[str, Any] | None:
    parts = PurePosixPath(path).relative_to(root).parts
    folders = parts[:-1]
    day, issue = None, None
    for folder in folders:
        match = DATE_FOLDER.match(folder)
        if match:
            day = parse_day(match.group(1))
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
    size, mtime = int(info.get("size") or 0), modified_seconds(info)
    stamp = stamp_of(fs, path, info) if issue is None else None
    return file_entry(fs.unstrip_protocol(path), label_folders[-1] if label_folders else None, day, size, mtime, issue, scope.max_file_bytes, stamp)


def modified_seconds(info: dict[str, Any]) -> float:
    """Seconds since the epoch: local files give `mtime`; S3 `LastModified` (a datetime); 0.0 when the store gives neither."""
    stamp = info.get("mtime") or info.get("LastModified") or info.get("updated") or info.get("last_modified") or 0
    if hasattr(stamp, "timestamp"):
        return float(stamp.timestamp())
    try:
        return float(stamp)
    except (TypeError, ValueError):
        return 0.0


def stamp_of(fs: Any, path: str, info: dict[str, Any]) -> str | None:
    """The store's change token for a file (tasks/rules/listing.py:change_stamp), or the SHA-256 of its content where it gives none."""
    stamp = change_stamp(info)
    if stamp is not None:
        return stamp
    try:
        with fs.open(path, "rb") as handle:
            return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError:
        return None


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
        day = parse_day(row["date"]) if row.get("date") else None
        if row.get("date") and day is None:
            raise SourceError(f"manifest {uri} line {number}: date {row['date']!r} is not YYYY-MM-DD")
        if not scope.in_range(day):
            continue
        target = row["path"] if "://" in row["path"] or row["path"].startswith("/") else f"{base}/{row['path']}"
        file_fs, file_path = fsspec.core.url_to_fs(target) if "://" in target else (fs, target)
        try:
            info = file_fs.info(file_path)
        except (FileNotFoundError, OSError):
            entries.append(file_entry(file_fs.unstrip_protocol(file_path), row["label"], day, 0, 0.0, "unreadable"))
            continue
        size, mtime = int(info.get("size") or 0), modified_seconds(info)
        stamp = stamp_of(file_fs, file_path, info)
        entries.append(file_entry(file_fs.unstrip_protocol(file_path), row["label"], day, size, mtime, None, scope.max_file_bytes, stamp))
    return entries


def list_source(uri: str, scope: Scope) -> list[dict[str, Any]]:
    """List a folder tree or a manifest CSV."""
    return list_manifest(uri, scope) if uri.lower().endswith(".csv") else list_folder(uri, scope)


def save_listing(uri: str, scope: Scope, staging_dir: str) -> Listed:
    """List the source and keep the listing in staging, named by its fingerprint."""
    entries = list_source(uri, scope)
    if not entries:
        where = f" dated {scope.start or '...'} to {scope.end or '...'}" if (scope.start or scope.end) else ""
        raise SourceError(f"no image files ({', '.join(scope.extensions)}){where} under {uri}: lay images out as [date=YYYY-MM-DD/]<label>/<file>")
    fingerprint = listing_fingerprint(entries)
    manifest = write_manifest(entries, f"{staging_dir.rstrip('/')}/listing-{fingerprint[:20]}.parquet")
    return Listed(manifest_uri=manifest, source_uri=uri, listed=len(entries), listing_fingerprint=fingerprint)


def write_manifest(entries: list[dict[str, Any]] | pa.Table, manifest: str) -> str:
    """A listing (or a diff's entries, already Arrow) as one Parquet file; returns its URI."""
    fs, path = fsspec.core.url_to_fs(manifest)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as out:
        pq.write_table(entries if isinstance(entries, pa.Table) else pa.Table.from_pylist(entries, schema=LISTING_SCHEMA), out)
    return manifest


def source_listing(inputs: dict[str, Any]) -> dict[str, str]:
    """Cache key part for ingest: the listing itself, so new or changed files are a miss without reading them."""
    return {"source listing": listing_fingerprint(list_source(source_uri(inputs["source"]), scope_of(inputs["settings"])))}


@stage("ingest", settings=("image_extensions", "start_date", "end_date", "max_file_bytes", "staging_uri"), facts=source_listing, code=("tasks.rules.listing", "tasks.rules.schemas"))
def ingest(source: str, settings: Settings) -> Listed:
    """Prefect stage: list the source (what changed since the table is resize's to find, at its image size)."""
    return save_listing(source_uri(source), scope_of(settings), settings.staging_uri)
