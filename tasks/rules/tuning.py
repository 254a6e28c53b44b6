"""A hyperparameter search's rules: the search space (the default one, a space file's, checked against the run policy),
how many trials run at once, and the search's table. Pure: no engine (the tune stage turns a space into Ray Tune's).

A space maps training settings to one dimension each:

    base_lr: {loguniform: [0.0001, 0.003]}
    augment: {choice: [none, light, standard]}
    label_smoothing: {uniform: [0.0, 0.2]}
    batch_size: {randint: [16, 64]}   # low included, high excluded, as Ray Tune's randint
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from imagelake.infra.run_policy import refuse_unsafe
from imagelake.infra.settings import Settings, SettingsError, load_settings, stage_settings

KINDS = ("choice", "uniform", "loguniform", "randint")

# For fine-tuning a pretrained backbone: the rates (the head's, the backbone's share of it), regularisation (weight
# decay, label smoothing) and augmentation. image_size is not in it: every trial reads one cache, of one size.
DEFAULT_SPACE: dict[str, dict[str, list[Any]]] = {
    "base_lr": {"loguniform": [1e-4, 3e-3]},
    "backbone_lr_factor": {"choice": [0.03, 0.1, 0.3, 1.0]},
    "weight_decay": {"loguniform": [1e-4, 0.1]},
    "augment": {"choice": ["none", "light", "standard"]},
    "label_smoothing": {"choice": [0.0, 0.05, 0.1, 0.2]},
}

# The Tune trial's own process (which starts its Ray Train run and waits for it) and the run's controller: one CPU.
TRIAL_DRIVER_CPUS = 1


class SpaceError(SettingsError):
    """A search space that names no training setting, has a malformed dimension or a value a run may not set."""


def read_space(path: str | Path) -> dict[str, Any]:
    """The space in a YAML (or JSON) file."""
    file = Path(path)
    if not file.is_file():
        raise SpaceError(f"the search space file {file} does not exist: give a YAML file as docs/training.md shows")
    return space_from_text(file.read_text(), f"the search space file {file}")


def space_from_text(text: str, where: str) -> dict[str, Any]:
    """The space written as YAML (or JSON, which is YAML too) in TEXT, which came from WHERE."""
    import yaml

    try:
        space = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpaceError(f"{where} is not YAML: {exc}") from None
    if not isinstance(space, dict) or not space:
        raise SpaceError(
            f"{where} holds no mapping of settings to dimensions: write it as "
            "{base_lr: {loguniform: [0.0001, 0.01]}, augment: {choice: [none, light]}} (docs/training.md)"
        )
    return space


def searchable() -> tuple[str, ...]:
    """The settings a search may vary: the train stage's (each trial reads the same cached splits), and image_size."""
    return tuple(name for name in stage_settings("train") if name != "image_size")


def check_space(space: Mapping[str, Any], image_size: int, where: str) -> dict[str, dict[str, list[Any]]]:
    """SPACE as {setting: {kind: values}}, each dimension checked: a training setting, a known kind with values of the
    setting's type, and every value one a run may set (infra/run_policy.py:refuse_unsafe). image_size may only take
    IMAGE_SIZE, the size the cache holds. Raises SpaceError naming the setting and WHERE."""
    checked: dict[str, dict[str, list[Any]]] = {}
    for name, dimension in space.items():
        values = dimension_values(name, dimension, where)
        kind = next(iter(dimension))
        if name == "image_size":
            if any(value != image_size for value in values):
                raise SpaceError(
                    f"image_size {values} in {where}: the cache holds images of {image_size} px only, which every "
                    f"trial reads; search other sizes with a run of the data stages at that size (--set "
                    "image_size=...)"
                )
        elif name not in searchable():
            known = name in Settings.model_fields
            raise SpaceError(
                f"{name} in {where} is {'not a training setting' if known else 'no setting of imagelake'}: a search "
                f"varies how each trial trains, over the same cached data. It may vary: {', '.join(searchable())}"
            )
        for value in values:
            refuse_unsafe({name: value}, where)
            try:
                load_settings(overrides={name: value})
            except SettingsError as exc:
                raise SpaceError(f"{name}={value!r} in {where} is not a value of the setting: {exc}") from None
        checked[name] = {kind: values}
    return checked


def dimension_values(name: str, dimension: Any, where: str) -> list[Any]:
    """The values (choice) or bounds (the others) of one dimension, its form checked."""
    form = f"{name} in {where} must be one of {', '.join(f'{{{kind}: [...]}}' for kind in KINDS)}"
    if not isinstance(dimension, Mapping) or len(dimension) != 1 or next(iter(dimension)) not in KINDS:
        raise SpaceError(f"{form}: got {dimension!r}")
    kind, values = next(iter(dimension.items()))
    if not isinstance(values, list) or not values:
        raise SpaceError(f"{form}, with a list of values: got {values!r}")
    if kind == "choice":
        return values
    if len(values) != 2 or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise SpaceError(f"{name} in {where}: {kind} takes [low, high], two numbers: got {values!r}")
    low, high = values
    if not low < high or (kind == "loguniform" and low <= 0) or not all(math.isfinite(v) for v in values):
        raise SpaceError(f"{name} in {where}: {kind} needs low < high{' and low > 0' * (kind == 'loguniform')}")
    if kind == "randint" and not all(isinstance(v, int) for v in values):
        raise SpaceError(f"{name} in {where}: randint takes two integers: got {values!r}")
    return values


def concurrent_trials(
    cluster: Mapping[str, float],
    num_workers: int,
    cpus_per_worker: float,
    use_gpu: bool = False,
    gpus_per_worker: float = 1.0,
) -> int:
    """How many trials run at once: as many as the cluster's CPUs (and GPUs, training on them) hold, at least one."""
    fits = math.floor(cluster.get("CPU", 0) / (num_workers * cpus_per_worker + TRIAL_DRIVER_CPUS))
    if use_gpu:
        fits = min(fits, math.floor(cluster.get("GPU", 0) / (num_workers * gpus_per_worker)))
    return max(1, fits)


def search_table(rows: list[dict[str, Any]]) -> str:
    """The search's trials as a Markdown table, best first: trial, settings, best validation accuracy, epochs, seconds,
    how it ended."""
    lines = [
        "| trial | settings | best val accuracy | epochs | seconds | ended |",
        "|---|---|---|---|---|---|",
    ]
    for row in ranked(rows):
        accuracy = row.get("val_acc")
        settings = ", ".join(f"{name}={shown(value)}" for name, value in sorted(row["settings"].items()))
        lines.append(
            f"| {row['trial']} | {settings} | {'-' if accuracy is None else f'{accuracy:.3f}'} | "
            f"{row.get('epochs', 0)} | {row.get('seconds', 0.0):.0f} | {row.get('ended', '')} |"
        )
    return "\n".join(lines)


def ranked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trials by best validation accuracy, highest first; trials that reported none last, in trial order."""
    return sorted(rows, key=lambda row: (row.get("val_acc") is None, -(row.get("val_acc") or 0.0), row["trial"]))


def best_trial(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The trial with the best validation accuracy, or None where no trial reported one."""
    first = ranked(rows)[:1]
    return first[0] if first and first[0].get("val_acc") is not None else None


def shown(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
