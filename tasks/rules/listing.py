"""Listing rules: which files of a source (a folder tree or a manifest CSV) a run looks at, with their label, date and
any problem seen without reading them; and the diff of a listing against what the table already holds.

No engine: fsspec lists local folders and object stores alike. Spark's file sources are not used, as they skip folders
whose names start with `_` or `.` and read `name=value` folders as partition columns.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec

from infra.settings import Settings


DATE_FOLDER = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$")


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


def diff_listing(entries: list[dict[str, Any]], known: dict[str, tuple[int, float]], retire_missing: bool, scoped_paths: set[str]) -> tuple[list[dict[str, Any]], int]:
    """Entries that are new or changed, plus `delete` entries for table rows whose file is gone; and the unchanged count."""
    changed = [e for e in entries if known.get(e["path"]) != (e["size"], e["mtime"])]
    unchanged = len(entries) - len(changed)
    if retire_missing:
        listed = {e["path"] for e in entries}
        gone = sorted(path for path in scoped_paths if path not in listed)
        changed += [{**_entry(path, "-", None, 0, 0.0, None), "action": "delete"} for path in gone]
    return changed, unchanged


def date_plan(entries: list[dict[str, Any]], known: dict[str, tuple[int, float]], rows: list[dict[str, Any]], start: date, end: date) -> list[dict[str, Any]]:
    """A backfill's plan: each date from START to END with listed files (ENTRIES) or table rows (ROWS: path, date) is
    missing (no rows yet), stale (files new, changed or gone since the table, per KNOWN (size, mtime) by path) or done."""
    table_paths: dict[date, set[str]] = {}
    for row in rows:
        table_paths.setdefault(row["date"], set()).add(row["path"])
    listed: dict[date, list[dict]] = {}
    for entry in entries:
        listed.setdefault(entry["date"], []).append(entry)
    plan = []
    day = start
    while day <= end:
        files, present = listed.get(day, []), table_paths.get(day, set())
        if files or present:
            changed = sum(1 for e in files if known.get(e["path"]) != (e["size"], e["mtime"]))
            gone = len(present - {e["path"] for e in files})
            status = "missing" if not present and changed == len(files) else ("stale" if changed or gone else "done")
            plan.append({"date": day.isoformat(), "files": len(files), "new_or_changed": changed, "gone": gone, "status": status})
        day += timedelta(days=1)
    return plan
