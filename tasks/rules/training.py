"""Training rules: which settings change what training produces, which of them a run records, and the learning rate.

Pure: no engine. The train stage keys its cache and names its Ray run by TRAINING_SETTINGS, logs PARAM_SETTINGS as
MLflow params, and `imagelake retrain` maps those params back to settings.
"""

from __future__ import annotations

import math
from typing import Any

from imagelake.infra.settings import stage_settings


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


# MLflow training params -> the settings that reproduce them.
PARAM_SETTINGS = {
    "image_size": "image_size",
    "arch": "model_arch",
    "pretrained": "pretrained",
    "freeze_backbone": "freeze_backbone",
    "backbone_lr_factor": "backbone_lr_factor",
    "weight_decay": "weight_decay",
    "augment": "augment",
    "augment_flip": "augment_flip",
    "label_smoothing": "label_smoothing",
    "class_weights": "class_weights",
    "max_train_minutes": "max_train_minutes",
    "batch_size": "batch_size",
    "lr_scaling": "lr_scaling",
    "max_epochs": "max_epochs",
    "patience": "early_stopping_patience",
    "min_delta": "early_stopping_min_delta",
    "stopping_threshold": "early_stopping_threshold",
    "seed": "seed",
    "num_workers": "num_workers",
    "base_lr": "base_lr",
}


# Params a run logs that are worked out from settings and data rather than set (retrain does not map them back).
DERIVED_PARAMS = ("num_classes", "learning_rate")


def logged_params(config: dict[str, Any], settings: Any) -> dict[str, str]:
    """A training run's MLflow params: each PARAM_SETTINGS param with the value the workers were given (the setting's
    own where the workers' config does not hold it), and the derived ones."""
    values = {
        param: config[param] if param in config else getattr(settings, setting)
        for param, setting in PARAM_SETTINGS.items()
    }
    values.update({name: config[name] for name in DERIVED_PARAMS})
    return {name: str(value) for name, value in values.items()}
