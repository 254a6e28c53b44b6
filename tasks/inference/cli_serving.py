"""Serving: label image files with a registered model (NAME@ALIAS or NAME/VERSION)."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow import MlflowClient

from imagelake.infra.settings import Settings
from imagelake.tasks.inference.predict import label_files
from imagelake.tasks.registry.lineage import resolve
from imagelake.tasks.registry.loading import load_model_folder, model_files, model_labels, served_files


def predict_files(client: MlflowClient, settings: Settings, reference: str, source: Path) -> list[dict]:
    """Label and probability for every image under `source`, decoded and resized as the model's training data was."""
    name, version = resolve(client, reference)
    folder = model_files(client, name, version)
    model = load_model_folder(folder, name, version, settings.allow_pickle_models)
    tags = client.get_model_version(name, version).tags
    labels = model_labels(folder, tags)
    # The sizes the version's own files say (the served model's JSON), else its tags (a version registered before).
    served = served_files(folder)
    meta = json.loads(served[1].read_text(encoding="utf-8")) if served and served[1].is_file() else tags
    size = int(meta.get("image_size") or settings.image_size)
    mode = meta.get("resize_mode") or settings.resize_mode
    return label_files(model, labels, source, size, mode, settings.image_extensions, settings.max_image_pixels)
