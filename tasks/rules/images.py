"""Image decoding rules: any image file's bytes to a square RGB image of one size, the same way for training and
prediction.

Pure: Pillow and numpy only, no engine; the resize stage runs these on Spark's executors, `imagelake predict` in the
driver.
"""

from __future__ import annotations

import io
import time
from typing import Literal

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

ResizeMode = Literal["letterbox", "center_crop"]
EXIF_ORIENTATION = 0x0112


class ImageDecodeError(ValueError):
    """A file that is not a decodable image; `reason` is the quarantine reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


STRIP_ROWS = 256  # rows of a 16- or 32-bit image narrowed at a time
DECODE_SECONDS = 30.0  # the default bound of one file's decoding (the resize stage's max_decode_seconds)


class DecodeTimeout(Exception):
    """One file's decoding went past its deadline."""


class TimedBytes(io.BytesIO):
    """A file's bytes as Pillow's decoders read them, a chunk at a time: a read past the deadline raises DecodeTimeout,
    so a file that keeps a decoder going round its chunks is stopped between two of them (a decoder stuck inside one
    call
    of its C code is not: only a process of its own could bound that)."""

    def __init__(self, data: bytes, deadline: float) -> None:
        super().__init__(data)
        self.deadline = deadline

    def _check(self) -> None:
        if time.monotonic() >= self.deadline:
            raise DecodeTimeout

    def read(self, size: int | None = -1, /) -> bytes:
        self._check()
        return super().read(size)

    def readinto(self, buffer, /) -> int:  # type: ignore[no-untyped-def, override]
        self._check()
        return super().readinto(buffer)

    def readline(self, size: int | None = -1, /) -> bytes:
        self._check()
        return super().readline(size)


def to_8bit(image: Image.Image) -> Image.Image:
    """An "I;16*" or "I" image as "L", each value's top 8 of 16 bits. Narrowed a strip of rows at a time into the one
    8-bit array: beside Pillow's own image, the peak is 1 byte a pixel and a strip (an 8000 x 8000 16-bit PNG once
    took about 20 bytes a pixel here, widened to int64 and copied twice)."""
    width, height = image.size
    narrow = np.empty((height, width), dtype=np.uint8)
    for top in range(0, height, STRIP_ROWS):
        strip = np.asarray(image.crop((0, top, width, min(height, top + STRIP_ROWS))))
        if strip.dtype.kind == "i":  # "I" is signed 32-bit: out of 0..65535 is clipped, as 16 bits hold
            strip = strip.clip(0, 65535)
        narrow[top : top + len(strip)] = strip >> 8
    return Image.frombuffer("L", (width, height), narrow, "raw", "L", 0, 1)  # the array's memory, not a copy of it


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB of any Pillow mode: 16-bit scaled down, transparency composited on white."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        image = to_8bit(image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    return image.convert("RGB")


def fit_square(image: Image.Image, size: int, mode: ResizeMode) -> Image.Image:
    """Letterbox (scale the long side to `size`, pad with black) or centre-crop to size x size."""
    width, height = image.size
    scale = size / (max(width, height) if mode == "letterbox" else min(width, height))
    new_size = (max(1, round(width * scale)), max(1, round(height * scale)))
    scaled = image.resize(new_size, Image.Resampling.BILINEAR, reducing_gap=3.0)
    if mode == "center_crop":
        left, top = (new_size[0] - size) // 2, (new_size[1] - size) // 2
        return scaled.crop((left, top, left + size, top + size))
    canvas = Image.new("RGB", (size, size))
    canvas.paste(scaled, ((size - new_size[0]) // 2, (size - new_size[1]) // 2))
    return canvas


def decode_square(
    data: bytes,
    size: int,
    mode: ResizeMode = "letterbox",
    max_pixels: int | None = None,
    max_seconds: float = DECODE_SECONDS,
) -> tuple[Image.Image, int, int]:
    """Decode one image file's bytes into a size x size RGB image; also return its oriented width and height. Decoding
    that reads the file past MAX_SECONDS stops, and the file is `decode_timeout`."""
    if not data:
        raise ImageDecodeError("empty_file", "0 bytes")
    try:
        with Image.open(TimedBytes(data, time.monotonic() + max_seconds)) as image:
            if max_pixels and image.width * image.height > max_pixels:
                raise ImageDecodeError(
                    "decompression_bomb", f"{image.width}x{image.height} is over max_image_pixels={max_pixels}"
                )
            # The source's size as displayed: EXIF orientations 5-8 turn it a quarter (read before draft() shrinks it).
            width, height = image.size
            if image.getexif().get(EXIF_ORIENTATION, 1) in (5, 6, 7, 8):
                width, height = height, width
            # draft() only helps before pixels load: JPEGs then decode at a reduced scale, still >= size.
            image.draft("RGB", (size, size))
            oriented = ImageOps.exif_transpose(image)
            square = fit_square(to_rgb(oriented), size, mode)
    except ImageDecodeError:
        raise
    except DecodeTimeout:
        raise ImageDecodeError(
            "decode_timeout", f"decoding went on past {max_seconds:g} s (max_decode_seconds)"
        ) from None
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError("decompression_bomb", str(exc)) from None
    except UnidentifiedImageError:
        # Pillow's own message names the in-memory buffer it was given, which tells the user nothing.
        raise ImageDecodeError("not_an_image", "no image format recognises these bytes") from None
    except SyntaxError as exc:
        raise ImageDecodeError("not_an_image", str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any decoder error is this file's, never the run's
        # Beyond OSError and ValueError, Pillow's decoders raise NotImplementedError (a DDS pixel format it lacks),
        # TypeError (a mistyped TIFF tag), struct.error, IndexError, ZeroDivisionError...: each quarantines the file,
        # its type named, where it used to fail the stage (TypeError counts as a permanent error there).
        reason = "truncated" if "truncated" in str(exc) or "broken data stream" in str(exc) else "undecodable"
        raise ImageDecodeError(reason, f"{type(exc).__name__}: {exc}") from None
    return square, width, height


def resize_image(
    data: bytes,
    size: int,
    mode: ResizeMode = "letterbox",
    max_pixels: int | None = None,
    max_seconds: float = DECODE_SECONDS,
) -> tuple[np.ndarray, int, int]:
    """Decode one image file's bytes into size x size x 3 uint8 pixels; also return its oriented width and height."""
    square, width, height = decode_square(data, size, mode, max_pixels, max_seconds)
    return np.asarray(square, dtype=np.uint8), width, height
