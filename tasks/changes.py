"""What is new or changed: a listing diffed against the images table (at one image size) and the quarantine.

The resize stage runs this diff, since what is new depends on the image size; only the files it keeps are read.
"""

from __future__ import annotations

import hashlib

import fsspec
import pyarrow.parquet as pq

from tasks.ingest import save_listing, write_manifest
from tasks.results import ListingDiff, Listed
from tasks.rules.listing import Scope, diff_listing
from tasks.table import ImageTable


def diff_against_table(table: ImageTable, listed: Listed, scope: Scope, retire_deleted: bool, staging_dir: str) -> ListingDiff:
    """Keep what is new or changed in a listing since the table's current version (at its image size), and stage that list."""
    with fsspec.open(listed.manifest_uri, "rb") as handle:
        entries = pq.read_table(handle).to_pylist()
    version, known, table_paths = table.known_files()
    dated = scope.start is not None or scope.end is not None
    # A date-limited run replaces exactly its dates: files gone from those dates are retired.
    scoped = table.paths_in_dates(scope) if dated and version is not None else table_paths
    todo, unchanged = diff_listing(entries, known, retire_deleted or dated, scoped)
    fingerprint = hashlib.sha256(f"{listed.listing_fingerprint}|{table.uri}|{version}|{table.image_size}".encode()).hexdigest()
    return ListingDiff(
        manifest_uri=write_manifest(todo, f"{staging_dir.rstrip('/')}/ingest-{fingerprint[:20]}.parquet"),
        source_uri=listed.source_uri,
        listed=listed.listed,
        unchanged=unchanged,
        candidates=sum(1 for e in todo if e["action"] == "upsert"),
        retired=sum(1 for e in todo if e["action"] == "delete"),
        table_version_seen=version,
        content_fingerprint=fingerprint,
    )


def ingest_listing(table: ImageTable, uri: str, scope: Scope, retire_deleted: bool, staging_dir: str) -> ListingDiff:
    """List the source and keep what is new or changed since the table's current version (both steps at once)."""
    return diff_against_table(table, save_listing(uri, scope, staging_dir), scope, retire_deleted, staging_dir)
