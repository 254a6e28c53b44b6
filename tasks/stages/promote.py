"""Promote: log and register the trained model with its lineage, then the gate moves `champion` or `challenger`."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import mlflow
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from matplotlib.figure import Figure
from mlflow import MlflowClient
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from pyspark.sql import functions as F

from imagelake.infra.delta import Table
from imagelake.infra.settings import Settings
from imagelake.infra.tracking import git_commit, mlflow_client, run_url
from imagelake.tasks.data.cache_files import pixel_rows, split_files, split_format
from imagelake.tasks.data.resize_executor import DecodeRules, read_with_retries
from imagelake.tasks.data.table import matching
from imagelake.tasks.inference.predict import predict
from imagelake.tasks.registry.cards import confusion_matrix, metric_keys, model_card, per_class_metrics, per_class_table
from imagelake.tasks.registry.models import TestRowsAt, gate, registry_lock, served_model
from imagelake.tasks.results import CachedSplits, Promoted, Trained
from imagelake.tasks.rules.images import resize_image
from imagelake.tasks.rules.promotion import CHALLENGER, CHAMPION, Decision, decision_markdown
from imagelake.tasks.rules.training import started_from
from imagelake.tasks.rules.warm_start import labels_tag
from imagelake.tasks.stage import stage
from imagelake.tasks.worker.model import ImageClassifier, ImageModel


def load_trained_model(checkpoint_path: str) -> ImageModel:
    """The plain torch model from a Lightning checkpoint, in eval mode on the CPU."""
    # The trained weights are all in the checkpoint: never fetch the pretrained ones again.
    module = ImageClassifier.load_from_checkpoint(checkpoint_path, map_location="cpu", pretrained=None)
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


def promote_model(
    trained: Trained, cached: CachedSplits, settings: Settings, flow_run_id: str | None
) -> tuple[Promoted, Decision, str | None, list[dict]]:
    """Log and register the trained model with its lineage, then let the gate decide its alias."""
    client = mlflow_client(settings)
    model = load_trained_model(trained.checkpoint_path)
    images, labels = read_split(cached.splits["test"], cached.image_size)
    predicted = predict(model, images)
    matrix = confusion_matrix(labels, predicted, len(cached.labels))
    per_class = per_class_metrics(matrix, cached.labels)
    params = client.get_run(trained.mlflow_run_id).data.params
    tags = {
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
    # A training run is registered once: a retried stage, or a second flow run that got the same training's result,
    # finds the version an earlier one registered (under the registry's lock, so two at once cannot both register).
    with registry_lock(settings, settings.model_name):
        version = registered_version(client, settings.model_name, trained.mlflow_run_id)
        if version is None:
            with mlflow.start_run(run_id=trained.mlflow_run_id):
                # A pyfunc any MLflow client can call with image files (inference/served_pyfunc.py), around torch.export
                # program that loads without unpickling. Its requirements are given: inferring them loads the model
                # again in a new interpreter. Logged before the per-class metrics: MLflow links each of the run's
                # metrics to the model, a request each.
                with tempfile.TemporaryDirectory(prefix="imagelake-model-") as folder:
                    served = served_model(
                        Path(folder),
                        model,
                        cached.labels,
                        cached.image_size,
                        settings.resize_mode,
                        settings.max_image_pixels,
                        images[:2],
                    )
                    info = mlflow.pyfunc.log_model(name="model", **served)
            # The lineage lands with the version, in one request: no version is ever seen without it.
            version = str(mlflow.register_model(info.model_uri, settings.model_name, tags=tags).version)
        else:
            for key, value in tags.items():
                client.set_model_version_tag(settings.model_name, version, key, value)
    decision, metrics, champion_version = gate(
        client,
        settings,
        settings.model_name,
        version,
        images,
        labels,
        len(cached.labels),
        flow_run_id,
        baseline=trained.baseline_accuracy,
        names=cached.labels,
        rows_at=test_rows_at(settings, cached),
    )
    with mlflow.start_run(run_id=trained.mlflow_run_id):
        mlflow.log_figure(confusion_figure(matrix, cached.labels), "confusion_matrix.png")
        mlflow.log_dict(
            {"labels": cached.labels, "confusion_matrix": matrix.tolist(), "per_class": per_class},
            "test_per_class.json",
        )
        mlflow.log_metrics(
            {
                **{f"test_{key}": value for key, value in metrics.items()},
                **{
                    f"test_{name}_{key}": row[name]
                    for row, key in zip(per_class, metric_keys(cached.labels), strict=True)
                    for name in ("precision", "recall", "f1")
                },
            }
        )
    alias = CHAMPION if decision.promote else CHALLENGER
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
        alias,
        trained.baseline_accuracy,
        started_from(trained.warm_started_from, trained.pretrained_weights, trained.pretrained_sha256),
    )
    # MLflow's SQL stores keep 5,000 characters of a description: a card of many classes is cut there.
    client.update_model_version(
        settings.model_name, version, description=card if len(card) <= 5000 else card[:4980] + "\n\n(cut)"
    )
    promoted = Promoted(
        model_name=settings.model_name,
        model_version=version,
        alias=alias,
        champion_version=version if decision.promote else str(champion_version),
        test_accuracy=metrics["accuracy"],
        baseline_accuracy=trained.baseline_accuracy,
        previous_champion_accuracy=None,
        decision=decision.reason,
    )
    return promoted, decision, champion_version, per_class


@stage(
    "promote",
    settings=(
        "model_name",
        "promotion_metric",
        "promotion_margin",
        "min_margin_over_baseline",
        "allow_pickle_models",
        "tracking_uri",
        "mlflow_registry_uri",
        "history_uri",
        "resize_mode",
        "max_image_pixels",
        "read_attempts",
        "val_fraction",
        "test_fraction",
        "partitions_per_worker",
    ),
    code=(
        "imagelake.tasks.inference.predict",
        "imagelake.tasks.registry.models",
        "imagelake.tasks.inference.served_pyfunc",
        "imagelake.tasks.rules.promotion",
        "imagelake.tasks.rules.images",
        "imagelake.tasks.rules.answers",
        "imagelake.tasks.registry.cards",
        "imagelake.tasks.data.resize_executor",
        "imagelake.tasks.data.table",
        "imagelake.tasks.data.cache_files",
    ),
    retries=1,
)
def promote(trained: Trained, cached: CachedSplits, settings: Settings) -> Promoted:
    """Prefect stage: registry promotion through the quality gate, with the decision as a markdown artifact."""
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
