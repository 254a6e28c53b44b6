"""The demo dataset: scikit-learn's handwritten digits, written as PNG files in ImageFolder layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def write_digits(out: Path, size: int = 64, per_label: int | None = None) -> int:
    """Write OUT/<digit>/<id>.png, upscaled from 8x8 to size x size; return how many files were written."""
    if size < 8:
        raise ValueError(f"size must be at least 8 pixels, got {size}")
    digits = load_digits()
    written: dict[int, int] = {}
    for index, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        label = int(label)
        if per_label is not None and written.get(label, 0) >= per_label:
            continue
        grey = np.clip(pixels * (255.0 / 16.0), 0, 255).astype(np.uint8)
        image = Image.fromarray(grey, "L").resize((size, size), Image.Resampling.BICUBIC)
        folder = out / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{index:04d}.png")
        written[label] = written.get(label, 0) + 1
    return sum(written.values())
