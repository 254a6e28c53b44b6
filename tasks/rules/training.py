"""Training rules: which settings change what training produces, which of them a run records, and the learning rate.

Pure: no engine. The train stage keys its cache and names its Ray run by TRAINING_SETTINGS, logs MODEL_SETTINGS as
MLflow params under their own names, and `imagelake retrain` sets them again from those params.
"""

from __future__ import annotations

import math
from typing import Any

from imagelake.infra.declare import reproducing
from imagelake.infra.settings import Settings, stage_settings


def scaled_learning_rate(base_lr: float, num_workers: int, rule: str = "linear") -> float:
    """The global batch grows with the workers, so does the step size: linearly, with the square root, or not at all."""
    if rule == "linear":
        return base_lr * num_workers
    if rule == "sqrt":
        return base_lr * math.sqrt(num_workers)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown lr_scaling {rule!r}: choose linear, sqrt or none")


# The settings that change what training produces: they name the Ray run and key the train stage's cache. They are
# the train stage's settings as their declarations in infra/settings.py give them (stages=("train", ...) on a field,
# @in_keys_of("train", ...) on a derived location). With warm_start on, the champion's version it starts from changes
# what training produces too (tasks/stages/train.py:warm_start_key).
TRAINING_SETTINGS = stage_settings("train")


def started_from(warm_started_from: str, pretrained_weights: str = "none", pretrained_sha256: str = "") -> str:
    """Where a model's weights started, in words: a warm start from a champion version, pretrained weights by name
    and digest, or from scratch."""
    if warm_started_from not in ("", "none"):
        return f"warm start from v{warm_started_from}"
    if pretrained_weights in ("", "none"):
        return "from scratch"
    return f"from {pretrained_weights}" + (f" (sha256 {pretrained_sha256[:16]})" if pretrained_sha256 else "")


# The settings a trained model is made of: every setting in the key of a stage from the table version to the model
# (split, cache and train), as their declarations give them, less those that only say where things live
# (mlflow_experiment, declared where=True; the derived locations). A training run logs each as an MLflow param of the
# setting's own name, and retrain sets each again.
MODEL_SETTINGS = reproducing(Settings, ("split", "cache", "train"))

# The params that versions trained by an earlier imagelake logged under names of their own (read, never written).
OLD_PARAMS = {
    "arch": "model_arch",
    "patience": "early_stopping_patience",
    "min_delta": "early_stopping_min_delta",
    "stopping_threshold": "early_stopping_threshold",
}


# Params a run logs that are worked out from settings and data rather than set (retrain does not map them back).
DERIVED_PARAMS = ("num_classes", "learning_rate")


def logged_params(config: dict[str, Any], settings: Any) -> dict[str, str]:
    """A training run's MLflow params: each of MODEL_SETTINGS with SETTINGS' value, and the derived ones from the
    workers' CONFIG."""
    values = {name: getattr(settings, name) for name in MODEL_SETTINGS}
    values.update({name: config[name] for name in DERIVED_PARAMS})
    return {name: str(value) for name, value in values.items()}


def recorded_settings(params: dict[str, str]) -> dict[str, str]:
    """The settings of MODEL_SETTINGS that a run's logged PARAMS give (as logged, text), under an earlier imagelake's
    param names too."""
    named = {OLD_PARAMS.get(param, param): value for param, value in params.items()}
    return {name: named[name] for name in MODEL_SETTINGS if name in named}
