"""Ingest: list the source (a folder tree or a manifest CSV) and keep the listing in staging, named by its fingerprint.

The ingest stage only lists: what is new or changed depends on the image size, so the resize stage diffs the listing
against the table (tasks/changes.py). The listing rules are in tasks/rules/listing.py.
"""

from __future__ import annotations

from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from infra.settings import Settings
from tasks.results import Listed
from tasks.rules.listing import Scope, SourceError, list_source, listing_fingerprint, scope_of, source_uri
from tasks.rules.schemas import LISTING_SCHEMA
from tasks.stage import stage


def save_listing(uri: str, scope: Scope, staging_dir: str) -> Listed:
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


def source_listing(inputs: dict[str, Any]) -> dict[str, str]:
    """Cache key part for ingest: the listing itself, so new or changed files are a miss without reading them."""
    return {"source listing": listing_fingerprint(list_source(source_uri(inputs["source"]), scope_of(inputs["settings"])))}


@stage("ingest", settings=("image_extensions", "start_date", "end_date", "max_file_bytes", "staging_uri"), facts=source_listing, code=("tasks.rules.listing", "tasks.rules.schemas"))
def ingest(source: str, settings: Settings) -> Listed:
    """Prefect stage: list the source (what changed since the table is resize's to find, at its image size)."""
    return save_listing(source_uri(source), scope_of(settings), settings.staging_uri)
