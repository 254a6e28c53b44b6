"""Listing rules: the label, date and any problem of a listed file (from its path and size alone), which dates a run
looks at, the listing's fingerprint, its diff against what the table already holds, and a backfill's plan of dates.

No I/O and no engine: tasks/data/listing.py lists the files (fsspec) and hands their paths and sizes here.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

from imagelake.infra.settings import Settings

DATE_FOLDER = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$")


class SourceError(ValueError):
    """The source folder or manifest is missing, unreadable or holds no images."""


@dataclass(frozen=True)
class Scope:
    """Which files a run looks at: the extensions, an optional date range, the size limit, where a manifest may
    point."""

    extensions: tuple[str, ...]
    start: date | None = None
    end: date | None = None
    max_file_bytes: int | None = None
    manifest_roots: tuple[str, ...] = ()  # beside a manifest's own folder, where its rows may point

    def in_range(self, day: date | None) -> bool:
        if self.start is None and self.end is None:
            return True
        return day is not None and (self.start is None or day >= self.start) and (self.end is None or day <= self.end)


def scope_of(settings: Settings) -> Scope:
    return Scope(
        tuple(e.lower() for e in settings.image_extensions),
        settings.start_date,
        settings.end_date,
        settings.max_file_bytes,
        tuple(settings.manifest_roots),
    )


# Where a store gives one, the token that changes whenever an object's content is written, in order of preference:
# S3's version id (versioned buckets), GCS' generation, then the ETag (S3, GCS, Azure, S3-compatible servers).
STORE_STAMPS = ("VersionId", "generation", "ETag", "etag")


def change_stamp(info: dict[str, Any]) -> str | None:
    """What tells a rewritten file from the one the table holds, beyond size and mtime (which a copy can keep).

    Object stores: their version id or ETag. A local file system has neither; its change time (ctime, which
    `cp -p`, `touch -r` and `os.utime` cannot set) and inode do the job. None: the store gives nothing, and
    ingest hashes the content instead.
    """
    for key in STORE_STAMPS:
        if info.get(key):
            return f"{key.lower()}:{str(info[key]).strip(chr(34))}"
    if info.get("ino") and info.get("created"):
        return f"ctime:{info['created']!r}:ino:{info['ino']}"
    return None


def file_entry(
    path: str,
    label: str | None,
    day: date | None,
    size: int,
    mtime: float,
    issue: str | None,
    max_bytes: int | None = None,
    stamp: str | None = None,
) -> dict[str, Any]:
    if issue is None and size == 0:
        issue = "empty_file"
    elif issue is None and max_bytes and size > max_bytes:
        issue = "file_too_large"
    elif issue is None and not label:
        issue = "no_label"
    return {
        "path": path,
        "label": label or "",
        "date": day,
        "size": size,
        "mtime": mtime,
        "stamp": stamp,
        "issue": issue,
        "action": "upsert",
    }


def parse_day(text: str) -> date | None:
    try:
        return date.fromisoformat(text)
    except ValueError:
        return None


def listing_fingerprint(entries: Iterable[dict[str, Any]]) -> str:
    """A hash of the listing (paths, sizes, stamps, labels, dates): changes when a file is added, removed or
    rewritten."""
    digest = hashlib.sha256()
    add_to_fingerprint(digest, entries)
    return digest.hexdigest()


def add_to_fingerprint(digest: Any, entries: Iterable[dict[str, Any]]) -> None:
    """Feed entries to a listing's hash (a listing is hashed a batch at a time, in its order)."""
    for e in entries:
        digest.update(
            f"{e['path']}\t{e['size']}\t{e['mtime']}\t{e.get('stamp')}\t{e['label']}\t{e['date']}\t{e['issue']}\n".encode()
        )


Known = dict[str, tuple[int, float, str | None]]  # path -> (size, mtime, stamp) of the table's row


def is_changed(entry: dict[str, Any], known: Known) -> bool:
    """Whether a listed file differs from the table's row for its path: new, another size or mtime, or another stamp.

    Rows written before stamps were recorded (stamp None) are compared on size and mtime alone.
    """
    row = known.get(entry["path"])
    if row is None or (row[0], row[1]) != (entry["size"], entry["mtime"]):
        return True
    return row[2] is not None and row[2] != entry.get("stamp")


def check_date_range(start: date, end: date) -> None:
    """Refuse a backfill range whose first date comes after its last."""
    if start > end:
        raise ValueError(f"start_date {start} is after end_date {end}: swap them")


def date_plan(days: dict[date, dict[str, int]], start: date, end: date) -> list[dict[str, Any]]:
    """A backfill's plan: each date from START to END with listed files or table rows is missing (no rows yet, every
    listed file new), stale (files new, changed or gone since the table) or done. DAYS gives per date the files listed,
    how many of them are new or changed, the table's rows and how many of those lost their file."""
    plan = []
    day = start
    while day <= end:
        counts = {"files": 0, "new_or_changed": 0, "rows": 0, "gone": 0, **days.get(day, {})}
        if counts["files"] or counts["rows"]:
            changed, gone = counts["new_or_changed"], counts["gone"]
            status = (
                "missing"
                if not counts["rows"] and changed == counts["files"]
                else ("stale" if changed or gone else "done")
            )
            plan.append(
                {
                    "date": day.isoformat(),
                    "files": counts["files"],
                    "new_or_changed": changed,
                    "gone": gone,
                    "status": status,
                }
            )
        day += timedelta(days=1)
    return plan
