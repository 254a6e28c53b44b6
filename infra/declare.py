"""How a setting is declared: once, in its field of Settings, next to its type, default, bounds and description.

Besides what pydantic's Field holds, a declaration says the section the setting belongs to, whether a run started
from a deployment may set the setting (and within what cap, and why not), and which stages' keys it enters. What used
to be written out by hand apart from them is derived from the declarations: the run policy (infra/run_policy.py:
ALLOWED_FROM_RUNS, REFUSED_FROM_RUNS, RUN_LIMITS), each stage's settings (infra/settings.py:stage_settings) and
docs/settings.md, grouped by section. Pure: pydantic only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

from pydantic import BaseModel, Field

Runs = Literal["allowed", "refused"]
Section = Literal["lake", "ingest", "spark", "cache and loader", "training", "registry", "serving", "servers", "limits"]

# Each section in the order docs/settings.md gives them, with the words that open it there.
SECTIONS: dict[str, str] = {
    "lake": "Where the worker keeps its data: the workspace, the Delta tables, stage results and staging files.",
    "ingest": "What a run ingests (which files, which dates), how it resizes them, and what it does with bad input.",
    "spark": "The worker's Spark and the Delta engine it writes with.",
    "cache and loader": "How the table is split, cached for Petastorm and read back into batches.",
    "training": "Ray Train's workers, the model and how it learns.",
    "registry": "The MLflow experiment and registered model, and the gate that promotes a version.",
    "serving": "Batch scoring into the predictions table.",
    "servers": "Where the worker connects: Ray, MLflow and Prefect servers, and the address runs link to.",
    "limits": (
        "Time limits and what runs may open: a hung mount or a stuck Spark or Ray job fails its run (TimedOut, its "
        "Spark and Ray released) instead of holding up every queued run behind it. Each limit is generous for its "
        "stage; none is in a stage key; none: no limit. A run may shorten its own (a failed run is its own loss); "
        "flow_timeout_hours caps the rest."
    ),
}

# Why runs may not set a setting, for the reasons many settings share (a declaration's why=).
WHERE_DATA_LIVES = "where the worker keeps data: a run pointed elsewhere would write, retire and vacuum someone else's"
WHERE_IT_CONNECTS = (
    "where the worker connects: a run pointed elsewhere would send the worker's credentials to another host and "
    "unpickle Ray Client's or Prefect's results from it"
)
WORKERS_SPARK = "the worker's Spark: how it runs and what code it loads"
WHOSE_MODEL = "where the worker's runs and registered model are: a run would train into, or promote, someone else's"
DECODER_GUARD = "one of the decoder's guards against huge files and decompression bombs"
Side = Literal["at most", "at least"]
F = TypeVar("F", bound=Callable[..., Any])

_STAGES = "__stage_keys__"  # the attribute in_keys_of sets on a derived property's getter


@dataclass(frozen=True)
class Declared:
    """A setting's declaration besides pydantic's: its section, the stages whose key it enters (() when none), whether
    a run from a deployment may set it, the side of a limit a run's value must keep to (None: any value), and why
    runs may not set it or go past that limit."""

    section: Section
    stages: tuple[str, ...]
    runs: Runs
    cap: tuple[Side, float] | None = None
    why: str = ""
    where: bool = False


def setting(
    *,
    section: Section,
    stages: tuple[str, ...],
    runs: Runs,
    cap: tuple[Side, float] | None = None,
    why: str = "",
    where: bool = False,
    **field: Any,
) -> Any:
    """A field of Settings: pydantic's Field(**field) (default, bounds, description...) with its declaration.

    section: the part of the pipeline it configures (SECTIONS): docs/settings.md groups the settings by it.
    stages: the stages whose output the setting changes: its value enters their keys, so a run with another value
    computes them anew. `stages=()` says that it changes no stage's output (a place, a time limit, logging, how
    fast): write it deliberately, there is no default.
    runs: "allowed" where a run started from a deployment (the UI's form, a schedule, the API) may set it; "refused"
    where only the worker's config file or IMAGELAKE_* environment may (infra/run_policy.py:refuse_unsafe).
    cap: for an allowed setting, ("at most" | "at least", limit): a run may only set values on the safe side of it.
    why: what a run could do with the setting: required for a refused or capped one (docs/settings.md gives it).
    where: True for a setting in a stage's key that says only where its output lives (an experiment, a store), never
    what it is: a model's record leaves it out of the settings that reproduce it (`reproducing`).

    The declaration rides in the field's metadata, which pydantic leaves out of validation and of JSON schemas: the
    Prefect form shows the field as pydantic's Field alone would.
    """
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {list(SECTIONS)}: got {section!r}")
    if not isinstance(stages, tuple) or not all(isinstance(stage, str) and stage for stage in stages):
        raise TypeError(f"stages must be a tuple of stage names, or () for none: got {stages!r}")
    if runs not in get_args(Runs):
        raise ValueError(f"runs must be 'allowed' or 'refused': got {runs!r}")
    if cap is not None:
        if runs != "allowed":
            raise ValueError(f"cap={cap!r} on a setting runs may not set: a cap is for runs='allowed'")
        if len(cap) != 2 or cap[0] not in get_args(Side) or not isinstance(cap[1], int | float):
            raise ValueError(f"cap must be ('at most' | 'at least', number): got {cap!r}")
    if (runs == "refused" or cap is not None) and not why:
        raise ValueError("a refused or capped setting says why= (what a run could do with it)")
    info = Field(**field)
    # First: pydantic's own bounds (Ge, Le...) stay at the end, where readers of field.metadata look for them.
    info.metadata.insert(0, Declared(section=section, stages=stages, runs=runs, cap=cap, why=why, where=where))
    return info


def in_keys_of(*stages: str) -> Callable[[F], F]:
    """Declare the stages whose keys a derived property of Settings (a location made of fields) enters; written
    between @property and the getter."""
    if not stages:
        raise TypeError("in_keys_of needs at least one stage: a property in no key needs no declaration")

    def mark(getter: F) -> F:
        setattr(getter, _STAGES, stages)
        return getter

    return mark


def declaration(model: type[BaseModel], name: str) -> Declared | None:
    """The declaration of MODEL's field NAME, or None (no field of that name, or one declared without setting())."""
    field = model.model_fields.get(name)
    if field is None:
        return None
    return next((item for item in field.metadata if isinstance(item, Declared)), None)


def undeclared(model: type[BaseModel]) -> list[str]:
    """MODEL's fields declared without setting(): no run policy, no stages."""
    return [name for name in model.model_fields if declaration(model, name) is None]


def sections(model: type[BaseModel]) -> dict[str, list[str]]:
    """MODEL's fields by section, sections in SECTIONS' order and fields in MODEL's, empty sections left out."""
    found = {name: declaration(model, name) for name in model.model_fields}
    grouped = {
        section: [name for name, item in found.items() if item and item.section == section] for section in SECTIONS
    }
    return {section: names for section, names in grouped.items() if names}


def by_runs(model: type[BaseModel], runs: Runs) -> frozenset[str]:
    """The fields of MODEL declared with this run policy."""
    return frozenset(name for name in model.model_fields if (found := declaration(model, name)) and found.runs == runs)


def caps(model: type[BaseModel]) -> dict[str, tuple[str, float]]:
    """The caps of MODEL's fields that declare one, by name, in declaration order."""
    found = {name: declaration(model, name) for name in model.model_fields}
    return {name: item.cap for name, item in found.items() if item is not None and item.cap is not None}


def derived_stages(model: type[BaseModel]) -> dict[str, tuple[str, ...]]:
    """MODEL's derived properties that enter stage keys (in_keys_of), with their stages, in declaration order."""
    return {
        name: getattr(value.fget, _STAGES)
        for name, value in vars(model).items()
        if isinstance(value, property) and hasattr(value.fget, _STAGES)
    }


def keyed_stages(model: type[BaseModel]) -> dict[str, tuple[str, ...]]:
    """Every field and derived property of MODEL that enters a stage key, with those stages: fields first, each in the
    order MODEL declares it."""
    fields = {name: declaration(model, name) for name in model.model_fields}
    keyed = {name: item.stages for name, item in fields.items() if item is not None and item.stages}
    return {**keyed, **derived_stages(model)}


def stage_fields(model: type[BaseModel], stage: str) -> tuple[str, ...]:
    """The fields and derived properties of MODEL that declare STAGE, in MODEL's order; an error for a stage no
    setting declares (a misspelt name would otherwise key the stage on nothing)."""
    names = tuple(name for name, stages in keyed_stages(model).items() if stage in stages)
    if not names:
        known = sorted({name for stages in keyed_stages(model).values() for name in stages})
        raise ValueError(f"no setting declares the stage {stage!r} (stages=...): the declared stages are {known}")
    return names


def reproducing(model: type[BaseModel], stages: tuple[str, ...]) -> tuple[str, ...]:
    """The fields of MODEL that make the output of STAGES what it is: each field in the key of one of them, less those
    declared `where=True` (derived locations, being no fields, are left out too), in MODEL's order."""
    keyed = {name for stage in stages for name in stage_fields(model, stage)}
    return tuple(
        name
        for name in model.model_fields
        if name in keyed and (found := declaration(model, name)) is not None and not found.where
    )
