"""The registered model as MLflow serves it: encoded image bytes in, label names and probabilities out.

MLflow saves this file with each registered version (a model "from code") and runs it wherever the model is loaded
with `mlflow.pyfunc.load_model` or served with `mlflow models serve`. It imports torch, numpy, pandas, Pillow, MLflow
and the rules it shares with `imagelake predict` (`tasks/rules/images.py` and `answers.py`, saved with the model as the
package `imagelake_served`), nothing else of imagelake. The network is the torch.export program beside it
(`model.pt2`), which loads without unpickling; the labels, image size and resize mode are a JSON file beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import BAD_REQUEST

try:  # the rules saved with the model (tasks/registry/loading.py), wherever the model is loaded
    from imagelake_served.answers import answers, image_bytes
    from imagelake_served.images import resize_image
except ModuleNotFoundError:  # in imagelake's own process (tasks/registry/loading.py imports this file for its path)
    from imagelake.tasks.rules.answers import answers, image_bytes
    from imagelake.tasks.rules.images import resize_image

PROGRAM, META = "program", "meta"  # its artifacts (tasks/registry/loading.py logs them): the program, labels and sizes
IMAGE = "image"  # the input column
TOP_K = 3  # the default of the top_k parameter
# A request's bounds: a small body can hold many tiny images (1 KB of Parquet, 100,000 PNGs) or a few huge ones.
MAX_ROWS = 4096  # images a request may hold
REQUEST_PIXELS_AT_MAX = 16  # source pixels a request may decode, as images of max_image_pixels each
DECODE_BATCH = 64  # images decoded, answered and let go at a time


def table(rows: list[dict]) -> pd.DataFrame:
    """The answer's columns; a bad row's probability stays None (JSON null), where pandas would make it NaN (not
    JSON)."""
    return pd.DataFrame(
        {
            column: pd.Series([row[column] for row in rows], dtype=object)
            for column in ("label", "probability", "top_k", "error")
        }
    )


def bounded(rows: int) -> None:
    """Refuse a request of more than MAX_ROWS images (a 400 that names the bound)."""
    if rows > MAX_ROWS:
        raise MlflowException(
            f"the request holds {rows} images; a request may hold at most {MAX_ROWS}: send them in several requests",
            error_code=BAD_REQUEST,
        )


class ImageClassifierModel(mlflow.pyfunc.PythonModel):
    """An image classifier over encoded image files: each row's `image` (bytes, or base64 in JSON) is decoded by the
    rules the training data was decoded with, and answered with its label, probability and top k; a row that is not
    an image is answered with `error` naming why, and the other rows are still answered."""

    def load_context(self, context) -> None:
        meta = json.loads(Path(context.artifacts[META]).read_text())
        self.use(meta, torch.export.load(context.artifacts[PROGRAM]).module())

    def use(self, meta: dict, network: torch.nn.Module) -> ImageClassifierModel:
        """Answer with NETWORK (the program, loaded) and META (its labels and sizes): what `load_context` does with a
        version's files, and what imagelake's batch scorer does with a program it has loaded and checked itself."""
        self.labels: list[str] = meta["labels"]
        self.image_size, self.resize_mode, self.max_pixels = (
            int(meta["image_size"]),
            meta["resize_mode"],
            meta.get("max_image_pixels"),
        )
        self.network = network
        return self

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        top_k = int((params or {}).get("top_k", TOP_K))
        if top_k < 1:
            raise MlflowException(f"top_k must be at least 1, got {top_k}", error_code=BAD_REQUEST)
        top_k = min(top_k, len(self.labels))
        if isinstance(
            model_input, np.ndarray
        ):  # images already decoded: (N, size, size, 3) uint8, as the table stores them
            bounded(len(model_input))
            return table(self._answer(model_input, top_k))
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        if IMAGE not in frame.columns or frame.empty:
            raise MlflowException(
                f"the request has no images: send a table with an {IMAGE!r} column, one image file's bytes "
                "per row (base64 in JSON)",
                error_code=BAD_REQUEST,
            )
        bounded(len(frame))
        rows: list[dict | None] = [None] * len(frame)
        budget = REQUEST_PIXELS_AT_MAX * (self.max_pixels or 64_000_000)
        spent = 0
        for start in range(0, len(frame), DECODE_BATCH):  # at most one batch's pixels held at a time
            decoded, places = [], []
            for place, value in enumerate(frame[IMAGE].iloc[start : start + DECODE_BATCH], start):
                try:
                    pixels, width, height = resize_image(
                        image_bytes(value), self.image_size, self.resize_mode, self.max_pixels
                    )
                except Exception as exc:  # any failure of one row is that row's answer, never the request's
                    reason = str(exc) if isinstance(exc, ValueError) else f"undecodable: {type(exc).__name__}: {exc}"
                    rows[place] = {"label": None, "probability": None, "top_k": [], "error": reason}
                    continue
                spent += width * height
                if spent > budget:
                    raise MlflowException(
                        f"the request's images decode to more than {budget:,} pixels (as {REQUEST_PIXELS_AT_MAX} "
                        "images of the largest size a model takes): send them in several requests",
                        error_code=BAD_REQUEST,
                    )
                decoded.append(pixels)
                places.append(place)
            if decoded:
                for place, answer in zip(places, self._answer(np.stack(decoded), top_k), strict=True):
                    rows[place] = answer
        return table(rows)

    @torch.no_grad()
    def _answer(self, images: np.ndarray, top_k: int, batch_size: int = 64) -> list[dict]:
        logits = torch.cat(
            [
                self.network(torch.from_numpy(np.ascontiguousarray(images[i : i + batch_size]))).float()
                for i in range(0, len(images), batch_size)
            ]
        )
        return answers(torch.softmax(logits, dim=1).numpy(), self.labels, top_k)


mlflow.models.set_model(ImageClassifierModel())
