"""Batch scoring against the model's own limit: `imagelake score`'s stage on Spark, side by side with the registered
model's forward pass alone and with its pyfunc decoding and answering in one process, on the same machine.

    .venv/bin/python bench/score.py [--images 2000] [--size 64] [--arch small_cnn] [--runs 3]

Writes --images PNG files (random colour fields with noise, 96-160 px, so that each is decoded and letterboxed) and
registers a --arch model at --size px in a temporary MLflow store exactly as the promote stage does (the served pyfunc).
Then, each --runs times:
  forward    the exported program on (N, size, size, 3) uint8 batches already decoded, in this process with torch's
             default threads, the best of three passes: the model's limit here
  pyfunc     mlflow.pyfunc.load_model(...).predict on the files' bytes, one process: decode + forward + answers
  score      tasks/stages/score.py:score_images on the folder: Spark's local executors, each Python worker loading the
             model once, into a fresh predictions table (Spark's start is not counted: the session is started first)
  re-run     the same again: nothing new to answer (every file is still read and hashed)
Printed: each path's images/s (min, median, max) and its median over the forward pass's.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from figures import add_record_option, keep  # bench/figures.py

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def write_images(folder: Path, count: int, seed: int = 0) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for i in range(count):
        height, width = (int(x) for x in rng.integers(96, 161, 2))
        pixels = np.clip(rng.integers(0, 256, 3) + rng.integers(-40, 40, (height, width, 3)), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        (folder / f"{i:06d}.png").write_bytes(out.getvalue())


def register(root: Path, arch: str, size: int) -> str:
    """A fresh model registered as the promote stage registers one; its tracking URI."""
    import mlflow
    import torch

    from imagelake.tasks.registry.loading import served_model
    from imagelake.tasks.rules.warm_start import labels_tag
    from imagelake.tasks.worker.model import ImageModel

    store = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    mlflow.set_registry_uri(store)
    experiment = mlflow.create_experiment("bench", artifact_location=str(root / "artifacts"))
    labels = [f"class {i}" for i in range(10)]
    torch.manual_seed(0)
    model = ImageModel(10, arch, image_size=size).eval()
    examples = np.zeros((2, size, size, 3), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as folder, mlflow.start_run(experiment_id=experiment):
        info = mlflow.pyfunc.log_model(
            name="model", **served_model(Path(folder), model, labels, size, "letterbox", 10_000_000, examples)
        )
    version = mlflow.register_model(
        info.model_uri, "bench", tags={"labels": labels_tag(labels), "image_size": str(size)}
    ).version
    mlflow.MlflowClient(store, store).set_registered_model_alias("bench", "champion", version)
    return store


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--arch", default="small_cnn")
    parser.add_argument("--runs", type=int, default=3)
    add_record_option(parser)
    args = parser.parse_args()

    import mlflow
    import pandas as pd

    from imagelake.infra.settings import load_settings
    from imagelake.infra.spark import spark_session
    from imagelake.tasks.rules.images import resize_image
    from imagelake.tasks.stages.score import score_images

    work = Path(tempfile.mkdtemp(prefix="imagelake-score-"))
    try:
        folder = work / "images"
        write_images(folder, args.images)
        store = register(work, args.arch, args.size)
        settings = load_settings(overrides={"workspace": str(work / "ws"), "mlflow_tracking_uri": store})
        spark = spark_session(settings)
        cores = spark.sparkContext.defaultParallelism
        model = mlflow.pyfunc.load_model("models:/bench@champion")
        files = sorted(folder.iterdir())
        data = [path.read_bytes() for path in files]
        decoded = np.stack([resize_image(blob, args.size, "letterbox")[0] for blob in data])
        python_model = model.unwrap_python_model()
        python_model._answer(decoded[:256], 3)  # the program's first calls are slower: warmed before any timing
        rates: dict[str, list[float]] = {"forward": [], "pyfunc": [], "score": [], "re-run": []}
        for _ in range(args.runs):
            # The best of three passes: at this rate a pass is a fraction of a second, and Spark's JVM beside it adds
            # noise.
            rates["forward"].append(
                len(decoded) / min(timed(lambda: python_model._answer(decoded, 3)) for _ in range(3))
            )
            rates["pyfunc"].append(len(data) / timed(lambda: model.predict(pd.DataFrame({"image": data}))))
            shutil.rmtree(settings.predictions_uri, ignore_errors=True)
            answered: dict = {}
            rates["score"].append(
                len(files)
                / timed(
                    lambda answered=answered: answered.update(score_images(str(folder), "bench@champion", settings))
                )
            )
            assert answered["answered"] == len(files), answered
            rates["re-run"].append(
                len(files)
                / timed(
                    lambda answered=answered: answered.update(score_images(str(folder), "bench@champion", settings))
                )
            )
            assert answered["answered"] == 0, answered
        print(
            f"{args.images} PNGs (96-160 px) -> {args.arch} at {args.size} px; Spark local with {cores} "
            f"cores; {args.runs} runs"
        )
        limit = statistics.median(rates["forward"])
        keep(
            args,
            "score",
            f"images/s scoring {args.images} PNGs with {args.arch} at {args.size} px (median of {args.runs})",
            {
                **{f"{name.replace('-', '_')}_images_per_s": round(statistics.median(v)) for name, v in rates.items()},
                "score_of_forward_ratio": round(statistics.median(rates["score"]) / limit, 2),
            },
        )
        for name, values in rates.items():
            print(
                f"  {name:8} images/s min {min(values):8.0f}  median {statistics.median(values):8.0f}  max "
                f"{max(values):8.0f}   {statistics.median(values) / limit:5.2f} of forward"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
