"""The warm-start rule: whether a training run may start from the champion's weights. Pure: stdlib only."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class WeightsShape:
    """What a model's weights were trained for: change any of it and they no longer fit, or no longer mean the same."""

    labels: tuple[str, ...]  # in order: output i of the head is labels[i]
    image_size: int
    model_arch: str
    resize_mode: str


@dataclass(frozen=True)
class Champion:
    """The registered version the champion alias points at; `shape` is None where its tags do not record one."""

    version: str
    shape: WeightsShape | None


@dataclass(frozen=True)
class WarmStart:
    """Where a run's weights start: a champion version, or None for from scratch, and why."""

    version: str | None
    reason: str

    @property
    def source(self) -> str:
        """What the run records as `warm_started_from`: the version, or "none"."""
        return self.version or "none"


def labels_tag(labels: list[str]) -> str:
    """The labels tag of a registered version: a JSON list, so that names with commas, quotes or any Unicode survive."""
    return json.dumps(list(labels), ensure_ascii=False)


def labels_of_tag(text: str) -> list[str]:
    """The label names of a labels tag: a JSON list, or the comma-joined names of a version registered before it was
    one."""
    if text.startswith("["):
        try:
            found = json.loads(text)
        except ValueError:
            found = None
        if isinstance(found, list) and all(isinstance(name, str) for name in found):
            return found
    return text.split(",") if text else []


def shape_from_tags(tags: Mapping[str, str]) -> WeightsShape | None:
    """A registered version's shape from the tags the promote stage sets, or None if they are missing or malformed."""
    try:
        params = json.loads(tags["training_params"])
        arch = params["model_arch"] if "model_arch" in params else params["arch"]  # arch: an earlier imagelake's name
        return WeightsShape(
            tuple(labels_of_tag(tags["labels"])), int(tags["image_size"]), str(arch), tags["resize_mode"]
        )
    except (KeyError, ValueError, TypeError):
        return None


def labels_change(old: tuple[str, ...], new: tuple[str, ...]) -> str:
    """How a label list changed, in a few words: 'labels 10 -> 9 (removed: 9)' or 'labels in another order'."""
    if set(old) == set(new):
        return "labels in another order"
    added, removed = [label for label in new if label not in old], [label for label in old if label not in new]
    listed = "; ".join(
        f"{what}: {', '.join(items[:5])}{', ...' if len(items) > 5 else ''}"
        for what, items in (("added", added), ("removed", removed))
        if items
    )
    return f"labels {len(old)} -> {len(new)} ({listed})"


def decide_warm_start(wanted: WeightsShape, champion: Champion | None) -> WarmStart:
    """Start from the champion only if it was trained for exactly this shape: the same labels in the same order, image
    size, resize mode and model_arch. Otherwise from scratch, with the reason."""
    if champion is None:
        return WarmStart(None, "no champion to start from")
    if champion.shape is None:
        return WarmStart(
            None,
            f"champion v{champion.version} does not record the labels, image size and model it was trained "
            "for (not registered by the pipeline)",
        )
    changes = []
    for field in fields(WeightsShape):
        old, new = getattr(champion.shape, field.name), getattr(wanted, field.name)
        if old != new:
            changes.append(labels_change(old, new) if field.name == "labels" else f"{field.name} {old} -> {new}")
    if changes:
        return WarmStart(
            None, f"champion v{champion.version} was trained for other data or another model: {'; '.join(changes)}"
        )
    return WarmStart(
        champion.version, f"champion v{champion.version} has the same labels, image size, resize mode and model_arch"
    )
