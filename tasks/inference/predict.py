"""Inference with a torch model: one batching loop (`logits_of`) behind evaluation, prediction and labelling image
files.

No registry here: callers load the model (see imagelake.tasks.inference.cli_serving for registered models).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from imagelake.tasks.rules.answers import answers
from imagelake.tasks.rules.images import ImageDecodeError, resize_image


@torch.no_grad()
def logits_of(model: torch.nn.Module, images: np.ndarray, batch_size: int = 256) -> torch.Tensor:
    """The model's float logits (N, classes) for (N, H, W, 3) uint8 images, run `batch_size` images at a time."""
    return torch.cat(
        [
            model(torch.from_numpy(images[start : start + batch_size].copy())).float()
            for start in range(0, len(images), batch_size)
        ]
    )


def evaluate(
    model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, classes: int, batch_size: int = 256
) -> dict[str, float]:
    """Accuracy, macro-F1 and mean cross-entropy of a model on one split."""
    logits = logits_of(model, images, batch_size)
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


def predict(model: torch.nn.Module, images: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """The class with the highest logit for every image."""
    if not len(images):
        return np.zeros(0, dtype=np.int64)
    return logits_of(model, images, batch_size).argmax(dim=1).numpy()


def label_files(
    model: torch.nn.Module,
    labels: list[str],
    source: Path,
    size: int,
    mode: str,
    extensions: Iterable[str],
    max_pixels: int,
    batch_size: int = 64,
) -> list[dict]:
    """Label and probability for every image under `source`, decoded and resized (`size`, `mode`) as the model's
    training data was."""

    if not source.exists():
        raise FileNotFoundError(f"--source {source} does not exist: give an image file or a folder of images")
    suffixes = tuple(e.lower() for e in extensions)
    files = (
        [source]
        if source.is_file()
        else sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)
    )
    results: list[dict] = []
    batch: list[tuple[Path, np.ndarray]] = []

    def flush() -> None:
        if batch:
            probabilities = torch.softmax(
                logits_of(model, np.stack([pixels for _, pixels in batch]), batch_size), dim=1
            ).numpy()
            for (path, _), answer in zip(batch, answers(probabilities, labels, 1), strict=True):
                results.append({"path": str(path), "label": answer["label"], "probability": answer["probability"]})
            batch.clear()

    for path in files:
        try:
            pixels, _, _ = resize_image(path.read_bytes(), size, mode, max_pixels)
        except (ImageDecodeError, OSError) as exc:
            results.append({"path": str(path), "label": None, "probability": 0.0, "error": str(exc)})
            continue
        batch.append((path, pixels))
        if len(batch) == batch_size:
            flush()
    flush()
    return results
