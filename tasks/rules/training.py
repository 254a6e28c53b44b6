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


# How a GPU steps each model fastest: the training steps' images/s with torch.compile's default mode and eager, at the
# latest limit rows of `bench/train.py --gpu` (the model alone on batches already on the GPU, all layers trained, fused
# AdamW, 256-image batches; bench/results/gpu_<arch>_all.jsonl, which tests/test_rules.py holds this table to).
# Compiling fuses kernels, and pays where the step is bound by the GPU's work (ResNet-50, ViT, EfficientNet); where it
# is bound by the host launching many small kernels (MobileNetV2, the small CNN), eager steps faster.
GPU_LIMITS: dict[str, dict[str, float]] = {
    "mobilenet_v2": {"eager": 12656, "compiled": 11494},
    "efficientnet_b0": {"eager": 5078, "compiled": 6939},
    "resnet50": {"eager": 4705, "compiled": 6598},
    "vit_b_16": {"eager": 2286, "compiled": 3324},
    "small_cnn": {"eager": 98142, "compiled": 87370},
}
GPU_LIMITS_MEASURED_ON = "an H200 (bench/README.md's GPU table)"


def step_path(arch: str, compile: bool | str | None, mode: str, gpu: bool) -> tuple[str | None, str]:
    """How training steps ARCH: torch.compile's mode, or None for eager; and why, for the run's report.

    COMPILE is the `compile` setting (None: the default, chosen here), MODE the `compile_mode` setting, GPU whether
    the worker steps on a GPU.
    """
    if compile is False or compile == "off":
        return None, "eager: compile is off"
    if compile is True:
        return mode, f"compiled ({mode}): compile is on"
    if isinstance(compile, str):
        return compile, f"compiled ({compile}): compile names that mode"
    if not gpu:
        return None, "eager: no GPU (compiling costs its start-up and does not pay on a CPU)"
    measured = GPU_LIMITS.get(arch)
    if measured is None:
        return mode, f"compiled ({mode}): no measurement of {arch}; compiling was faster for most models measured"
    eager, compiled = measured["eager"], measured["compiled"]
    figures = f"{eager:,.0f} images/s eager, {compiled:,.0f} compiled on {GPU_LIMITS_MEASURED_ON}"
    if eager >= compiled:
        return None, f"eager: faster for {arch} ({figures})"
    return mode, f"compiled ({mode}): faster for {arch} ({figures})"
