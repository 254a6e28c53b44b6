"""Decode and resize of single images: shapes, orientation, colour modes, bad input."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tasks.resize import ImageDecodeError, resize_image


def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


@pytest.mark.parametrize("mode", ["letterbox", "center_crop"])
@pytest.mark.parametrize("size", [16, 33])
def test_any_image_becomes_a_square_uint8_rgb(mode: str, size: int) -> None:
    pixels, width, height = resize_image(encode(Image.new("RGB", (40, 20), (200, 10, 10)), "JPEG"), size, mode)
    assert pixels.shape == (size, size, 3) and pixels.dtype == np.uint8
    assert (width, height) == (40, 20)


def test_letterbox_pads_the_short_side_with_black_and_keeps_the_image_centred() -> None:
    pixels, _, _ = resize_image(encode(Image.new("RGB", (40, 20), (255, 255, 255))), 20, "letterbox")
    assert pixels[0].max() == 0 and pixels[-1].max() == 0  # padding rows above and below
    assert pixels[10].min() == 255  # the image fills the middle


def test_center_crop_fills_the_whole_square() -> None:
    pixels, _, _ = resize_image(encode(Image.new("RGB", (40, 20), (255, 255, 255))), 20, "center_crop")
    assert pixels.min() == 255


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 20, 20))  # left half white
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    pixels, width, height = resize_image(encode(image, "PNG", exif=exif), 20, "center_crop")
    assert (width, height) == (20, 40)
    assert pixels[:5].mean() > 200 and pixels[-5:].mean() < 50  # white half is now on top


@pytest.mark.parametrize(
    "image",
    [
        Image.new("L", (10, 10), 128),
        Image.new("RGBA", (10, 10), (255, 0, 0, 0)),
        Image.new("P", (10, 10), 0),
        Image.new("I;16", (10, 10), 65535),
        Image.new("CMYK", (10, 10), (0, 0, 0, 0)),
    ],
    ids=["grey", "rgba-transparent", "palette", "16-bit", "cmyk"],
)
def test_colour_modes_convert_to_sensible_rgb(image: Image.Image) -> None:
    data = encode(image, "JPEG" if image.mode == "CMYK" else ("TIFF" if image.mode == "I;16" else "PNG"))
    pixels, _, _ = resize_image(data, 8, "center_crop")
    assert pixels.shape == (8, 8, 3)
    if image.mode == "RGBA":
        assert pixels.min() == 255  # fully transparent composites onto white, not black
    if image.mode in ("I;16", "CMYK"):
        assert pixels.min() > 200  # 16-bit white stays white; CMYK (0,0,0,0) is white


@pytest.mark.parametrize("data", [b"", b"not an image at all", encode(Image.new("RGB", (64, 64)), "JPEG")[:200]])
def test_bad_bytes_raise_a_decode_error(data: bytes) -> None:
    with pytest.raises(ImageDecodeError):
        resize_image(data, 16)
