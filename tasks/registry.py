"""The model registry (MLflow adapter): safe loading, the quality gate, alias moves under a lock with their history, lineage."""

from __future__ import annotations

import getpass
import json
import os
import threading
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import mlflow
import numpy as np
import pyarrow as pa
import torch
import yaml
from filelock import FileLock
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from infra.delta import Table
from infra.settings import UNSAFE_FROM_RUNS, Settings
from tasks.rules.schemas import HISTORY_SCHEMA
from tasks.rules.training import PARAM_SETTINGS
from tasks.predict import evaluate
from tasks.rules.promotion import CHALLENGER, CHAMPION, PREVIOUS, Decision, decide_promotion
from tasks.rules.warm_start import Champion, shape_from_tags


_EXPORT_LOAD = threading.Lock()


class RegistryError(ValueError):
    """An unknown model, version or alias, or an operation the registry's state does not allow."""


class UnsafeModel(RegistryError):
    """A model stored in a format that loads by unpickling, refused unless explicitly allowed."""


def model_files(client: MlflowClient, name: str, version: str) -> Path:
    """A registered version's model folder, downloaded (or found) locally."""
    try:
        source = client.get_model_version_download_uri(name, str(version))
    except MlflowException as exc:
        raise RegistryError(f"model {name!r} has no version {version!r}: see `imagelake lineage` or the MLflow UI for its versions") from exc
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=source))


def load_registered_model(client: MlflowClient, name: str, version: str, allow_pickle: bool = False) -> torch.nn.Module:
    """Load a registered version without unpickling: only torch.export (pt2) programs load unless `allow_pickle`.

    The MLmodel file is read as YAML, nothing of the model is imported or unpickled before the
    format is known to be safe.
    """
    folder = model_files(client, name, version)
    meta = yaml.safe_load((folder / "MLmodel").read_text())
    flavor = (meta.get("flavors") or {}).get("pytorch")
    data = folder / (flavor or {}).get("model_data", "data")
    exported = data / "model.pt2"
    if flavor and exported.is_file():
        with _EXPORT_LOAD:  # torch.export.load keeps global state while it reads: one at a time per process
            return torch.export.load(str(exported)).module()
    if not allow_pickle:
        raise UnsafeModel(
            f"{name} v{version} is not a torch.export (pt2) model (flavors: {', '.join(meta.get('flavors') or {}) or 'none'}): "
            "loading it would unpickle code. Re-register it in pt2 format, or set allow_pickle_models=true if you trust its source."
        )
    return mlflow.pytorch.load_model(f"models:/{name}/{version}") if flavor else mlflow.pyfunc.load_model(f"models:/{name}/{version}")


def alias_version(client: MlflowClient, name: str, alias: str) -> str | None:
    """The version an alias points at, or None; unknown models are an error."""
    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException as exc:
        try:
            client.get_registered_model(name)
        except MlflowException:
            raise RegistryError(f"no registered model named {name!r}") from exc
        return None


def champion_of(client: MlflowClient, name: str) -> Champion | None:
    """The champion of model NAME with the shape it was trained for, or None if there is none (or no such model yet)."""
    try:
        version = alias_version(client, name, CHAMPION)
    except RegistryError:  # nothing registered under this name yet: no champion either
        return None
    if version is None:
        return None
    return Champion(version, shape_from_tags(client.get_model_version(name, version).tags))


def champion_state_dict(client: MlflowClient, name: str, version: str, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """A registered version's weights, named as ImageModel names them (torch.export keeps the module's names)."""
    model = load_registered_model(client, name, version, allow_pickle)
    return {key: tensor.detach().clone() for key, tensor in model.state_dict().items()}


@contextmanager
def registry_lock(settings: Settings, name: str) -> Iterator[None]:
    """Serialise alias moves of one model: a compare-and-set needs the champion not to move under it."""
    folder = settings.workspace_dir / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / f"registry-{name}.lock"), timeout=600):
        yield


def record(settings: Settings, rows: list[dict]) -> None:
    """Append alias moves to the history table (a Delta table beside the images table)."""
    if rows:
        now = datetime.now(timezone.utc)
        full = [{"who": who(), "at": now, "flow_run_id": None, **row} for row in rows]
        Table(settings.history_uri).append(pa.Table.from_pylist(full, schema=HISTORY_SCHEMA))


def who() -> str:
    try:
        return os.environ.get("IMAGELAKE_USER") or getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def history(spark, settings: Settings, name: str) -> list[dict]:
    """Every recorded alias move of a model, oldest first."""
    table = Table(settings.history_uri, spark)
    if not table.exists():
        return []
    from pyspark.sql import functions as Fn

    rows = table.read(HISTORY_SCHEMA.names, Fn.col("model") == name).to_pylist()
    return sorted(rows, key=lambda row: row["at"])


def move_alias(client: MlflowClient, name: str, alias: str, version: str) -> str | None:
    """Point `alias` at `version`; return the version it pointed at before."""
    before = alias_version(client, name, alias)
    client.set_registered_model_alias(name, alias, str(version))
    return before


def crown(client: MlflowClient, settings: Settings, name: str, version: str, action: str, reason: str, flow_run_id: str | None = None) -> None:
    """Make `version` the champion; the one it replaces becomes previous-champion. Caller holds the registry lock."""
    old = move_alias(client, name, CHAMPION, version)
    rows = [{"model": name, "alias": CHAMPION, "from_version": old, "to_version": str(version), "action": action, "reason": reason, "flow_run_id": flow_run_id}]
    if old is not None and old != str(version):
        before = move_alias(client, name, PREVIOUS, old)
        rows.append({"model": name, "alias": PREVIOUS, "from_version": before, "to_version": old, "action": action, "reason": f"replaced by v{version}", "flow_run_id": flow_run_id})
    if alias_version(client, name, CHALLENGER) == str(version):
        client.delete_registered_model_alias(name, CHALLENGER)
    record(settings, rows)


def gate(
    client: MlflowClient, settings: Settings, name: str, version: str, images: np.ndarray, labels: np.ndarray, classes: int, flow_run_id: str | None = None
) -> tuple[Decision, dict[str, float], str | None]:
    """Evaluate candidate and champion on the same split, decide, tag the candidate and move aliases, all under the lock.

    The champion is read inside the lock, just before the aliases move (compare-and-set): two
    promotions finishing together are decided one after the other, each against the champion
    the other left, so the worse model can never end up champion.
    """
    candidate = evaluate(load_registered_model(client, name, version, settings.allow_pickle_models), images, labels, classes)
    metric = settings.promotion_metric
    with registry_lock(settings, name):
        champion_version = alias_version(client, name, CHAMPION)
        champion_value, champion_error = None, None
        if champion_version is not None and champion_version != str(version):
            try:
                champion_model = load_registered_model(client, name, champion_version, settings.allow_pickle_models)
                champion_value = evaluate(champion_model, images, labels, classes)[metric]
            except Exception as exc:  # any failure to load or run the champion is recorded and replaces it
                champion_error = f"v{champion_version}: {type(exc).__name__}: {exc}"[:300]
        decision = decide_promotion(metric, candidate[metric], champion_value, settings.promotion_margin, champion_error)
        tags = {
            "promotion_decision": "promoted" if decision.promote else "not promoted",
            "promotion_reason": decision.reason,
            "promotion_metric": metric,
            "promotion_margin": str(settings.promotion_margin),
            f"candidate_{metric}": f"{decision.candidate:.6f}",
            f"champion_{metric}": "" if champion_value is None else f"{champion_value:.6f}",
            "compared_with_version": champion_version or "",
            **{f"test_{key}": f"{value:.6f}" for key, value in candidate.items()},
        }
        for key, value in tags.items():
            client.set_model_version_tag(name, str(version), key, value)
        if decision.promote:
            crown(client, settings, name, version, "gate", decision.reason, flow_run_id)
        else:
            before = move_alias(client, name, CHALLENGER, version)
            record(settings, [{"model": name, "alias": CHALLENGER, "from_version": before, "to_version": str(version), "action": "gate", "reason": decision.reason, "flow_run_id": flow_run_id}])
    return decision, candidate, champion_version


def rollback(client: MlflowClient, settings: Settings, name: str, reason: str) -> tuple[str, str]:
    """Move `champion` back to `previous-champion`; return (from, to)."""
    with registry_lock(settings, name):
        current = alias_version(client, name, CHAMPION)
        previous = alias_version(client, name, PREVIOUS)
        if previous is None:
            raise RegistryError(f"model {name!r} has no {PREVIOUS!r} alias: there is nothing to roll back to")
        client.set_registered_model_alias(name, CHAMPION, previous)
        rows = [{"model": name, "alias": CHAMPION, "from_version": current, "to_version": previous, "action": "rollback", "reason": reason}]
        if current is not None:
            client.set_registered_model_alias(name, PREVIOUS, current)
            rows.append({"model": name, "alias": PREVIOUS, "from_version": previous, "to_version": current, "action": "rollback", "reason": reason})
        record(settings, rows)
    return current or "", previous


def force_promote(client: MlflowClient, settings: Settings, name: str, version: str, reason: str) -> None:
    """An operator's promotion of a chosen version, recorded with its reason."""
    if not reason.strip():
        raise RegistryError("a forced promotion needs a --reason")
    model_files(client, name, version)  # fails clearly for an unknown model or version
    with registry_lock(settings, name):
        crown(client, settings, name, str(version), "manual", reason)


LINEAGE_KEYS = (
    "delta_table", "delta_version", "cache_key", "split_counts", "split_settings", "training_params", "git_commit",
    "prefect_flow_run_id", "mlflow_run_id", "labels", "image_size", "resize_mode",
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
    overrides = {setting: _value(params[param]) for param, setting in PARAM_SETTINGS.items() if param in params}
    overrides.update(json.loads(found.get("split_settings") or "{}"))
    # What a model version recorded never turns on a setting that can run code or load pickles.
    return {name: value for name, value in overrides.items() if name not in UNSAFE_FROM_RUNS}


def resolve(client: MlflowClient, reference: str) -> tuple[str, str]:
    """NAME@ALIAS or NAME/VERSION to (name, version)."""
    if "@" in reference:
        name, alias = reference.rsplit("@", 1)
        version = alias_version(client, name, alias)
        if version is None:
            raise RegistryError(f"model {name!r} has no alias {alias!r} (aliases: champion, challenger, previous-champion)")
        return name, version
    if "/" in reference:
        name, version = reference.rsplit("/", 1)
        return name, version
    raise RegistryError(f"--model {reference!r}: write NAME@ALIAS (e.g. {reference}@champion) or NAME/VERSION")
