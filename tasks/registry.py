"""The model registry: the quality gate, alias moves under a lock with their history, lineage, safe loading."""

from __future__ import annotations

import getpass
import json
import math
import os
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import mlflow
import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
import yaml
from filelock import FileLock
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from infra.delta import append_arrow, read_current, table_exists
from infra.settings import Settings

CHAMPION, CHALLENGER, PREVIOUS = "champion", "challenger", "previous-champion"

# Each gate metric, and whether a higher value is better.
METRICS: dict[str, bool] = {"accuracy": True, "macro_f1": True, "loss": False}

HISTORY_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("alias", pa.string()),
        ("from_version", pa.string()),
        ("to_version", pa.string()),
        ("action", pa.string()),
        ("reason", pa.string()),
        ("who", pa.string()),
        ("at", pa.timestamp("us", tz="UTC")),
        ("flow_run_id", pa.string()),
    ]
)


_EXPORT_LOAD = threading.Lock()


class RegistryError(ValueError):
    """An unknown model, version or alias, or an operation the registry's state does not allow."""


class UnsafeModel(RegistryError):
    """A model stored in a format that loads by unpickling, refused unless explicitly allowed."""


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    metric: str
    candidate: float
    champion: float | None
    margin: float


def decide_promotion(metric: str, candidate: float, champion: float | None, margin: float = 0.0, champion_error: str | None = None) -> Decision:
    """Promote when there is no usable champion, or when the candidate beats it by more than `margin` on `metric`.

    Ties never promote. A champion that could not be loaded or evaluated (`champion_error`) is
    replaced, and the reason says why.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown promotion metric {metric!r}: choose one of {', '.join(METRICS)}")
    for name, value in (("candidate", candidate), ("champion", champion), ("margin", margin)):
        if value is not None and (math.isnan(value) or value < 0 or (metric != "loss" and value > 1)):
            raise ValueError(f"{name} {metric} must be a number in [0, 1] (loss: >= 0), got {value!r}")
    if champion_error:
        return Decision(True, f"the champion could not be evaluated ({champion_error}); candidate {metric} {candidate:.4f}", metric, candidate, None, margin)
    if champion is None:
        return Decision(True, f"no champion yet; candidate {metric} {candidate:.4f}", metric, candidate, None, margin)
    higher = METRICS[metric]
    better = candidate > champion + margin if higher else candidate < champion - margin
    verb = "beats" if better else "does not beat"
    direction = "higher" if higher else "lower"
    return Decision(
        better, f"candidate {metric} {candidate:.4f} {verb} champion {champion:.4f} by more than {margin:.4f} ({direction} is better)", metric, candidate, champion, margin
    )


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, classes: int, batch_size: int = 256) -> dict[str, float]:
    """Accuracy, macro-F1 and mean cross-entropy of a model on one split."""
    logits = torch.cat([model(torch.from_numpy(images[i : i + batch_size].copy())).float() for i in range(0, len(images), batch_size)])
    target = torch.from_numpy(labels.astype(np.int64))
    predicted = logits.argmax(dim=1).numpy()
    f1 = []
    for c in range(classes):
        tp = int(((predicted == c) & (labels == c)).sum())
        fp, fn = int(((predicted == c) & (labels != c)).sum()), int(((predicted != c) & (labels == c)).sum())
        if tp + fp + fn:
            f1.append(2 * tp / (2 * tp + fp + fn))
    return {
        "accuracy": float((predicted == labels).mean()),
        "macro_f1": float(np.mean(f1)) if f1 else 0.0,
        "loss": float(F.cross_entropy(logits, target)),
    }


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
        append_arrow(settings.history_uri, pa.Table.from_pylist(full, schema=HISTORY_SCHEMA))


def who() -> str:
    try:
        return os.environ.get("IMAGELAKE_USER") or getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def history(spark, settings: Settings, name: str) -> list[dict]:
    """Every recorded alias move of a model, oldest first."""
    if not table_exists(settings.history_uri):
        return []
    from pyspark.sql import functions as Fn

    rows = read_current(spark, settings.history_uri, "delta-rs", HISTORY_SCHEMA.names, Fn.col("model") == name).to_pylist()
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


def git_commit() -> str:
    """The commit of the code that runs, or 'unknown' outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
    return (out.stdout.strip() + ("-dirty" if dirty else "")) if out.returncode == 0 else "unknown"


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


def decision_markdown(name: str, version: str, decision: Decision, champion_version: str | None, run_link: str) -> str:
    champion = "none" if decision.champion is None else f"{decision.champion:.4f}"
    return (
        f"## Promotion of {name} v{version}\n\n"
        f"| item | value |\n|---|---|\n"
        f"| outcome | {'champion' if decision.promote else 'challenger'} |\n"
        f"| metric | {decision.metric} |\n| candidate | {decision.candidate:.4f} |\n"
        f"| champion (v{champion_version or '-'}) | {champion} |\n| margin | {decision.margin} |\n"
        f"| reason | {decision.reason} |\n\n[MLflow run]({run_link})\n"
    )


# MLflow training params -> the settings that reproduce them.
PARAM_SETTINGS = {
    "image_size": "image_size", "arch": "model_arch", "pretrained_weights": "pretrained_weights", "freeze_backbone": "freeze_backbone",
    "batch_size": "batch_size", "lr_scaling": "lr_scaling", "max_epochs": "max_epochs", "patience": "early_stopping_patience",
    "min_delta": "early_stopping_min_delta", "stopping_threshold": "early_stopping_threshold", "seed": "seed",
    "num_workers": "num_workers", "base_lr": "base_lr",
}


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
    return overrides


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


def predict_files(client: MlflowClient, settings: Settings, reference: str, source: Path) -> list[dict]:
    """Label and probability for every image under `source`, decoded and resized as the model's training data was."""
    from tasks.resize import ImageDecodeError, resize_image

    name, version = resolve(client, reference)
    model = load_registered_model(client, name, version, settings.allow_pickle_models)
    tags = client.get_model_version(name, version).tags
    labels = tags.get("labels", "").split(",")
    size, mode = int(tags.get("image_size") or settings.image_size), tags.get("resize_mode") or settings.resize_mode
    if not source.exists():
        raise FileNotFoundError(f"--source {source} does not exist: give an image file or a folder of images")
    extensions = tuple(e.lower() for e in settings.image_extensions)
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in extensions)
    results: list[dict] = []
    batch: list[tuple[Path, np.ndarray]] = []

    def flush() -> None:
        if batch:
            with torch.no_grad():
                probabilities = torch.softmax(model(torch.from_numpy(np.stack([pixels for _, pixels in batch]))).float(), dim=1)
            for (path, _), row in zip(batch, probabilities):
                best = int(row.argmax())
                results.append({"path": str(path), "label": labels[best] if best < len(labels) else str(best), "probability": float(row[best])})
            batch.clear()

    for path in files:
        try:
            pixels, _, _ = resize_image(path.read_bytes(), size, mode, settings.max_image_pixels)
        except (ImageDecodeError, OSError) as exc:
            results.append({"path": str(path), "label": None, "probability": 0.0, "error": str(exc)})
            continue
        batch.append((path, pixels))
        if len(batch) == 64:
            flush()
    flush()
    return results
