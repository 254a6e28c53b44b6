"""Listing a source: a folder tree or a manifest CSV, through fsspec, streamed into one Parquet file in staging, named
by its fingerprint. Which files count, and with which label, date and problem, is decided by
tasks/rules/listed_files.py.

The ingest stage lists with it; the resize stage diffs what it listed against the table (changes.py); scoring,
backfills and retention read sources and staging through it too.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import os
import posixpath
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from imagelake.tasks.results import Listed
from imagelake.tasks.rules.listed_files import (
    DATE_FOLDER,
    Scope,
    SourceError,
    add_to_fingerprint,
    change_stamp,
    file_entry,
    parse_day,
)
from imagelake.tasks.rules.schemas import LISTING_SCHEMA


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
    parts = path[len(root) :].strip("/").split("/")
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
    else:
        issue = link_issue(path, root, info) or issue
    size, mtime = int(info.get("size") or 0), modified_seconds(info)
    stamp = stamp_of(fs, path, info) if issue is None else None
    return file_entry(
        fs.unstrip_protocol(path),
        label_folders[-1] if label_folders else None,
        day,
        size,
        mtime,
        issue,
        scope.max_file_bytes,
        stamp,
    )


def link_issue(path: str, root: str, info: dict[str, Any]) -> str | None:
    """Why a link at PATH is not read: it leads outside ROOT (`symlink_outside_source`) or nowhere (`unreadable`)."""
    if info.get("islink") and not os.path.realpath(path).startswith(os.path.realpath(root) + os.sep):
        return "symlink_outside_source"
    if info.get("islink") and not os.path.exists(path):
        return "unreadable"
    return None


def modified_seconds(info: dict[str, Any]) -> float:
    """Seconds since the epoch: local files give `mtime`; S3 `LastModified` (a datetime); 0.0 when the store gives
    neither."""
    stamp = info.get("mtime") or info.get("LastModified") or info.get("updated") or info.get("last_modified") or 0
    if hasattr(stamp, "timestamp"):
        return float(stamp.timestamp())
    try:
        return float(stamp)
    except (TypeError, ValueError):
        return 0.0


def stamp_of(fs: Any, path: str, info: dict[str, Any]) -> str | None:
    """The store's change token for a file (tasks/rules/listed_files.py:change_stamp), or the SHA-256 of its content
    where it gives none."""
    stamp = change_stamp(info)
    if stamp is not None:
        return stamp
    try:
        with fs.open(path, "rb") as handle:
            return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError:
        return None


class ListingIncomplete(OSError):
    """A folder of the source could not be listed: a listing without it would retire its rows, so there is none.
    An OSError, so the stage retries (a mount or a store may come back)."""


def walk_files(fs: Any, folder: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every file under FOLDER with the store's info on it, a folder at a time, in the order of their full paths
    (a folder sorts as its name and a slash, before which its files all fall): two listings of one tree can then be
    diffed by a merge, and the listing needs no sort of its own. Memory holds the folders on the way down, never the
    whole tree: on a local disk only their entries' names (the files are described one at a time, as they are yielded),
    on an object store the store's entries of those folders (it lists a folder whole). A FOLDER that is a file, or
    is missing, is left to fsspec's ls, which lists a file as itself and fails on a missing folder."""
    return walk_local(fs, folder) if lists_by_scandir(fs) and os.path.isdir(folder) else walk_store(fs, folder)


def lists_by_scandir(fs: Any) -> bool:
    """Whether FS is the plain local file system, whose folders can be read a name at a time. A subclass that lists
    or describes files its own way (a mount wrapper, a test's unreadable folder) is asked through its ls and info."""
    return (
        isinstance(fs, LocalFileSystem) and type(fs).ls is LocalFileSystem.ls and type(fs).info is LocalFileSystem.info
    )


def incomplete(fs: Any, folder: str, exc: OSError) -> ListingIncomplete:
    """The error of a folder that could not be listed, naming it and what the store said."""
    return ListingIncomplete(
        f"could not list {fs.unstrip_protocol(folder)} ({type(exc).__name__}: {exc}); the run stops before "
        "it reads, writes or "
        "retires anything: make that folder readable and run again"
    )


def walk_store(fs: Any, folder: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """walk_files through fsspec's ls, a folder level at a time (S3, GCS, memory://, wrapped local file systems). A
    store's file system keeps what it listed (its dircache), which over a whole walk would be the whole tree: each
    folder is dropped from it once listed, so memory holds the entries of the folders on the way down."""
    try:
        entries = fs.ls(folder, detail=True)
    except OSError as exc:  # permissions, a lost mount, a store that timed out: never a listing with a folder missing
        raise incomplete(fs, folder, exc) from exc
    fs.invalidate_cache(folder)
    entries = sorted(entries, key=lambda item: item["name"] + ("/" if item["type"] == "directory" else ""))
    for info in entries:
        if info["type"] == "directory":
            yield from walk_store(fs, info["name"])
        else:
            yield info["name"], info


def walk_local(fs: LocalFileSystem, folder: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """walk_files on a local disk: a folder's names are read and sorted (a folder's with a slash), then each file is
    described as it is yielded, so a folder of a million files costs its names (about 70 bytes each), not a million
    descriptions (about 800 bytes each). A file gone between the two is left out, as fsspec's ls leaves it out."""
    for key in sorted_names(fs, folder):
        path = fs._strip_protocol(os.path.join(folder, key.rstrip("/")))
        if key.endswith("/"):
            yield from walk_local(fs, path)
            continue
        try:
            info = local_info(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise incomplete(fs, folder, exc) from exc
        yield path, info


def sorted_names(fs: LocalFileSystem, folder: str) -> list[str]:
    """A local folder's entry names in order, a folder's (not a link to one: links are not followed) with a slash."""
    try:
        with os.scandir(folder) as found:
            return sorted(entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name for entry in found)
    except OSError as exc:  # permissions, a lost mount: never a listing with a folder missing
        raise incomplete(fs, folder, exc) from exc


def local_info(path: str) -> dict[str, Any]:
    """What fsspec's LocalFileSystem.ls says of a folder's entry (its info of the os.scandir entry, whose stat on POSIX
    is lstat's): a link described as itself, with its target's size (0 when the target is gone) and its destination.
    The same fields and values, so a listing and its fingerprint are those fsspec's ls gives."""
    out = os.lstat(path)
    link = stat.S_ISLNK(out.st_mode)
    size = out.st_size
    if link:
        try:
            size = os.stat(path).st_size
        except OSError:
            size = 0
    kind = "directory" if stat.S_ISDIR(out.st_mode) else "file" if stat.S_ISREG(out.st_mode) else "other"
    info = {
        "name": path,
        "size": size,
        "type": kind,
        "created": getattr(out, "st_birthtime", out.st_ctime),
        "islink": link,
    }
    info.update((field, getattr(out, f"st_{field}")) for field in ("mode", "uid", "gid", "mtime", "ino", "nlink"))
    if link:
        info["destination"] = os.readlink(path)
    return info


def list_folder(uri: str, scope: Scope) -> Iterator[dict[str, Any]]:
    """Every file with an image extension under a folder tree, with label, date and any problem seen so far."""
    fs, root = fsspec.core.url_to_fs(uri)
    root = root.rstrip("/")
    fs.invalidate_cache()  # object stores' file systems keep the folders they listed: a run must see the store now
    for path, info in walk_files(fs, root):
        if path.lower().endswith(scope.extensions):
            entry = _folder_entry(fs, root, path, info, scope)
            if entry is not None:
                yield entry


def list_manifest(uri: str, scope: Scope) -> Iterator[dict[str, Any]]:
    """Files named by a manifest CSV (path,label[,date]), read a line at a time; relative paths are relative to the
    manifest."""
    fs, manifest = fsspec.core.url_to_fs(uri)
    base = manifest.rsplit("/", 1)[0]
    with fs.open(manifest, "r", encoding="utf-8", newline="") as handle:
        yield from manifest_entries(uri, base, fs, csv.DictReader(handle), scope)


def manifest_entries(uri: str, base: str, fs: Any, rows: csv.DictReader, scope: Scope) -> Iterator[dict[str, Any]]:
    if rows.fieldnames and not {"path", "label"} <= set(rows.fieldnames):
        raise SourceError(f"manifest {uri} needs the columns path,label[,date]; it has {', '.join(rows.fieldnames)}")
    roots = [fs.unstrip_protocol(posixpath.normpath(base)), *(canonical_uri(root) for root in scope.manifest_roots)]
    for number, row in enumerate(rows, start=2):
        day = parse_day(row["date"]) if row.get("date") else None
        if row.get("date") and day is None:
            raise SourceError(f"manifest {uri} line {number}: date {row['date']!r} is not YYYY-MM-DD")
        if not scope.in_range(day):
            continue
        target = row["path"] if "://" in row["path"] or row["path"].startswith("/") else f"{base}/{row['path']}"
        file_fs, file_path = fsspec.core.url_to_fs(target) if "://" in target else (fs, target)
        file_path = posixpath.normpath(file_path)
        if not any(is_within(file_fs.unstrip_protocol(file_path), root) for root in roots):
            raise SourceError(
                f"manifest {uri} line {number}: {row['path']!r} is outside the manifest's folder "
                f"{fs.unstrip_protocol(base)}; "
                "name files under it, or add their folder to the setting manifest_roots"
            )
        if escapes_by_link(file_fs, file_path, roots):  # the rule of folder sources: quarantined, never read
            yield file_entry(file_fs.unstrip_protocol(file_path), row["label"], day, 0, 0.0, "symlink_outside_source")
            continue
        try:
            info = file_fs.info(file_path)
        except (FileNotFoundError, OSError):
            yield file_entry(file_fs.unstrip_protocol(file_path), row["label"], day, 0, 0.0, "unreadable")
            continue
        size, mtime = int(info.get("size") or 0), modified_seconds(info)
        stamp = stamp_of(file_fs, file_path, info)
        yield file_entry(
            file_fs.unstrip_protocol(file_path), row["label"], day, size, mtime, None, scope.max_file_bytes, stamp
        )


def escapes_by_link(fs: Any, path: str, roots: list[str]) -> bool:
    """Whether a local PATH, inside ROOTS as written, lies outside all of them once its symbolic links (of the file or
    of any folder on its way) are followed. Object stores have no links."""
    if not isinstance(fs, LocalFileSystem):
        return False
    real = "file://" + os.path.realpath(path)
    local_roots = [
        "file://" + os.path.realpath(fsspec.core.url_to_fs(root)[1]) for root in roots if root.startswith("file://")
    ]
    return not any(is_within(real, root) for root in local_roots)


def canonical_uri(location: str) -> str:
    """A folder or URI as fsspec spells it, with `.` and `..` resolved (local paths become file:// URIs)."""
    fs, path = fsspec.core.url_to_fs(location)
    return fs.unstrip_protocol(posixpath.normpath(path))


def is_within(uri: str, root: str) -> bool:
    """Whether URI is ROOT or below it (both canonical)."""
    return uri == root or uri.startswith(root.rstrip("/") + "/")


def is_manifest(uri: str) -> bool:
    """Whether a source URI names a manifest CSV (else it is a folder tree)."""
    return uri.lower().endswith(".csv")


def iter_source(uri: str, scope: Scope) -> Iterator[dict[str, Any]]:
    """List a folder tree or a manifest CSV, an entry at a time."""
    return list_manifest(uri, scope) if is_manifest(uri) else list_folder(uri, scope)


def list_source(uri: str, scope: Scope) -> list[dict[str, Any]]:
    """The whole listing of a folder tree or a manifest CSV, in memory (for a date plan; a run streams it instead)."""
    return list(iter_source(uri, scope))


# Entries per Parquet row group of a listing: the driver holds one batch of them, never the whole listing.
LISTING_BATCH = 20_000


def save_listing(uri: str, scope: Scope, staging_dir: str) -> Listed:
    """List the source into staging a batch at a time, hashing it on the way; the file is named by that fingerprint."""
    fs, folder = fsspec.core.url_to_fs(staging_dir)
    folder = folder.rstrip("/")
    fs.makedirs(folder, exist_ok=True)
    aside, digest, listed = f"{folder}/.listing-{uuid.uuid4().hex}.parquet", hashlib.sha256(), 0
    entries = iter_source(uri, scope)
    try:
        with fs.open(aside, "wb") as out, pq.ParquetWriter(out, LISTING_SCHEMA) as writer:
            while batch := list(itertools.islice(entries, LISTING_BATCH)):
                add_to_fingerprint(digest, batch)
                writer.write_table(pa.Table.from_pylist(batch, schema=LISTING_SCHEMA))
                listed += len(batch)
        if not listed:
            where = f" dated {scope.start or '...'} to {scope.end or '...'}" if (scope.start or scope.end) else ""
            raise SourceError(
                f"no image files ({', '.join(scope.extensions)}){where} under {uri}: lay images out as "
                "[date=YYYY-MM-DD/]<label>/<file>"
            )
        fingerprint = digest.hexdigest()
        manifest = f"{folder}/listing-{fingerprint[:20]}.parquet"
        fs.mv(aside, manifest)
    finally:
        if fs.exists(aside):
            fs.rm(aside)
    return Listed(
        manifest_uri=fs.unstrip_protocol(manifest), source_uri=uri, listed=listed, listing_fingerprint=fingerprint
    )


def write_manifest(entries: list[dict[str, Any]] | pa.Table, manifest: str) -> str:
    """A listing (or a diff's entries, already Arrow) as one Parquet file; returns its URI.

    Written aside, then moved into place: a manifest is named by its content, so two runs of the same source write the
    same one at the same time, and one may read it while the other writes it again. A reader sees a whole file."""
    fs, path = fsspec.core.url_to_fs(manifest)
    folder, name = path.rsplit("/", 1)
    fs.makedirs(folder, exist_ok=True)
    aside = f"{folder}/.{name}.{uuid.uuid4().hex}"
    try:
        with fs.open(aside, "wb") as out:
            pq.write_table(
                entries if isinstance(entries, pa.Table) else pa.Table.from_pylist(entries, schema=LISTING_SCHEMA), out
            )
        fs.mv(aside, path)
    finally:
        if fs.exists(aside):
            fs.rm(aside)
    return manifest
