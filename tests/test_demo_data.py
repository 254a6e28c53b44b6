"""The demo dataset: real digits, ImageFolder layout, upscaled PNGs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from imagelake.flows.demo_data import write_digits


def test_digits_are_written_per_label_as_upscaled_pngs(tmp_path: Path) -> None:
    count = write_digits(tmp_path, size=48, per_label=3)
    files = sorted(tmp_path.glob("*/*.png"))
    assert count == len(files) == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(d) for d in range(10)]
    image = Image.open(files[0])
    assert image.size == (48, 48)
    assert np.asarray(image).std() > 10  # real strokes, not a blank image


def test_too_small_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size"):
        write_digits(tmp_path, size=4)
