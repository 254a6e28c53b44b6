"""What a model's answer for one image is: its label, probability and top k, from the class probabilities. Shared by
`imagelake predict` and the registered model MLflow serves (tasks/inference/served_pyfunc.py, which carries this file).

Pure: numpy only.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np


def image_bytes(value: object) -> bytes:
    """One cell of an image column as the file's bytes: bytes as they are, a str as base64 (JSON requests)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(
                "not_base64: a string in the image column must be the image file's bytes in base64"
            ) from None
    raise ValueError(
        f"not_bytes: the image column holds {type(value).__name__}; send the image file's bytes (base64 in JSON)"
    )


def answers(probabilities: np.ndarray, labels: list[str], top_k: int) -> list[dict]:
    """For (N, classes) probabilities: per row its label, probability and the `top_k` labels with theirs, most likely
    first (a class without a name is named by its index)."""
    rows = []
    for row in np.asarray(probabilities, dtype=np.float64):
        order = np.argsort(-row, kind="stable")[: max(1, top_k)]
        top = [{"label": labels[i] if i < len(labels) else str(i), "probability": float(row[i])} for i in order]
        rows.append({"label": top[0]["label"], "probability": top[0]["probability"], "top_k": top, "error": None})
    return rows
