"""Promote: log and register the trained model with its lineage, then the gate moves `champion` or `challenger`."""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from pyspark.sql import functions as F

from imagelake.infra.console import library_prints
from imagelake.infra.delta import Table
from imagelake.infra.settings import Settings, stage_settings
from imagelake.infra.tracking import git_commit, mlflow_client, run_url
from imagelake.tasks.data.cache_files import pixel_rows, split_files, split_format
from imagelake.tasks.data.resize_executor import DecodeRules, read_with_retries
from imagelake.tasks.data.table import matching
from imagelake.tasks.results import CachedSplits, Promoted, Trained
from imagelake.tasks.rules.images import resize_image
from imagelake.tasks.rules.promotion import CHALLENGER, CHAMPION, Decision, decision_markdown
from imagelake.tasks.rules.training import started_from
from imagelake.tasks.rules.warm_start import labels_tag
from imagelake.tasks.stage import stage

if TYPE_CHECKING:  # torch, Lightning, MLflow and matplotlib load in the functions that use them (start-up)
    from matplotlib.figure import Figure
    from mlflow import MlflowClient

    from imagelake.tasks.registry.gate import TestRowsAt
    from imagelake.tasks.worker.model import ImageModel


def load_trained_model(checkpoint_path: str) -> ImageModel:
    """The plain torch model from a Lightning checkpoint, in eval mode on the CPU."""
    from imagelake.tasks.worker.model import ImageClassifier

    # The trained weights are all in the checkpoint: never fetch the pretrained ones again.
    # As data only: a checkpoint read back from shared storage is tensors and plain values, never code to unpickle.
    module = ImageClassifier.load_from_checkpoint(
        checkpoint_path, map_location="cpu", pretrained=None, weights_only=True
    )
    return module.model.eval()


def read_split(uri: str, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """All images (N, H, W, 3 uint8) and labels of one cached split."""
    fs, files = split_files(uri)
    parts = []
    for path in files:
        with fs.open(path, "rb") as handle:
            parts.append(pq.read_table(handle, columns=["image", "label"]))
    table = pa.concat_tables(parts)
    pixels = pixel_rows(table.column("image"), image_size * image_size * 3, f"cached split {uri}", split_format(uri))
    return pixels.reshape(len(pixels), image_size, image_size, 3), table.column("label").to_numpy()


def split_hashes(uri: str) -> list[str]:
    """The content hash of each row of one cached split, in the order `read_split` reads its images."""
    fs, files = split_files(uri)
    hashes: list[str] = []
    for path in files:
        with fs.open(path, "rb") as handle:
            hashes += pq.read_table(handle, columns=["sha256"]).column("sha256").to_pylist()
    return hashes


def test_rows_at(settings: Settings, cached: CachedSplits) -> TestRowsAt:
    """The test split's rows decoded again from their source files at another image size and resize mode, for a champion
    trained at those: each row's file is found by its content hash in the table version the split was cached from, read
    with the resize stage's retries, checked against that hash and decoded by the same rules. Any row that cannot be
    (a file gone or changed since) raises: the gate then keeps the champion rather than compare on other rows."""

    def decode(size: int, mode: str) -> np.ndarray:
        hashes = split_hashes(cached.splits["test"])
        table = Table.open(cached.table_uri, settings)
        found = matching(
            table,
            {"sha256": pa.array(hashes, pa.string())},
            ["sha256", "path"],
            F.col("image_size") == cached.image_size,
            cached.table_version,
        )
        path_of: dict[str, str] = {}
        for sha256, path in sorted(
            zip(found.column("sha256").to_pylist(), found.column("path").to_pylist(), strict=True), reverse=True
        ):
            path_of[sha256] = path  # the first path in order, where one content lies at several
        out = np.empty((len(hashes), size, size, 3), dtype=np.uint8)
        for row, sha256 in enumerate(hashes):
            if sha256 not in path_of:
                raise LookupError(
                    f"test row {sha256[:12]} is not in {cached.table_uri} v{cached.table_version} at "
                    f"{cached.image_size} px"
                )
            data, _ = read_with_retries(path_of[sha256], settings.read_attempts, DecodeRules.read_backoff)
            if hashlib.sha256(data).hexdigest() != sha256:
                raise ValueError(f"{path_of[sha256]} has changed since table version {cached.table_version}")
            out[row] = resize_image(data, size, mode, settings.max_image_pixels)[0]
        return out

    return decode


def confusion_figure(matrix: np.ndarray, names: list[str]) -> Figure:
    from matplotlib.figure import Figure

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


def registered_version(client: MlflowClient, name: str, run_id: str) -> str | None:
    """The version of model NAME registered from run RUN_ID, if there is one (the newest, if several)."""

    found = [v for v in client.search_model_versions(f"run_id = '{run_id}'") if v.name == name]
    return str(max(int(v.version) for v in found)) if found else None


@dataclass
class Evaluated:
    """The trained model and what it answered on the test split: the images and labels the gate compares on, the
    confusion matrix and each class's precision, recall and F1."""

    model: ImageModel
    images: np.ndarray
    labels: np.ndarray
    matrix: np.ndarray
    per_class: list[dict]


def evaluate_trained(trained: Trained, cached: CachedSplits) -> Evaluated:
    """Load the trained model from its checkpoint and answer the cached test split with it."""
    from imagelake.tasks.inference.predict import predict
    from imagelake.tasks.registry.cards import confusion_matrix, per_class_metrics

    model = load_trained_model(trained.checkpoint_path)
    images, labels = read_split(cached.splits["test"], cached.image_size)
    matrix = confusion_matrix(labels, predict(model, images), len(cached.labels))
    return Evaluated(model, images, labels, matrix, per_class_metrics(matrix, cached.labels))


def lineage_tags(
    trained: Trained, cached: CachedSplits, settings: Settings, params: dict[str, str], flow_run_id: str | None
) -> dict[str, str]:
    """The tags a registered version carries: the data, the training and the run it came from."""
    return {
        "delta_table": cached.table_uri,
        "delta_version": str(cached.table_version),
        "cache_key": cached.key,
        "split_counts": json.dumps(cached.counts, sort_keys=True),
        "training_params": json.dumps(params, sort_keys=True),
        "git_commit": git_commit(),
        "prefect_flow_run_id": flow_run_id or "",
        "mlflow_run_id": trained.mlflow_run_id,
        "pretrained_weights": trained.pretrained_weights,
        "pretrained_sha256": trained.pretrained_sha256,
        "labels": labels_tag(cached.labels),
        "image_size": str(cached.image_size),
        "resize_mode": settings.resize_mode,
        "split_settings": json.dumps(
            {
                "val_fraction": settings.val_fraction,
                "test_fraction": settings.test_fraction,
                "partitions_per_worker": settings.partitions_per_worker,
            }
        ),
    }


def register_once(
    client: MlflowClient,
    settings: Settings,
    trained: Trained,
    cached: CachedSplits,
    evaluated: Evaluated,
    tags: dict[str, str],
) -> str:
    """Log the served model in the training's MLflow run and register it with TAGS; return its version.

    A training run is registered once: a retried stage, or a second flow run that got the same training's result,
    finds the version an earlier one registered (under the registry's lock, so two at once cannot both register) and
    only sets its tags again."""
    import mlflow

    from imagelake.tasks.registry.loading import served_model
    from imagelake.tasks.registry.moves import registry_lock

    with registry_lock(settings, settings.model_name):
        version = registered_version(client, settings.model_name, trained.mlflow_run_id)
        if version is not None:
            for key, value in tags.items():
                client.set_model_version_tag(settings.model_name, version, key, value)
            return version
        with mlflow.start_run(run_id=trained.mlflow_run_id):
            # A pyfunc any MLflow client can call with image files (inference/served_pyfunc.py), around torch.export
            # program that loads without unpickling. Its requirements are given: inferring them loads the model
            # again in a new interpreter. Logged before the per-class metrics: MLflow links each of the run's
            # metrics to the model, a request each.
            with tempfile.TemporaryDirectory(prefix="imagelake-model-") as folder:
                served = served_model(
                    Path(folder),
                    evaluated.model,
                    cached.labels,
                    cached.image_size,
                    settings.resize_mode,
                    settings.max_image_pixels,
                    evaluated.images[:2],
                )
                info = mlflow.pyfunc.log_model(name="model", **served)
        # The lineage lands with the version, in one request: no version is ever seen without it.
        with library_prints():
            return str(mlflow.register_model(info.model_uri, settings.model_name, tags=tags).version)


def log_test_results(trained: Trained, cached: CachedSplits, evaluated: Evaluated, metrics: dict[str, float]) -> None:
    """The gate's test metrics, each class's, the confusion matrix as a figure and as JSON, in the training's run."""
    import mlflow

    from imagelake.tasks.registry.cards import metric_keys

    with mlflow.start_run(run_id=trained.mlflow_run_id):
        mlflow.log_figure(confusion_figure(evaluated.matrix, cached.labels), "confusion_matrix.png")
        mlflow.log_dict(
            {"labels": cached.labels, "confusion_matrix": evaluated.matrix.tolist(), "per_class": evaluated.per_class},
            "test_per_class.json",
        )
        mlflow.log_metrics(
            {
                **{f"test_{key}": value for key, value in metrics.items()},
                **{
                    f"test_{name}_{key}": row[name]
                    for row, key in zip(evaluated.per_class, metric_keys(cached.labels), strict=True)
                    for name in ("precision", "recall", "f1")
                },
            }
        )


def describe_version(
    client: MlflowClient,
    settings: Settings,
    version: str,
    trained: Trained,
    cached: CachedSplits,
    params: dict[str, str],
    metrics: dict[str, float],
    per_class: list[dict],
    decision: Decision,
) -> None:
    """Write the version's model card as its description."""
    from imagelake.tasks.registry.cards import model_card

    data = {
        "table": cached.table_uri,
        "version": cached.table_version,
        "image_size": cached.image_size,
        "counts": cached.counts,
        "labels": cached.labels,
    }
    card = model_card(
        settings.model_name,
        version,
        data,
        params,
        metrics,
        per_class,
        decision.reason,
        CHAMPION if decision.promote else CHALLENGER,
        trained.baseline_accuracy,
        started_from(trained.warm_started_from, trained.pretrained_weights, trained.pretrained_sha256),
    )
    # MLflow's SQL stores keep 5,000 characters of a description: a card of many classes is cut there.
    client.update_model_version(
        settings.model_name, version, description=card if len(card) <= 5000 else card[:4980] + "\n\n(cut)"
    )


def promote_model(
    trained: Trained, cached: CachedSplits, settings: Settings, flow_run_id: str | None
) -> tuple[Promoted, Decision, str | None, list[dict]]:
    """Evaluate the trained model on the test split, register it with its lineage, let the gate decide its alias, then
    log the test results and the model card."""
    from imagelake.tasks.registry.gate import Candidate, gate

    client = mlflow_client(settings)
    evaluated = evaluate_trained(trained, cached)
    params = client.get_run(trained.mlflow_run_id).data.params
    tags = lineage_tags(trained, cached, settings, params, flow_run_id)
    version = register_once(client, settings, trained, cached, evaluated, tags)
    candidate = Candidate(
        version,
        evaluated.images,
        evaluated.labels,
        len(cached.labels),
        names=cached.labels,
        baseline=trained.baseline_accuracy,
        rows_at=test_rows_at(settings, cached),
    )
    decision, metrics, champion_version = gate(client, settings, settings.model_name, candidate, flow_run_id)
    log_test_results(trained, cached, evaluated, metrics)
    describe_version(client, settings, version, trained, cached, params, metrics, evaluated.per_class, decision)
    promoted = Promoted(
        model_name=settings.model_name,
        model_version=version,
        alias=CHAMPION if decision.promote else CHALLENGER,
        champion_version=version if decision.promote else str(champion_version),
        test_accuracy=metrics["accuracy"],
        baseline_accuracy=trained.baseline_accuracy,
        previous_champion_accuracy=None,
        decision=decision.reason,
    )
    return promoted, decision, champion_version, evaluated.per_class


@stage(
    "promote",
    settings=stage_settings("promote"),
    retries=1,
)
def promote(trained: Trained, cached: CachedSplits, settings: Settings) -> Promoted:
    """Prefect stage: registry promotion through the quality gate, with the decision as a markdown artifact."""
    from imagelake.tasks.registry.cards import per_class_table

    promoted, decision, champion_version, per_class = promote_model(
        trained, cached, settings, str(flow_run.id) if flow_run.id else None
    )
    link = run_url(mlflow_client(settings), settings, trained.mlflow_run_id)
    markdown = decision_markdown(promoted.model_name, promoted.model_version, decision, champion_version, link)
    markdown += (
        f"\n### Per class on the test split\n\n{per_class_table(per_class)}\n\nConfusion matrix: "
        f"[confusion_matrix.png]({link}/artifacts/confusion_matrix.png)\n"
    )
    create_markdown_artifact(markdown, key="imagelake-promotion")
    return promoted
