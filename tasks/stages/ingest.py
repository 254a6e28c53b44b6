"""Ingest: list the source (a folder tree or a manifest CSV) and keep the listing in staging, named by its fingerprint
(tasks/data/listing.py lists; tasks/rules/listed_files.py decides which files count, and with which label, date and
problem).

The ingest stage only lists: what is new or changed depends on the image size, so the resize stage diffs the listing
against the table (tasks/data/changes.py).
"""

from __future__ import annotations

from typing import Any

from imagelake.infra.settings import Settings, stage_settings
from imagelake.tasks.data.listing import save_listing, source_uri
from imagelake.tasks.results import Listed
from imagelake.tasks.rules.listed_files import Scope, SourceError, listing_fingerprint, scope_of
from imagelake.tasks.stage import stage

# The listing that computing the ingest stage's key just saved, for the stage itself: a run lists its source once.
_saved_for_key: dict[tuple[str, Scope, str], Listed] = {}


def source_listing(inputs: dict[str, Any]) -> dict[str, str]:
    """Key part for ingest: the listing itself, so the stage runs again for new or changed files, found unread."""
    settings: Settings = inputs["settings"]
    uri, scope = source_uri(inputs["source"]), scope_of(settings)
    try:
        listed = save_listing(uri, scope, settings.staging_uri)
    except SourceError:  # the stage itself raises it, where the run reports a stage's failure
        return {"source listing": listing_fingerprint([])}
    _saved_for_key.clear()
    _saved_for_key[(uri, scope, settings.staging_uri)] = listed
    return {"source listing": listed.listing_fingerprint}


@stage(
    "ingest",
    settings=stage_settings("ingest"),
    facts=source_listing,
    needs=lambda listed: [listed.manifest_uri],
)
def ingest(source: str, settings: Settings) -> Listed:
    """Prefect stage: list the source (what changed since the table is resize's to find, at its image size)."""
    uri, scope = source_uri(source), scope_of(settings)
    return _saved_for_key.pop((uri, scope, settings.staging_uri), None) or save_listing(
        uri, scope, settings.staging_uri
    )
