"""The model registry (MLflow adapter): safe loading, the quality gate, alias moves under a lock with their history,
lineage."""

from __future__ import annotations

import getpass
import importlib.util
import io
import json
import logging
import shutil
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import mlflow
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

import imagelake.tasks.rules.answers as answer_rules
import imagelake.tasks.rules.images as image_rules
from imagelake.infra.compat import program_refusal
from imagelake.infra.delta import Table
from imagelake.infra.lease import LeaseLost
from imagelake.infra.prefect_env import fence, one_at_a_time
from imagelake.infra.run_policy import UNSAFE_FROM_RUNS
from imagelake.infra.settings import Settings
from imagelake.infra.spark import on_demand
from imagelake.tasks.registry.aliases import RegistryError, alias_version
from imagelake.tasks.rules.promotion import CHALLENGER, CHAMPION, PREVIOUS, Decision, decide_promotion, held_by_baseline
from imagelake.tasks.rules.schemas import HISTORY_SCHEMA
from imagelake.tasks.rules.training import recorded_settings
from imagelake.tasks.rules.warm_start import Champion, labels_change, labels_of_tag, shape_from_tags

if TYPE_CHECKING:  # torch, pandas and the served model load in the functions that use them: a registry command
    # (history, lineage, promote, rollback) needs none of them
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
    """imagelake's served model (tasks/inference/served_pyfunc.py), imported quietly: MLflow warns, as the class is
    defined, that `predict` takes untyped input (the logged signature checks it instead), under a filter of its own."""
    with warnings.catch_warnings(record=True):
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


class ChampionUnreachable(RuntimeError):
    """The champion could not be read for a reason that may pass (a store timing out, a server busy): nothing is decided
    and no alias moves; the promote stage retries."""


def is_gone(exc: BaseException) -> bool:
    """Whether an error says a version or its files do not exist (as opposed to a store that did not answer)."""
    return isinstance(exc, (RegistryError, FileNotFoundError)) or (
        isinstance(exc, MlflowException) and exc.error_code == "RESOURCE_DOES_NOT_EXIST"
    )


class ChampionCheck(NamedTuple):
    """What evaluating the champion found: its value of the gate's metric, or why it is proven unusable (then it may be
    replaced uncompared), or why it could not be compared now (then it stays: the gate fails closed)."""

    value: float | None
    unusable: str | None = None
    uncompared: str | None = None


# The candidate's test rows decoded again from their source files at another (image size, resize mode).
TestRowsAt = Callable[[int, str], np.ndarray]


def out_of_memory(exc: BaseException) -> bool:
    """Whether an error is the host's or an accelerator's memory running out (torch raises RuntimeError subclasses)."""
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


def champion_metric(
    client: MlflowClient,
    settings: Settings,
    name: str,
    version: str,
    images: np.ndarray,
    labels: np.ndarray,
    classes: int,
    names: list[str] | None = None,
    rows_at: TestRowsAt | None = None,
) -> ChampionCheck:
    """The champion's value of the gate's metric on the candidate's test rows, decoded at the champion's own image size
    and resize mode. Proven unusable (may be replaced): its version or files are gone, its files are not a model, or it
    is a model for other labels. Anything else that stops the comparison (running out of memory, rows that cannot be
    decoded at its size, a model that refuses the input) keeps the champion. A store that does not answer now raises
    ChampionUnreachable (the stage retries)."""
    where = f"v{version}"
    try:
        folder = model_files(client, name, version)
        tags = client.get_model_version(name, version).tags
    except Exception as exc:
        if is_gone(exc):
            return ChampionCheck(None, unusable=f"{where}: {type(exc).__name__}: {exc}"[:300])
        raise ChampionUnreachable(
            f"the champion {name} v{version} could not be fetched ({type(exc).__name__}: {str(exc)[:300]}); "
            "nothing was promoted "
            "and no alias moved. The stage retries; if the model store stays unreachable, run again once it answers."
        ) from exc
    try:  # the files are here: a failure to load them is the files', and happens again every time
        model = load_model_folder(folder, name, version, settings.allow_pickle_models)
        theirs = model_labels(folder, tags)
    except Exception as exc:  # noqa: BLE001 - sorted below: only a file that is no model is proven unusable
        if isinstance(exc, UnsafeModel) or out_of_memory(exc):
            return ChampionCheck(
                None, uncompared=f"{where} could not be loaded here: {type(exc).__name__}: {exc}"[:400]
            )
        return ChampionCheck(None, unusable=f"{where}: {type(exc).__name__}: {exc}"[:300])
    if names is not None and theirs and list(theirs) != list(names):
        return ChampionCheck(
            None, unusable=f"{where} is a model for other labels ({labels_change(tuple(theirs), tuple(names))})"
        )
    inputs, shape = images, shape_from_tags(tags)
    if (
        shape is not None
        and images.ndim == 4
        and (shape.image_size, shape.resize_mode) != (images.shape[1], settings.resize_mode)
    ):
        own = f"{shape.image_size} px ({shape.resize_mode})"
        if rows_at is None:
            return ChampionCheck(
                None, uncompared=f"{where} takes {own} images and the test rows are not at hand at that size"
            )
        try:
            inputs = rows_at(shape.image_size, shape.resize_mode)
        except Exception as exc:  # noqa: BLE001 - a file gone or changed since: no fair comparison, the champion stays
            return ChampionCheck(
                None,
                uncompared=(
                    f"{where} takes {own} images; the test rows could not be decoded at that size: "
                    f"{type(exc).__name__}: {exc}"
                )[:400],
            )
    try:
        return ChampionCheck(evaluate(model, inputs, labels, classes)[settings.promotion_metric])
    except Exception as exc:  # noqa: BLE001 - the champion loaded and is for these labels: whatever failed now is no proof against it
        return ChampionCheck(
            None, uncompared=f"{where} could not be evaluated on the test split: {type(exc).__name__}: {exc}"[:400]
        )


def champion_of(client: MlflowClient, name: str) -> Champion | None:
    """The champion of model NAME with the shape it was trained for, or None if there is none (or no such model yet)."""
    try:
        version = alias_version(client, name, CHAMPION)
    except RegistryError:  # nothing registered under this name yet: no champion either
        return None
    if version is None:
        return None
    return Champion(version, shape_from_tags(client.get_model_version(name, version).tags))


def champion_state_dict(
    client: MlflowClient, name: str, version: str, allow_pickle: bool = False
) -> dict[str, torch.Tensor]:
    """A registered version's weights, named as ImageModel names them (torch.export keeps the module's names)."""
    model = load_registered_model(client, name, version, allow_pickle)
    return {key: tensor.detach().clone() for key, tensor in model.state_dict().items()}


@contextmanager
def registry_lock(settings: Settings, name: str) -> Iterator[None]:
    """Serialise alias moves of one model, on this machine and across hosts (infra/prefect_env.py: one_at_a_time):
    a compare-and-set needs the champion not to move under it."""
    with one_at_a_time(settings, lock_of(name)):
        yield


def lock_of(name: str) -> str:
    """What the registry lock of model NAME locks: alias moves and history rows are fenced by it
    (infra/prefect_env.py:fence)."""
    return f"registry-{name}"


def record(settings: Settings, rows: list[dict]) -> None:
    """Append alias moves to the history table (a Delta table beside the images table)."""
    if rows:
        now = datetime.now(UTC)
        full = [{"who": who(settings), "at": now, "flow_run_id": None, "move_id": None, **row} for row in rows]
        table = Table(settings.history_uri)
        if table.exists():
            table.add_columns(HISTORY_SCHEMA)  # a history from before move_id gets it first
        table.append(pa.Table.from_pylist(full, schema=HISTORY_SCHEMA))


def recorded(settings: Settings, move_id: str) -> bool:
    """Whether the history table holds the rows of the alias move MOVE_ID."""
    table = Table(settings.history_uri)
    version = table.version()
    if version is None or "move_id" not in table.columns():
        return False
    rows = table.read_files_arrow(table.files(version), pa.schema([("move_id", pa.string())]))
    if rows is None:
        raise RuntimeError(f"the history table {settings.history_uri} v{version} could not be read here; run again")
    return move_id in set(rows.column("move_id").to_pylist())


def who(settings: Settings) -> str:
    """Who an alias move is recorded as: the `user` setting (IMAGELAKE_USER), else the login name."""
    try:
        return settings.user or getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def history(settings: Settings, name: str) -> list[dict]:
    """Every recorded alias move of a model, oldest first. The table is small and appended to by delta-rs: this
    process's pyarrow reads it, Spark (started then) only where pyarrow cannot open a file of it, so that
    `imagelake history` answers without a JVM."""
    rows = Table(settings.history_uri, on_demand(settings)).read_small(HISTORY_SCHEMA)
    return sorted(rows.filter(pc.equal(rows["model"], name)).to_pylist(), key=lambda row: row["at"])


class MovedMeanwhile(LeaseLost):
    """An alias this move was to set was moved by another run after the move was decided (a holder paused past its
    lease): the move is given up, nothing more changed."""


# A registered model's tag that holds an alias move begun and not yet finished: the next move under the lock finishes
# it.
PENDING_MOVE = "imagelake.pending_move"


def move_aliases(
    client: MlflowClient,
    settings: Settings,
    name: str,
    targets: dict[str, str],
    action: str,
    reasons: dict[str, str],
    flow_run_id: str | None = None,
    drop: str | None = None,
) -> None:
    """Point each alias of TARGETS at its version, drop the alias DROP where it points at a version being moved, and
    record a history row for each alias that moves, all or nothing: the move is written down first (a tag on the
    registered model), then carried out, then crossed off. A crash in between leaves the tag, and the next move
    (or `finish_pending_move`) carries it out before it decides anything. Caller holds the registry lock."""
    move_id = uuid.uuid4().hex
    rows = []
    for alias, version in targets.items():
        before = alias_version(client, name, alias)
        if before != str(version):
            rows.append(
                {
                    "model": name,
                    "alias": alias,
                    "from_version": before,
                    "to_version": str(version),
                    "action": action,
                    "reason": reasons[alias][:1000],
                    "flow_run_id": flow_run_id,
                    "move_id": move_id,
                }
            )
    move = {
        "id": move_id,
        "targets": {alias: str(version) for alias, version in targets.items()},
        # Where each alias pointed when the move was decided: checked again as each alias is set.
        "before": {alias: alias_version(client, name, alias) for alias in targets},
        "drop": drop,
        "rows": rows,
    }
    fence(lock_of(name))  # the lock's lease lapsed: another holder may be deciding; write nothing down
    client.set_registered_model_tag(name, PENDING_MOVE, json.dumps(move))
    carry_out(client, settings, name, move)


def carry_out(client: MlflowClient, settings: Settings, name: str, move: dict) -> None:
    """Carry out a written-down alias move; each step may be done again (the aliases are set, not toggled; the rows are
    appended only if the history lacks them), so a move cut short is finished by doing it again."""
    for alias, version in move["targets"].items():
        fence(lock_of(name))  # before each step: a move cut short here is finished by the next holder
        # At write time, the alias itself: a holder paused past its lease finds another holder's move here.
        now = alias_version(client, name, alias)
        if "before" in move and now not in (move["before"].get(alias), version):
            raise MovedMeanwhile(
                f"{name}@{alias} points at v{now} now, moved by another run after this move (to v{version}, from "
                f"v{move['before'].get(alias)}) was decided: this move is given up and nothing more is changed. "
                "Run again to decide anew."
            )
        client.set_registered_model_alias(name, alias, version)
    if move.get("drop") and alias_version(client, name, move["drop"]) in set(move["targets"].values()):
        fence(lock_of(name))
        client.delete_registered_model_alias(name, move["drop"])
    if move["rows"] and not recorded(settings, move["id"]):
        fence(lock_of(name))
        record(settings, move["rows"])
    client.delete_registered_model_tag(name, PENDING_MOVE)


def finish_pending_move(client: MlflowClient, settings: Settings, name: str) -> bool:
    """Carry out an alias move that a crash cut short, if there is one; whether there was. Caller holds the registry
    lock."""
    try:
        pending = client.get_registered_model(name).tags.get(PENDING_MOVE)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    if pending:
        try:
            carry_out(client, settings, name, json.loads(pending))
        except MovedMeanwhile as stale:  # overtaken by a later move: the written-down one is not carried out
            logging.getLogger(__name__).warning(f"a pending alias move of {name} is dropped: {stale}")
            client.delete_registered_model_tag(name, PENDING_MOVE)
    return bool(pending)


def crown(
    client: MlflowClient,
    settings: Settings,
    name: str,
    version: str,
    action: str,
    reason: str,
    flow_run_id: str | None = None,
) -> None:
    """Make `version` the champion; the one it replaces becomes previous-champion. Caller holds the registry lock."""
    old = alias_version(client, name, CHAMPION)
    targets, reasons = {CHAMPION: str(version)}, {CHAMPION: reason}
    if old is not None and old != str(version):
        targets[PREVIOUS], reasons[PREVIOUS] = old, f"replaced by v{version}"
    move_aliases(client, settings, name, targets, action, reasons, flow_run_id, drop=CHALLENGER)


def gate(
    client: MlflowClient,
    settings: Settings,
    name: str,
    version: str,
    images: np.ndarray,
    labels: np.ndarray,
    classes: int,
    flow_run_id: str | None = None,
    baseline: float | None = None,
    names: list[str] | None = None,
    rows_at: TestRowsAt | None = None,
) -> tuple[Decision, dict[str, float], str | None]:
    """Evaluate candidate and champion on the same split, decide, tag the candidate and move aliases, all under the
    lock.

    The champion is read inside the lock, just before the aliases move (compare-and-set): two
    promotions finishing together are decided one after the other, each against the champion
    the other left, so the worse model can never end up champion. The champion is evaluated at its
    own image size (ROWS_AT decodes the test rows again at it). Only a champion proven unusable (gone,
    not a model, or one for other labels: NAMES) is replaced without a comparison; one that cannot be
    compared stays champion, the candidate becomes challenger; one that cannot be fetched now stops the gate.
    """
    candidate = evaluate(
        load_registered_model(client, name, version, settings.allow_pickle_models), images, labels, classes
    )
    metric = settings.promotion_metric
    with registry_lock(settings, name):
        finish_pending_move(client, settings, name)
        champion_version = alias_version(client, name, CHAMPION)
        if champion_version == str(version):  # a second flow run that got the same training's result: nothing to decide
            reason = f"v{version} is the champion already (its gate ran in an earlier flow run)"
            return (
                Decision(True, reason, metric, candidate[metric], candidate[metric], settings.promotion_margin),
                candidate,
                champion_version,
            )
        check = ChampionCheck(None)
        if champion_version is not None:
            check = champion_metric(client, settings, name, champion_version, images, labels, classes, names, rows_at)
        held = held_by_baseline(metric, candidate, baseline, settings.min_margin_over_baseline)
        decision = held or decide_promotion(
            metric, candidate[metric], check.value, settings.promotion_margin, check.unusable, check.uncompared
        )
        champion_value = check.value
        tags = {
            "promotion_decision": "promoted" if decision.promote else "not promoted",
            "promotion_reason": decision.reason,
            "promotion_metric": metric,
            "promotion_margin": str(settings.promotion_margin),
            f"candidate_{metric}": f"{decision.candidate:.6f}",
            f"champion_{metric}": "" if champion_value is None else f"{champion_value:.6f}",
            "compared_with_version": champion_version or "",
            "baseline_accuracy": "" if baseline is None else f"{baseline:.6f}",
            **{f"test_{key}": f"{value:.6f}" for key, value in candidate.items()},
        }
        for key, value in tags.items():
            client.set_model_version_tag(name, str(version), key, value)
        if decision.promote:
            crown(client, settings, name, version, "gate", decision.reason, flow_run_id)
        else:
            move_aliases(
                client, settings, name, {CHALLENGER: str(version)}, "gate", {CHALLENGER: decision.reason}, flow_run_id
            )
    return decision, candidate, champion_version


def rollback(client: MlflowClient, settings: Settings, name: str, reason: str) -> tuple[str, str]:
    """Move `champion` back to `previous-champion`; return (from, to)."""
    with registry_lock(settings, name):
        finish_pending_move(client, settings, name)
        current = alias_version(client, name, CHAMPION)
        previous = alias_version(client, name, PREVIOUS)
        if previous is None:
            raise RegistryError(f"model {name!r} has no {PREVIOUS!r} alias: there is nothing to roll back to")
        targets = {CHAMPION: previous, **({PREVIOUS: current} if current is not None else {})}
        move_aliases(client, settings, name, targets, "rollback", {CHAMPION: reason, PREVIOUS: reason})
    return current or "", previous


def force_promote(client: MlflowClient, settings: Settings, name: str, version: str, reason: str) -> None:
    """An operator's promotion of a chosen version, recorded with its reason."""
    if not reason.strip():
        raise RegistryError("a forced promotion needs a --reason")
    model_files(client, name, version)  # fails clearly for an unknown model or version
    with registry_lock(settings, name):
        finish_pending_move(client, settings, name)
        crown(client, settings, name, str(version), "manual", reason)


LINEAGE_KEYS = (
    "delta_table",
    "delta_version",
    "cache_key",
    "split_counts",
    "split_settings",
    "training_params",
    "git_commit",
    "prefect_flow_run_id",
    "mlflow_run_id",
    "pretrained_weights",
    "pretrained_sha256",
    "labels",
    "image_size",
    "resize_mode",
)


def lineage(client: MlflowClient, name: str, version: str) -> dict[str, str]:
    """What a version was trained on and with, from its tags."""
    try:
        found = client.get_model_version(name, str(version))
    except MlflowException as exc:
        raise RegistryError(f"model {name!r} has no version {version!r}") from exc
    tags = dict(found.tags)
    out = {key: tags.get(key, "") for key in LINEAGE_KEYS}
    out["aliases"] = ",".join(found.aliases or [])
    return out


def _value(text: str):
    if text in ("None", ""):
        return None
    if text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def retrain_overrides(found: dict[str, str]) -> dict:
    """Settings that retrain a version on the same split of the same data with the same training settings."""
    if not found.get("delta_version"):
        raise RegistryError("this version has no delta_version tag: it was not registered by imagelake's pipeline")
    params = json.loads(found.get("training_params") or "{}")
    # split_settings: where a version registered by an earlier imagelake logged no split settings as params
    overrides = {**json.loads(found.get("split_settings") or "{}")}
    overrides.update({name: _value(text) for name, text in recorded_settings(params).items()})
    # What a model version recorded never turns on a setting that can run code or load pickles.
    return {name: value for name, value in overrides.items() if name not in UNSAFE_FROM_RUNS}


def resolve(client: MlflowClient, reference: str) -> tuple[str, str]:
    """NAME@ALIAS or NAME/VERSION to (name, version)."""
    if "@" in reference:
        name, alias = reference.rsplit("@", 1)
        version = alias_version(client, name, alias)
        if version is None:
            raise RegistryError(
                f"model {name!r} has no alias {alias!r} (aliases: champion, challenger, previous-champion)"
            )
        return name, version
    if "/" in reference:
        name, version = reference.rsplit("/", 1)
        return name, version
    raise RegistryError(f"--model {reference!r}: write NAME@ALIAS (e.g. {reference}@champion) or NAME/VERSION")
