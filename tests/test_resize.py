"""Decode and resize of single images: shapes, orientation, colour modes, bad input."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from imagelake.tasks.rules.images import ImageDecodeError, resize_image


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


@pytest.mark.parametrize("orientation,expected", [(1, (198, 188)), (6, (188, 198))])
def test_a_jpeg_records_its_own_size_not_that_of_its_reduced_decode(
    orientation: int, expected: tuple[int, int]
) -> None:
    # Pillow's draft() decodes this JPEG at a quarter scale (50x47) for a 32-pixel square; the table records the
    # source's size.
    exif = Image.Exif()
    exif[0x0112] = orientation
    pixels, width, height = resize_image(encode(Image.new("RGB", (198, 188), (90, 20, 20)), "JPEG", exif=exif), 32)
    assert pixels.shape == (32, 32, 3) and (width, height) == expected


def palette_with_transparency() -> Image.Image:
    image = Image.new("P", (10, 10), 0)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    image.info["transparency"] = 0  # index 0 (black) is transparent
    return image


@pytest.mark.parametrize(
    "image,fmt,check",
    [
        (Image.new("L", (10, 10), 128), "PNG", lambda p: (p == 128).all()),
        (
            Image.new("RGBA", (10, 10), (255, 0, 0, 0)),
            "PNG",
            lambda p: (p == 255).all(),
        ),  # transparent -> white, not black
        (palette_with_transparency(), "PNG", lambda p: (p == 255).all()),
        (Image.new("I;16", (10, 10), 65535), "PNG", lambda p: (p == 255).all()),  # 16-bit white stays white
        (Image.new("I;16", (10, 10), 32768), "PNG", lambda p: (p == 128).all()),
        (Image.new("CMYK", (10, 10), (0, 0, 0, 0)), "JPEG", lambda p: p.min() > 245),  # no ink is white
        (Image.new("CMYK", (10, 10), (0, 0, 0, 255)), "JPEG", lambda p: p.max() < 10),  # full black ink is black
    ],
    ids=["grey", "rgba-transparent", "palette-transparent", "16-bit-white", "16-bit-grey", "cmyk-white", "cmyk-black"],
)
def test_colour_modes_convert_to_the_right_rgb(image: Image.Image, fmt: str, check) -> None:
    data = encode(image, fmt, **({"transparency": 0} if image.mode == "P" else {}))
    pixels, _, _ = resize_image(data, 8, "center_crop")
    assert pixels.shape == (8, 8, 3)
    assert check(pixels), pixels[0, 0]


def test_a_large_16_bit_image_is_narrowed_in_strips_with_its_values_and_a_byte_a_pixel() -> None:
    """A 16-bit image (a gradient over every value, 1000 wide and 3000 tall, cut in uneven strips) narrows to its top 8
    bits with under two bytes a pixel of memory beside Pillow's own image (numpy's and Python's, traced): it once took
    24 (int64, copied twice)."""
    import tracemalloc

    from imagelake.tasks.rules.images import to_rgb

    values = (np.arange(3000 * 1000, dtype=np.uint32) * 65536 // (3000 * 1000)).astype(np.uint16).reshape(3000, 1000)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    tracemalloc.start()
    narrowed = to_rgb(image)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 * values.size, f"{peak / values.size:.1f} bytes a pixel"
    assert narrowed.mode == "RGB" and np.array_equal(np.asarray(narrowed)[..., 1], (values >> 8).astype(np.uint8))
    wide = Image.fromarray(np.array([[-5, 70000, 256, 65535]], dtype=np.int32))  # "I", 32-bit: clipped to 16 bits first
    assert np.asarray(to_rgb(wide))[..., 0].tolist() == [[0, 255, 1, 255]]


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "empty_file"),
        (b"not an image at all", "not_an_image"),
        (encode(Image.effect_noise((300, 300), 64).convert("RGB"), "JPEG")[:3000], "truncated"),
    ],
)
def test_bad_bytes_raise_a_decode_error_with_its_reason(data: bytes, reason: str) -> None:
    with pytest.raises(ImageDecodeError) as raised:
        resize_image(data, 16)
    assert raised.value.reason == reason


def test_images_over_the_pixel_limit_are_decompression_bombs() -> None:
    with pytest.raises(ImageDecodeError) as raised:
        resize_image(encode(Image.new("RGB", (500, 500)), "PNG"), 16, max_pixels=100_000)
    assert raised.value.reason == "decompression_bomb"


def test_decoding_that_goes_past_its_deadline_quarantines_the_file_and_the_stage_goes_on() -> None:
    """The deadline is checked as the decoder reads the file: a file still being read past it is `decode_timeout`, in
    the decoding rules (predict, serving, scoring) and in the resize stage's processing of one file, which moves on."""
    from imagelake.tasks.data.resize_executor import DecodeRules, process_file

    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (600, 600, 3), dtype=np.uint8)).save(png, format="PNG")
    data = png.getvalue()
    with pytest.raises(
        ImageDecodeError, match=r"decode_timeout: decoding went on past 0 s \(max_decode_seconds\)"
    ) as stopped:
        resize_image(data, 32, max_seconds=0)
    assert stopped.value.reason == "decode_timeout"
    assert resize_image(data, 32)[0].shape == (32, 32, 3), "the default deadline leaves it decoded"

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "slow.png"
        path.write_bytes(data)
        row = {"path": str(path), "action": "upsert", "issue": None, "known_sha256": None}
        staged, pixels = process_file(
            row, DecodeRules(size=32, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000, max_seconds=0)
        )
        assert (staged["status"], staged["reason"], pixels) == ("quarantined", "decode_timeout", None)
        staged, pixels = process_file(
            row, DecodeRules(size=32, mode="letterbox", max_file_bytes=10_000_000, max_pixels=10_000_000)
        )
        assert staged["status"] == "new" and len(pixels) == 32 * 32 * 3
