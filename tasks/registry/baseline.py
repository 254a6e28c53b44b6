"""Every run's floor: logistic regression on 32 px thumbnails of the same cached split, fitted beside the model.

A model that does not beat this plain baseline has learnt nothing the pixels' colours and layout do not already tell;
its margin over it is logged to MLflow, shown in the model card and the run summary, and can hold it back from
champion (`min_margin_over_baseline`). At most MAX_ROWS rows of each split are used, chosen at random with the
run's seed, so its cost stays small at any table size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from imagelake.tasks.data.cache_files import pixel_rows, split_files, split_format

THUMBNAIL = 32
MAX_ROWS = 20_000


@dataclass(frozen=True)
class Baseline:
    accuracy: float
    train_rows: int
    test_rows: int
    seconds: float


def thumbnails(uri: str, image_size: int, rows: int, limit: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to `limit` of a cached split's `rows` rows, chosen at random, as (n, 32*32*3) float32 thumbnails in [0, 1] and
    their labels. Read a row group at a time: only the chosen rows' thumbnails are kept."""
    chosen = np.sort(np.random.default_rng(seed).choice(rows, size=min(rows, limit), replace=False))
    fs, files = split_files(uri)
    image_format = split_format(uri)
    images, labels, start = [], [], 0
    for path in files:
        with fs.open(path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            for group in range(parquet.num_row_groups):
                table = parquet.read_row_group(group, columns=["image", "label"])
                lo, hi = np.searchsorted(chosen, [start, start + table.num_rows])
                if hi > lo:
                    take = chosen[lo:hi] - start
                    pixels = pixel_rows(  # only the chosen rows: a JPEG cache decodes no other
                        table.column("image").take(pa.array(take)),
                        image_size * image_size * 3,
                        f"cached split {uri}",
                        image_format,
                    )
                    batch = torch.from_numpy(pixels.reshape(-1, image_size, image_size, 3)).permute(0, 3, 1, 2).float()
                    images.append(F.adaptive_avg_pool2d(batch, THUMBNAIL).flatten(1).numpy() / 255)
                    labels.append(table.column("label").to_numpy()[take])
                start += table.num_rows
    if not images:
        return np.zeros((0, THUMBNAIL * THUMBNAIL * 3), np.float32), np.zeros(0, np.int64)
    return np.concatenate(images).astype(np.float32), np.concatenate(labels)


def fit_baseline(
    train_uri: str, test_uri: str, image_size: int, counts: dict[str, int], seed: int, limit: int = MAX_ROWS
) -> Baseline | None:
    """The baseline's test accuracy, or None where it cannot be fitted (fewer than two labels among the training rows,
    or no test rows)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    started = time.perf_counter()
    train_x, train_y = thumbnails(train_uri, image_size, counts["train"], limit, seed)
    test_x, test_y = thumbnails(test_uri, image_size, counts["test"], limit, seed + 1)
    if len(np.unique(train_y)) < 2 or len(test_y) == 0:
        return None
    # Standardised pixels and a strong L2 penalty: 3,072 features against a few hundred rows would overfit otherwise.
    model = make_pipeline(StandardScaler(), LogisticRegression(C=0.01, max_iter=500))
    model.fit(train_x, train_y)
    accuracy = float((model.predict(test_x) == test_y).mean())
    return Baseline(accuracy, len(train_y), len(test_y), time.perf_counter() - started)
