"""Registered models as files and modules: a version's folder, loading it without unpickling (a torch.export program
as data), the served pyfunc's files a version is logged with, and imagelake's own served model over them."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
import numpy as np
import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

import imagelake.tasks.rules.answers as answer_rules
import imagelake.tasks.rules.images as image_rules
from imagelake.infra.compat import program_refusal
from imagelake.tasks.registry.aliases import RegistryError
from imagelake.tasks.rules.warm_start import labels_of_tag

if TYPE_CHECKING:  # torch and the served model load in the functions that use them
    import torch

    from imagelake.tasks.inference import served_pyfunc


# The pyfunc MLflow runs (a model "from code"), found here only for its file, which MLflow saves with each version and
# runs in its own module; imported where it answers (own_served_model), it is in the code key of every stage that
# registers or scores.
SERVED_MODEL = Path(importlib.util.find_spec("imagelake.tasks.inference.served_pyfunc").origin)


SERVED_RULES = (
    "imagelake_served"  # the package of decoding and answer rules saved with it (served_pyfunc.py imports it)
)


PROGRAM_FILE, META_FILE = "model.pt2", "meta.json"


# The served model's artifact keys, served_pyfunc.PROGRAM and META (tests/test_layers.py pins them equal): the served
# file is not imported for them.
PROGRAM, META = "program", "meta"


def served_pyfunc_module():
    """imagelake's served model (tasks/inference/served_pyfunc.py), imported when a version is answered here."""
    from imagelake.tasks.inference import served_pyfunc

    return served_pyfunc


_EXPORT_LOAD = threading.Lock()


class UnsafeModel(RegistryError):
    """A model stored in a format that loads by unpickling, refused unless explicitly allowed."""


def model_files(client: MlflowClient, name: str, version: str) -> Path:
    """A registered version's model folder, downloaded (or found) locally."""
    try:
        source = client.get_model_version_download_uri(name, str(version))
    except MlflowException as exc:
        raise RegistryError(
            f"model {name!r} has no version {version!r}: see `imagelake lineage` or the MLflow UI for its versions"
        ) from exc
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=source))


def evaluate(model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, classes: int) -> dict[str, float]:
    """The gate's metrics of MODEL on a split (tasks/inference/predict.py, which loads torch: imported when called)."""
    from imagelake.tasks.inference import predict

    return predict.evaluate(model, images, labels, classes)


def load_registered_model(client: MlflowClient, name: str, version: str, allow_pickle: bool = False) -> torch.nn.Module:
    """Load a registered version without unpickling: only torch.export (pt2) programs load unless `allow_pickle`."""
    return load_model_folder(model_files(client, name, version), name, version, allow_pickle)


def served_model(
    folder: Path,
    model: torch.nn.Module,
    labels: list[str],
    image_size: int,
    resize_mode: str,
    max_pixels: int | None,
    examples: np.ndarray,
) -> dict:
    """The arguments of `mlflow.pyfunc.log_model` (or `save_model`) for `model` as a self-contained pyfunc: the
    torch.export program and a JSON file of its labels and sizes (written under `folder`), served_pyfunc.py as
    the code MLflow runs, and the decoding rules it imports. `examples`: two or more (N, size, size, 3) uint8 images,
    to trace the program with a batch dimension of any size and to make the logged input example."""
    import pandas as pd
    import PIL
    import torch
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, Object, ParamSchema, ParamSpec, Property, Schema
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim.AUTO
    exported = torch.export.export(
        model.eval(), (torch.from_numpy(np.ascontiguousarray(examples)),), dynamic_shapes=({0: batch},)
    )
    torch.export.save(exported, str(folder / PROGRAM_FILE))
    meta = {
        "labels": list(labels),
        "image_size": image_size,
        "resize_mode": resize_mode,
        "max_image_pixels": max_pixels,
    }
    (folder / META_FILE).write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
    # The rules travel as a package of their own, which the served code imports. Not as tasks/rules: MLflow puts the
    # model's code first on the path of any process that loads it, and a `tasks` package there would hide imagelake's
    # own from that process and from the processes it starts (a loader process failed to import tasks.rules.listing).
    code = folder / "code" / SERVED_RULES
    code.mkdir(parents=True, exist_ok=True)
    (code / "__init__.py").write_text("")
    for rules in (image_rules, answer_rules):
        shutil.copyfile(rules.__file__, code / Path(rules.__file__).name)
    png = io.BytesIO()
    Image.fromarray(examples[0]).save(png, format="PNG")
    top = Array(Object([Property("label", "string"), Property("probability", "double")]))
    signature = ModelSignature(
        inputs=Schema([ColSpec("binary", "image")]),
        outputs=Schema(
            [
                ColSpec("string", "label", required=False),
                ColSpec("double", "probability", required=False),
                ColSpec(top, "top_k"),
                ColSpec("string", "error", required=False),
            ]
        ),
        params=ParamSchema([ParamSpec("top_k", "long", 3)]),
    )
    requirements = [
        f"mlflow=={mlflow.__version__}",
        f"torch=={torch.__version__.split('+')[0]}",
        f"numpy=={np.__version__}",
        f"pandas=={pd.__version__}",
        f"pillow=={PIL.__version__}",
    ]
    return {
        "python_model": str(SERVED_MODEL),
        "artifacts": {PROGRAM: str(folder / PROGRAM_FILE), META: str(folder / META_FILE)},
        "code_paths": [str(code)],
        "signature": signature,
        "input_example": pd.DataFrame({"image": [png.getvalue()]}),
        "pip_requirements": requirements,
    }


def load_model_folder(folder: Path, name: str, version: str, allow_pickle: bool = False) -> torch.nn.Module:
    """A downloaded model folder as a module. The MLmodel file is read as YAML, nothing of the model is imported or
    unpickled before the format is known to be safe: the served pyfunc's program and an older pytorch-flavour pt2 load
    as torch.export programs, without running the model's code."""
    import torch

    meta = yaml.safe_load((folder / "MLmodel").read_text())
    flavor = (meta.get("flavors") or {}).get("pytorch")
    served = served_files(folder, meta)
    exported = served[0] if served else folder / (flavor or {}).get("model_data", "data") / PROGRAM_FILE
    if (served or flavor) and exported.is_file():
        check_program(exported, name, version)
        with _EXPORT_LOAD:  # torch.export.load keeps global state while it reads: one at a time per process
            return torch.export.load(str(exported)).module()
    if not allow_pickle:
        raise UnsafeModel(
            f"{name} v{version} is not a torch.export (pt2) model (flavors: "
            f"{', '.join(meta.get('flavors') or {}) or 'none'}): "
            "loading it would unpickle code. Re-register it in pt2 format, or set allow_pickle_models=true "
            "if you trust its source."
        )
    return mlflow.pytorch.load_model(str(folder)) if flavor else mlflow.pyfunc.load_model(str(folder))


def check_program(path: Path, name: str, version: str) -> None:
    """Refuse a torch.export program that is not data alone (torch.export.load would unpickle part of it: a weight
    stored pickled, a custom object), whatever allow_pickle_models says."""
    refused = program_refusal(path)
    if refused is not None and refused.startswith("not "):  # no archive at all: no model, nothing unsafe to run
        raise RegistryError(f"{name} v{version}'s program is {refused}: it is no model")
    if refused is not None:
        raise UnsafeModel(
            f"{name} v{version}'s program is not data alone: {refused}. Re-register it from a model saved by "
            "torch.export.save with plain tensors"
        )


def served_files(folder: Path, meta: dict | None = None) -> tuple[Path, Path] | None:
    """The program and the JSON of labels and sizes of a model saved by `served_model`, or None for another format."""
    meta = meta or yaml.safe_load((folder / "MLmodel").read_text())
    artifacts = ((meta.get("flavors") or {}).get("python_function") or {}).get("artifacts") or {}
    if PROGRAM not in artifacts or META not in artifacts:
        return None
    return folder / artifacts[PROGRAM]["path"], folder / artifacts[META]["path"]


def own_served_model(folder: Path, name: str, version: str) -> served_pyfunc.ImageClassifierModel:
    """A version's program and labels answered by imagelake's own served model (this installation's served_pyfunc.py),
    never by the code the version carries: the program is loaded as data (`load_model_folder`), and a version that is
    not imagelake's served model is refused."""
    served = served_files(folder)
    if served is None or not all(path.is_file() for path in served):
        raise UnsafeModel(
            f"{name} v{version} is not a model imagelake registered (no program and labels of its served model): "
            "scoring runs only imagelake's own served model, never the code a version carries. Register the model "
            "with imagelake (`imagelake run` or `imagelake retrain`)"
        )
    meta = json.loads(served[1].read_text(encoding="utf-8"))
    return served_pyfunc_module().ImageClassifierModel().use(meta, load_model_folder(folder, name, version))


def model_labels(folder: Path, tags: dict[str, str]) -> list[str]:
    """A registered version's label names: from the model's own JSON, or (a version registered before the model
    carried them) from its labels tag."""
    served = served_files(folder)
    if served and served[1].is_file():
        return json.loads(served[1].read_text(encoding="utf-8"))["labels"]
    return labels_of_tag(tags.get("labels", ""))


def champion_state_dict(
    client: MlflowClient, name: str, version: str, allow_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """A registered version's weights, named as ImageModel names them (torch.export keeps the module's names)."""
    model = load_registered_model(client, name, version, allow_pickle)
    return {key: tensor.detach().clone() for key, tensor in model.state_dict().items()}
