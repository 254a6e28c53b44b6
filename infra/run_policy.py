"""What a run started from a deployment (the UI's form, a schedule, the API) may set, derived from the declarations of
Settings' fields (runs=, cap=, why=; infra/declare.py), and the checks that refuse the rest: its overrides, the
settings file it names, its job variables.

A run may set what it ingests and how it trains, within limits that lose no data; only the worker's config file or
IMAGELAKE_* environment sets where its clusters, stores, tables and folders are, what code Spark loads and the
policies that remove data or load pickles. The worker may open single settings to runs with allow_from_runs
(IMAGELAKE_ALLOW_FROM_RUNS).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from imagelake.infra.declare import by_runs, caps
from imagelake.infra.settings import Settings, SettingsError, load_settings, read_config_file
from imagelake.infra.weights import is_weights_name

# Derived from the declarations of Settings' fields (runs=, cap=; infra/declare.py), never written out apart from them.
ALLOWED_FROM_RUNS = by_runs(Settings, "allowed")
REFUSED_FROM_RUNS = by_runs(Settings, "refused")

# What a model version recorded may never bring back into a retraining (tasks/registry/lineage.py:retrain_overrides).
UNSAFE_FROM_RUNS = tuple(sorted(REFUSED_FROM_RUNS))

# Allowed settings that a run may only make safer than the defaults, as (at least | at most, limit): each field's cap=.
RUN_LIMITS: dict[str, tuple[str, float]] = caps(Settings)


_RENAMED = {"pretrained_weights": "pretrained"}  # old names Settings still reads (Settings._renamed)
ALLOW_FROM_RUNS_VARIABLE = "IMAGELAKE_ALLOW_FROM_RUNS"  # the environment's name of the setting allow_from_runs


def _is_weights_name(value: Any) -> bool:
    """No weights, imagenet or torchvision's weights by name: what a run may give as `pretrained` (a file or URL would
    be fetched and loaded)."""
    # Exactly as Settings._none_is_none and tasks/worker/model.py read them: anything else is taken for a file.
    return value is None or (
        isinstance(value, str) and (value.strip().lower() in ("", "none") or is_weights_name(value))
    )


def _within_limit(name: str, value: Any) -> bool:
    """Whether VALUE keeps to RUN_LIMITS[NAME]; a value that is not a number (NaN included) does not."""
    side, limit = RUN_LIMITS[name]
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return number >= limit if side == "at least" else number <= limit


def refusal(name: str, value: Any) -> str | None:
    """Why a run may not set NAME to VALUE (the name, with the value and the limit for a limited one), or None."""
    setting = _RENAMED.get(name, name)
    if setting not in Settings.model_fields:
        return None  # not a setting at all: load_settings refuses it by name
    if setting not in ALLOWED_FROM_RUNS:
        return name
    if setting == "pretrained" and not _is_weights_name(value):
        return f"{name}={value!r} (a run may set none, imagenet or a torchvision weights name, not a path or URL)"
    if setting in RUN_LIMITS and not _within_limit(setting, value):
        side, limit = RUN_LIMITS[setting]
        return f"{name}={value!r} (a run may set {side} {limit})"
    return None


def refuse_unsafe(overrides: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """OVERRIDES, unless they set what ALLOWED_FROM_RUNS does not allow, or go past RUN_LIMITS or set `pretrained` to a
    path or URL, where the worker's allow_from_runs (IMAGELAKE_ALLOW_FROM_RUNS) does not open that setting to runs."""
    opened = set(load_settings().allow_from_runs)
    given = sorted((overrides or {}).items())
    reasons = {
        name: refusal(name, value)
        for name, value in given
        if name not in opened and _RENAMED.get(name, name) not in opened
    }
    refused = {name: reason for name, reason in reasons.items() if reason}
    if refused:
        raise SettingsError(
            f"{', '.join(refused.values())} cannot be set from {where}: a run may set what it ingests and "
            "how it trains, "
            "within limits that lose no data, not where the worker connects, keeps data or loads code from. "
            f"Set them in the worker's config file or IMAGELAKE_* environment, or allow them for runs with "
            f"{ALLOW_FROM_RUNS_VARIABLE}={','.join(refused)} on the worker."
        )
    return overrides


# The folder of the code a run executes, and the settings files shipped in it (infra/clusters/*.yaml): reviewed as
# code. Nothing else under the code folder is: the workspace, a landing folder or a clone's scratch may lie there.
CODE_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_SETTINGS = CODE_ROOT / "infra" / "clusters"


def refuse_unsafe_file(config_file: str | Path | None, where: str) -> None:
    """Refuse a settings file named by WHERE (a run's parameters) that sets what refuse_unsafe refuses, unless it is one
    of the settings files shipped with the code (directly in infra/clusters/, `..` and links followed) or
    the worker's allow_from_runs allows those settings."""
    if not config_file:
        return
    path = Path(config_file)
    resolved = path.resolve()  # a relative path against the working folder, `..` and links followed
    if resolved.parent == SHIPPED_SETTINGS.resolve() and resolved.suffix in (".yaml", ".yml", ".toml", ".json"):
        return
    refuse_unsafe(
        read_config_file(path),
        f"the settings file {path}, named by {where} and not one of the settings files shipped in {SHIPPED_SETTINGS}",
    )


# What a run's job variables (laid over the deployment's by the worker) may hold: the runs' heartbeat alone. The
# command, the working folder and the environment come from the worker: an IMAGELAKE_* variable would bypass the run
# policy above, PYTHONPATH or another variable would change what code runs. imagelake's pool
# (infra/clusters/process-pool.json) refuses the rest at the API; this refuses them in the run, on any other pool.
RUN_JOB_VARIABLES = {"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY"}, "name": None, "labels": None, "stream_output": None}


def refuse_job_variables(job_variables: dict[str, Any] | None, where: str) -> None:
    """Refuse job variables of a run (WHERE) that set its command, working folder or environment."""
    refused = []
    for key, value in sorted((job_variables or {}).items()):
        if key not in RUN_JOB_VARIABLES:
            refused.append(key)
        elif key == "env":
            refused += [f"env {name}" for name in sorted(value or {}) if name not in RUN_JOB_VARIABLES["env"]]
    if refused:
        raise SettingsError(
            f"the job variables of {where} set {', '.join(refused)}: a run's command, working folder and environment "
            "come from the worker. Give settings as the run's parameters (overrides), within what runs may set; "
            "set the rest in the worker's config file or environment"
        )
