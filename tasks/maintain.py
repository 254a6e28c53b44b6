"""Table upkeep: compact small files, vacuum old ones, never the files of a version a registered model was trained on."""

from __future__ import annotations

import math

from deltalake import DeltaTable
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect.cache_policies import NO_CACHE

from infra.delta import table_exists
from infra.settings import Settings
from infra.tracking import mlflow_client
from tasks.stage import stage


def protected_versions(client: MlflowClient, model_name: str, table_uri: str) -> list[int]:
    """Delta versions of this table that registered model versions were trained on (their `delta_version` tags)."""
    try:
        versions = client.search_model_versions(f"name='{model_name}'")
    except MlflowException:
        return []
    return sorted(
        {int(v.tags["delta_version"]) for v in versions if v.tags.get("delta_table") == table_uri and v.tags.get("delta_version", "").isdigit()}
    )


def compact_table(table_uri: str) -> dict:
    """Rewrite small files into fewer large ones (a new table version with the same rows)."""
    metrics = DeltaTable(table_uri).optimize.compact()
    return {"files_added": metrics.get("numFilesAdded", 0), "files_removed": metrics.get("numFilesRemoved", 0)}


def vacuum_table(table_uri: str, retention_hours: float, keep_versions: list[int]) -> list[str]:
    """Delete files no longer referenced by the table's recent versions or by any version in `keep_versions`.

    Full mode also deletes files that no commit ever added and that are older than the retention:
    data files left by a run killed between its resize and its write.
    """
    return DeltaTable(table_uri).vacuum(
        retention_hours=math.ceil(retention_hours),
        dry_run=False,
        enforce_retention_duration=False,
        keep_versions=keep_versions,
        full=True,
    )


def maintain_table(table_uri: str, retention_hours: float, keep_versions: list[int]) -> dict:
    """Compact, then vacuum; report what changed."""
    if not table_exists(table_uri):
        return {"table": table_uri, "skipped": "no table yet"}
    compacted = compact_table(table_uri)
    removed = vacuum_table(table_uri, retention_hours, keep_versions)
    return {"table": table_uri, **compacted, "files_vacuumed": len(removed), "kept_versions": keep_versions, "version": DeltaTable(table_uri).version()}


@stage("maintain-images", cache_policy=NO_CACHE)
def maintain_images(settings: Settings) -> dict:
    """Prefect stage: compact and vacuum the images table, keeping every registered model's version."""
    keep = protected_versions(mlflow_client(settings), settings.model_name, settings.table_uri)
    return maintain_table(settings.table_uri, settings.vacuum_retention_hours, keep)


@stage("maintain-quarantine", cache_policy=NO_CACHE)
def maintain_quarantine(settings: Settings) -> dict:
    """Prefect stage: compact and vacuum the quarantine table."""
    return maintain_table(settings.quarantine_uri, settings.vacuum_retention_hours, [])
