"""Table upkeep: compact small files, vacuum old ones, never the files of a version a registered model was trained
on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefect.cache_policies import NO_CACHE

from imagelake.infra.delta import Table
from imagelake.infra.settings import Settings
from imagelake.infra.tracking import mlflow_client
from imagelake.tasks.data.cache_files import clean_cache
from imagelake.tasks.stage import stage

if TYPE_CHECKING:  # MLflow loads when the registry is asked (start-up)
    from mlflow import MlflowClient


class RegistryUnavailable(RuntimeError):
    """The model registry did not answer: nothing is known to be safe to remove, so `maintain` removes nothing."""


def protected_versions(client: MlflowClient, model_name: str, table_uri: str) -> list[int]:
    """Delta versions of this table that registered model versions were trained on (their `delta_version` tags).

    Every page of the registry's model versions is read and matched on the name here, so any name works (a filter
    string would need the name quoted). No answer raises `RegistryUnavailable`: `maintain` fails closed."""
    from mlflow.exceptions import MlflowException

    versions, token = [], None
    try:
        while True:
            page = client.search_model_versions(max_results=1000, page_token=token)
            versions += [v for v in page if v.name == model_name]
            token = page.token
            if not token:
                break
    except MlflowException as exc:
        raise RegistryUnavailable(
            f"the model registry at {client.tracking_uri} did not say which versions of {table_uri} "
            "registered models of "
            f"{model_name!r} were trained on, so nothing was compacted, vacuumed or removed: {exc}"
        ) from exc
    return sorted(
        {
            int(v.tags["delta_version"])
            for v in versions
            if v.tags.get("delta_table") == table_uri and v.tags.get("delta_version", "").isdigit()
        }
    )


def maintain_table(table: Table, retention_hours: float, keep_versions: list[int]) -> dict:
    """Compact, then vacuum, with the table's engine; report what changed."""
    table_uri = table.uri
    if not table.exists():
        return {"table": table_uri, "skipped": "no table yet"}
    compacted = table.compact()
    removed = table.vacuum(retention_hours, keep_versions)
    return {
        "table": table_uri,
        "engine": table.engine,
        **compacted,
        "files_vacuumed": len(removed),
        "kept_versions": keep_versions,
        "version": table.version(),
    }


@stage("maintain-images", cache_policy=NO_CACHE)
def maintain_images(settings: Settings) -> dict:
    """Prefect stage: compact and vacuum the images table, keeping every registered model's version."""
    keep = protected_versions(mlflow_client(settings), settings.model_name, settings.table_uri)
    return maintain_table(Table.open(settings.table_uri, settings), settings.vacuum_retention_hours, keep)


@stage("maintain-cache", cache_policy=NO_CACHE)
def maintain_cache(settings: Settings) -> dict:
    """Prefect stage: remove cache manifests and files that neither the newest version, a registered model's version
    nor the retention window needs."""
    keep = protected_versions(mlflow_client(settings), settings.model_name, settings.table_uri)
    return clean_cache(settings.cache_uri, {settings.table_uri: keep}, settings.vacuum_retention_hours)


@stage("maintain-quarantine", cache_policy=NO_CACHE)
def maintain_quarantine(settings: Settings) -> dict:
    """Prefect stage: compact and vacuum the quarantine table."""
    return maintain_table(Table.open(settings.quarantine_uri, settings), settings.vacuum_retention_hours, [])
