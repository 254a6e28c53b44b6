"""Retention: the workspace's files handed between stages, stored stage results and training runs' checkpoints go once
they are older than `workspace_retention_hours`, so a workspace that runs every night stays the same size.

What is removed can always be made again: a later run that wanted it recomputes it (a stage result that names a removed
file is not reused, see `stage(needs=...)`). What a later run reads first is kept whatever its age: the listing the
tables were last in step with, the newest split-count record of each table, the stages' key records, and each manifest's
record of the paths it named (data/changes.py:record_named; not made again: without it the manifest retires nothing).
"""

from __future__ import annotations

import json
import time
from typing import Any

import fsspec
from prefect.cache_policies import NO_CACHE

from imagelake.infra.settings import Settings
from imagelake.tasks.data.changes import IN_SYNC
from imagelake.tasks.data.listing import modified_seconds
from imagelake.tasks.data.split_records import SPLIT_COUNTS, record_version
from imagelake.tasks.progress import stage_logger
from imagelake.tasks.stage import stage

# Staging's files, by the stage that writes them: ingest's listings and the diff's lists of changes (and the files a
# crashed write of either left aside), and resize's output folders.
STAGING_FILES = ("listing-", ".listing-", "ingest-", ".ingest-")
STAGING_FOLDERS = ("resize-",)


def is_old(fs: fsspec.AbstractFileSystem, path: str, cutoff: float, listed: dict[str, Any] | None = None) -> bool:
    """Whether PATH (a file, or every file in a folder) last changed before CUTOFF. LISTED is PATH's entry from a
    listing, which saves asking the store again. A path whose age the store does not give (0.0) is never old: it is
    kept; one gone meanwhile (another run's retention took it) is not there to remove."""
    try:
        info = listed or fs.info(path)
        if info["type"] == "directory":
            changed = max((modified_seconds(found) for found in fs.find(path, detail=True).values()), default=0.0)
        else:
            changed = modified_seconds(info)
    except FileNotFoundError:
        return False
    return 0.0 < changed < cutoff


def old_entries(fs: fsspec.AbstractFileSystem, listed: list[dict[str, Any]], cutoff: float) -> list[str]:
    return [entry["name"] for entry in listed if is_old(fs, entry["name"], cutoff, entry)]


def entries(fs: fsspec.AbstractFileSystem, folder: str) -> list[dict[str, Any]]:
    return fs.ls(folder, detail=True) if fs.exists(folder) else []


def name_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def remove(fs: fsspec.AbstractFileSystem, paths: list[str]) -> list[str]:
    """Remove PATHS; return those this call removed. Runs that end together may both reach for one old path: whoever
    comes second finds it gone, which is no error."""
    removed = []
    for path in paths:
        try:
            fs.rm(path, recursive=True)  # a file or a folder
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def listings_in_use(fs: fsspec.AbstractFileSystem, in_sync: str) -> set[str]:
    """The listings that `last-*.json` records name: the next run diffs its own listing against them."""
    used = set()
    for entry in entries(fs, in_sync):
        if name_of(entry["name"]).startswith("last-") and entry["name"].endswith(".json"):
            try:
                used.add(fsspec.core.url_to_fs(json.loads(fs.cat_file(entry["name"]))["listing"])[1])
            except (OSError, ValueError, KeyError):  # an unreadable record protects nothing, and is kept itself
                continue
    return used


def prune_staging(uri: str, cutoff: float) -> list[str]:
    """Remove staging's old listings, change lists, resize outputs, in-sync markers and split-count records."""
    fs, root = fsspec.core.url_to_fs(uri)
    in_sync = f"{root}/{IN_SYNC}"
    kept = listings_in_use(fs, in_sync)
    ours = [
        e
        for e in entries(fs, root)
        if e["name"] not in kept
        and name_of(e["name"]).startswith(STAGING_FILES if e["type"] == "file" else STAGING_FOLDERS)
    ]
    markers = [e for e in entries(fs, in_sync) if e["type"] == "file" and not name_of(e["name"]).startswith("last-")]
    removed = old_entries(fs, ours, cutoff) + old_entries(fs, markers, cutoff)
    for folder in entries(fs, f"{root}/{SPLIT_COUNTS}"):
        records = sorted(
            (
                e
                for e in entries(fs, folder["name"])
                if e["type"] == "file" and record_version(name_of(e["name"])) is not None
            ),
            key=lambda e: record_version(name_of(e["name"])),
        )
        removed += old_entries(fs, records[:-1], cutoff)  # the newest carries the counts forward
    return remove(fs, removed)


def prune_results(uri: str, cutoff: float) -> list[str]:
    """Remove old stored stage results (each a file named after its stage and key); the key records stay."""
    fs, root = fsspec.core.url_to_fs(uri)
    return remove(fs, old_entries(fs, [e for e in entries(fs, root) if e["type"] == "file"], cutoff))


def prune_training_runs(uri: str, cutoff: float) -> list[str]:
    """Remove Ray Train run folders (their checkpoints) that nothing has written to since CUTOFF. A run still training
    writes every epoch; one that crashed is resumed by its retry within the retention, or trained again after it."""
    fs, root = fsspec.core.url_to_fs(uri)
    return remove(fs, old_entries(fs, [e for e in entries(fs, root) if e["type"] == "directory"], cutoff))


def prune_workspace(settings: Settings, now: float | None = None) -> dict[str, int]:
    """Remove what retention lets go of; report how many entries went from each place."""
    cutoff = (time.time() if now is None else now) - settings.workspace_retention_hours * 3600
    return {
        "staging": len(prune_staging(settings.staging_uri, cutoff)),
        "stage_results": len(prune_results(settings.results_uri, cutoff)),
        "training_runs": len(prune_training_runs(settings.ray_storage_path, cutoff)),
    }


@stage("retention", cache_policy=NO_CACHE, retries=1)
def retention(settings: Settings) -> dict[str, Any]:
    """Prefect stage (runs every time): apply the workspace's retention after a run, or in `maintain`. Tidying that
    fails (a folder it may not write to) is a warning: the run's table, model and promotion stand."""
    try:
        return prune_workspace(settings)
    except OSError as exc:
        stage_logger().warning(f"retention: nothing more was removed: {exc}")
        return {"failed": str(exc)}
