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
    for index, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
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


def write_photos(out: Path, per_label: int = 150, seed: int = 0, sizes: tuple[int, int] = (300, 1600)) -> int:
    """Write OUT/<photo>/<id>.jpg: random crops of scikit-learn's two sample photos (china, flower), each resized so
    its long side is between `sizes` pixels, as real-world JPEGs; return how many files were written."""
    from sklearn.datasets import load_sample_images

    samples = load_sample_images()
    rng = np.random.default_rng(seed)
    for name, photo in zip(("china", "flower"), samples.images, strict=False):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        height, width = photo.shape[:2]
        for index in range(per_label):
            # A crop of a quarter to all of the photo's height, of a random aspect ratio, anywhere in it.
            crop_h = int(rng.integers(height // 4, height + 1))
            crop_w = int(min(width, max(16, crop_h * rng.uniform(0.6, 1.6))))
            top, left = int(rng.integers(0, height - crop_h + 1)), int(rng.integers(0, width - crop_w + 1))
            image = Image.fromarray(photo[top : top + crop_h, left : left + crop_w])
            if rng.random() < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            long_side = int(rng.integers(sizes[0], sizes[1] + 1))
            scale = long_side / max(image.size)
            image = image.resize(
                (max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.Resampling.BICUBIC
            )
            image.save(folder / f"{index:04d}.jpg", quality=int(rng.integers(75, 96)))
    return per_label * len(samples.images)
