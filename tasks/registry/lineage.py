"""What a registered version was trained on and with (its lineage tags), the settings that retrain it, and a
reference (NAME@ALIAS or NAME/VERSION) resolved to a version: MLflow's client alone, no torch."""

from __future__ import annotations

import json

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from imagelake.infra.run_policy import UNSAFE_FROM_RUNS
from imagelake.tasks.registry.aliases import RegistryError, alias_version
from imagelake.tasks.rules.training import recorded_settings

LINEAGE_KEYS = (
    "delta_table",
    "delta_version",
    "cache_key",
    "split_counts",
    "split_settings",
    "training_params",
    "git_commit",
    "prefect_flow_run_id",
    "mlflow_run_id",
    "pretrained_weights",
    "pretrained_sha256",
    "labels",
    "image_size",
    "resize_mode",
)


def lineage(client: MlflowClient, name: str, version: str) -> dict[str, str]:
    """What a version was trained on and with, from its tags."""
    try:
        found = client.get_model_version(name, str(version))
    except MlflowException as exc:
        raise RegistryError(f"model {name!r} has no version {version!r}") from exc
    tags = dict(found.tags)
    out = {key: tags.get(key, "") for key in LINEAGE_KEYS}
    out["aliases"] = ",".join(found.aliases or [])
    return out


def _value(text: str):
    if text in ("None", ""):
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def retrain_overrides(found: dict[str, str]) -> dict:
    """Settings that retrain a version on the same split of the same data with the same training settings."""
    if not found.get("delta_version"):
        raise RegistryError("this version has no delta_version tag: it was not registered by imagelake's pipeline")
    params = json.loads(found.get("training_params") or "{}")
    # split_settings: where a version registered by an earlier imagelake logged no split settings as params
    overrides = {**json.loads(found.get("split_settings") or "{}")}
    overrides.update({name: _value(text) for name, text in recorded_settings(params).items()})
    # What a model version recorded never turns on a setting that can run code or load pickles.
    return {name: value for name, value in overrides.items() if name not in UNSAFE_FROM_RUNS}


def resolve(client: MlflowClient, reference: str) -> tuple[str, str]:
    """NAME@ALIAS or NAME/VERSION to (name, version)."""
    if "@" in reference:
        name, alias = reference.rsplit("@", 1)
        version = alias_version(client, name, alias)
        if version is None:
            raise RegistryError(
                f"model {name!r} has no alias {alias!r} (aliases: champion, challenger, previous-champion)"
            )
        return name, version
    if "/" in reference:
        name, version = reference.rsplit("/", 1)
        return name, version
    raise RegistryError(f"--model {reference!r}: write NAME@ALIAS (e.g. {reference}@champion) or NAME/VERSION")
