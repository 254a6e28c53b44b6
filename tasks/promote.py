"""Promote: log and register the trained model, test it, and move the `champion` or `challenger` alias."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlflow
import numpy as np
import pyarrow.dataset as ds
import torch
from matplotlib.figure import Figure
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect.runtime import flow_run

from infra.settings import Settings
from infra.tracking import mlflow_client
from tasks.model import ImageClassifier, ImageModel
from tasks.results import CachedSplits, Promoted, Trained
from tasks.stage import stage

CHAMPION, CHALLENGER = "champion", "challenger"


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def decide_promotion(candidate: float, champion: float | None, margin: float = 0.0) -> Decision:
    """Promote when there is no champion, or when the candidate's accuracy beats the champion's by more than `margin`."""
    for name, value in (("candidate accuracy", candidate), ("champion accuracy", champion), ("margin", margin)):
        if value is not None and (math.isnan(value) or not 0.0 <= value <= 1.0):
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if champion is None:
        return Decision(True, f"no champion yet; candidate accuracy {candidate:.4f}")
    if candidate > champion + margin:
        return Decision(True, f"candidate {candidate:.4f} beats champion {champion:.4f} by more than {margin:.4f}")
    return Decision(False, f"candidate {candidate:.4f} does not beat champion {champion:.4f} by more than {margin:.4f}")


def load_trained_model(checkpoint_path: str) -> ImageModel:
    """The plain torch model from a Lightning checkpoint, in eval mode on the CPU."""
    # The trained weights are all in the checkpoint: never fetch the pretrained ones again.
    module = ImageClassifier.load_from_checkpoint(checkpoint_path, map_location="cpu", pretrained_weights=None)
    return module.model.eval()


def read_split(uri: str, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """All images (N, H, W, 3 uint8) and labels of one cached split."""
    table = ds.dataset(uri, format="parquet").to_table(columns=["image", "label"])
    images = table.column("image").combine_chunks()
    per_image = image_size * image_size * 3
    offsets = np.frombuffer(images.buffers()[1], dtype=np.int32)[images.offset : images.offset + len(images) + 1]
    if images.null_count or np.any(np.diff(offsets) != per_image):
        raise ValueError(f"cached split {uri} holds images that are not {image_size}x{image_size}x3: rebuild the cache")
    # Binary values lie back to back: one frombuffer over the data buffer reads them all.
    pixels = np.frombuffer(images.buffers()[2], dtype=np.uint8, count=len(images) * per_image, offset=int(offsets[0]))
    return pixels.reshape(len(images), image_size, image_size, 3), table.column("label").to_numpy()


@torch.no_grad()
def predict(model: ImageModel, images: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """The class with the highest logit for every image."""
    out = [model(torch.from_numpy(images[start : start + batch_size].copy())).argmax(dim=1).numpy() for start in range(0, len(images), batch_size)]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def accuracy(model: ImageModel, images: np.ndarray, labels: np.ndarray, batch_size: int = 256) -> float:
    """Share of images whose highest logit is the true label."""
    return float((predict(model, images, batch_size) == labels).mean())


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, classes: int) -> np.ndarray:
    """Counts of (true class, predicted class)."""
    matrix = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def confusion_figure(matrix: np.ndarray, names: list[str]) -> Figure:
    figure = Figure(figsize=(1 + 0.5 * len(names), 0.8 + 0.5 * len(names)))
    axis = figure.subplots()
    axis.imshow(matrix, cmap="Blues")
    axis.set_xticks(range(len(names)), names, rotation=90)
    axis.set_yticks(range(len(names)), names)
    axis.set_xlabel("predicted")
    axis.set_ylabel("true")
    for (row, column), count in np.ndenumerate(matrix):
        axis.text(column, row, str(count), ha="center", va="center", fontsize=7)
    figure.tight_layout()
    return figure


def champion_accuracy(client: MlflowClient, name: str) -> tuple[str | None, float | None]:
    """The current champion's version and recorded test accuracy, or (None, None)."""
    try:
        version = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST" and "not found" not in str(exc).lower():
            raise
        return None, None
    recorded = version.tags.get("test_accuracy")
    return version.version, float(recorded) if recorded is not None else None


def promote_model(trained: Trained, cached: CachedSplits, settings: Settings, flow_run_id: str | None) -> Promoted:
    """Register the trained model with its lineage, test it, and give it the alias it earned."""
    client = mlflow_client(settings)
    model = load_trained_model(trained.checkpoint_path)
    images, labels = read_split(cached.splits["test"], cached.image_size)
    predicted = predict(model, images)
    test_accuracy = float((predicted == labels).mean())
    with mlflow.start_run(run_id=trained.mlflow_run_id):
        mlflow.log_metric("test_accuracy", test_accuracy)
        mlflow.log_figure(confusion_figure(confusion_matrix(labels, predicted, len(cached.labels)), cached.labels), "confusion_matrix.png")
        info = mlflow.pytorch.log_model(model, name="model", input_example=images[:2].copy())
    version = mlflow.register_model(info.model_uri, settings.model_name)
    tags = {
        "delta_table": cached.table_uri,
        "delta_version": str(cached.table_version),
        "cache_key": cached.key,
        "prefect_flow_run_id": flow_run_id or "",
        "mlflow_run_id": trained.mlflow_run_id,
        "test_accuracy": f"{test_accuracy:.6f}",
        "labels": ",".join(cached.labels),
    }
    for key, value in tags.items():
        client.set_model_version_tag(settings.model_name, version.version, key, value)
    champion_version, champion_acc = champion_accuracy(client, settings.model_name)
    decision = decide_promotion(test_accuracy, champion_acc, settings.promotion_margin)
    alias = CHAMPION if decision.promote else CHALLENGER
    client.set_model_version_tag(settings.model_name, version.version, "promotion_decision", decision.reason)
    client.set_registered_model_alias(settings.model_name, alias, version.version)
    return Promoted(
        model_name=settings.model_name,
        model_version=str(version.version),
        alias=alias,
        champion_version=str(version.version) if decision.promote else str(champion_version),
        test_accuracy=test_accuracy,
        previous_champion_accuracy=champion_acc,
    )


@stage("promote", retries=1)
def promote(trained: Trained, cached: CachedSplits, settings: Settings) -> Promoted:
    """Prefect stage: registry promotion."""
    return promote_model(trained, cached, settings, flow_run.id)
