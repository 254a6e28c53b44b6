"""Mutated image files (bit flips, truncations, header and chunk edits) of every common format: decoding each one
either gives an image or raises ImageDecodeError, whose reason quarantines that file. Anything else would fail the
resize stage for every run until the file is deleted."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

from imagelake.tasks.rules.images import ImageDecodeError, decode_square

FORMATS = {
    "PNG": {},
    "JPEG": {"quality": 85},
    "GIF": {},
    "TIFF": {"compression": "tiff_lzw"},
    "BMP": {},
    "WEBP": {"quality": 80},
}
MUTATIONS_PER_FORMAT = 200  # 1,200 files in all
MAX_PIXELS = 64_000_000  # the settings' default max_image_pixels


def sample(kind: str) -> bytes:
    rng = np.random.default_rng(len(kind))
    pixels = (
        (np.linspace(0, 255, 20 * 28 * 3).reshape(20, 28, 3) + rng.integers(0, 40, (20, 28, 3)))
        .clip(0, 255)
        .astype(np.uint8)
    )
    out = io.BytesIO()
    image = Image.fromarray(pixels)
    (image.convert("P") if kind == "GIF" else image).save(out, format=kind, **FORMATS[kind])
    return out.getvalue()


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One of: flip a few bits, cut the file short, overwrite bytes of its header, or repeat/drop a run of bytes."""
    blob = bytearray(data)
    how = rng.randrange(4)
    if how == 0:
        for _ in range(rng.randint(1, 8)):
            blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
    elif how == 1:
        del blob[rng.randrange(1, len(blob)) :]
    elif how == 2:
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(min(64, len(blob)))] = rng.randrange(256)
    else:
        start = rng.randrange(len(blob))
        run = bytes(blob[start : start + rng.randint(1, 64)])
        blob[start:start] = run * rng.randint(0, 3) if rng.random() < 0.7 else b""
        if not run:
            del blob[start : start + 8]
    return bytes(blob)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_a_mutated_file_is_decoded_or_quarantined_never_an_error_of_another_kind(kind: str) -> None:
    original = sample(kind)
    decode_square(original, 16, max_pixels=MAX_PIXELS)  # the unmutated file decodes
    rng = random.Random(f"fuzz-{kind}")
    outcomes: dict[str, int] = {}
    for i in range(MUTATIONS_PER_FORMAT):
        data = mutate(original, rng)
        try:
            square, _, _ = decode_square(data, 16, max_pixels=MAX_PIXELS)
            assert square.size == (16, 16) and square.mode == "RGB"
            outcome = "decoded"
        except ImageDecodeError as exc:
            outcome = exc.reason
        except Exception as exc:  # noqa: BLE001 - what the test is about
            pytest.fail(
                f"{kind} mutation {i}: {type(exc).__name__}: {exc} (not an ImageDecodeError: the resize "
                "stage would fail)"
            )
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert sum(outcomes.values()) == MUTATIONS_PER_FORMAT and len(outcomes) > 1, outcomes


def dds_of_unknown_pixel_format() -> bytes:
    """A DirectDraw Surface header (as a file named .png may hold) whose pixel format Pillow has no decoder for."""
    import struct

    header = (
        struct.pack("<7I", 124, 0x1007, 8, 8, 0, 0, 0)
        + bytes(44)
        + struct.pack("<2I", 32, 0x4)
        + b"XYZW"
        + bytes(20)
        + struct.pack("<5I", 0x1000, 0, 0, 0, 0)
    )
    return b"DDS " + header + bytes(256)


def test_a_file_pillow_has_no_decoder_for_is_quarantined_with_the_error_s_type() -> None:
    """Pillow raises NotImplementedError here (and other decoders TypeError, struct.error, IndexError...): not a reason
    to stop the run, the file is quarantined like any undecodable one."""
    with pytest.raises(ImageDecodeError, match="NotImplementedError") as raised:
        decode_square(dds_of_unknown_pixel_format(), 16)
    assert raised.value.reason == "undecodable"


def test_a_tiff_with_edited_directory_entries_is_decoded_or_quarantined() -> None:
    """Each entry of a TIFF's directory: its type, count or value overwritten, 400 times."""
    import struct

    original = sample("TIFF")
    directory = struct.unpack("<I", original[4:8])[0]
    entries = struct.unpack("<H", original[directory : directory + 2])[0]
    rng = random.Random("tiff-directory")
    for i in range(400):
        data = bytearray(original)
        entry = directory + 2 + 12 * rng.randrange(entries)
        part = rng.choice(
            [
                (2, struct.pack("<H", rng.randrange(1, 19))),
                (4, struct.pack("<I", rng.choice([0, 1, 3, 1000, 2**31]))),
                (8, struct.pack("<I", rng.randrange(2**32))),
            ]
        )
        data[entry + part[0] : entry + part[0] + len(part[1])] = part[1]
        try:
            decode_square(bytes(data), 16, max_pixels=MAX_PIXELS)
        except ImageDecodeError:
            pass
        except Exception as exc:  # noqa: BLE001 - what the test is about
            pytest.fail(f"TIFF directory edit {i}: {type(exc).__name__}: {exc}")
