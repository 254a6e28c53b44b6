"""How a setting is declared: once, in its field of Settings, next to its type, default, bounds and description.

Besides what pydantic's Field holds, a declaration says whether a run started from a deployment may set the setting
(and within what cap), and which stages' keys it enters. infra/settings.py derives from the declarations what used to
be written out by hand apart from them: ALLOWED_FROM_RUNS, REFUSED_FROM_RUNS, RUN_LIMITS and each stage's settings
(stage_settings). Pure: pydantic only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

from pydantic import BaseModel, Field

Runs = Literal["allowed", "refused"]
Side = Literal["at most", "at least"]
F = TypeVar("F", bound=Callable[..., Any])

_STAGES = "__stage_keys__"  # the attribute in_keys_of sets on a derived property's getter


@dataclass(frozen=True)
class Declared:
    """A setting's declaration besides pydantic's: the stages whose key it enters (() when none), whether a run from
    a deployment may set it, and the side of a limit a run's value must keep to (None: any value)."""

    stages: tuple[str, ...]
    runs: Runs
    cap: tuple[Side, float] | None = None
    where: bool = False


def setting(
    *, stages: tuple[str, ...], runs: Runs, cap: tuple[Side, float] | None = None, where: bool = False, **field: Any
) -> Any:
    """A field of Settings: pydantic's Field(**field) (default, bounds, description...) with its declaration.

    stages: the stages whose output the setting changes: its value enters their keys, so a run with another value
    computes them anew. `stages=()` says that it changes no stage's output (a place, a time limit, logging, how
    fast): write it deliberately, there is no default.
    runs: "allowed" where a run started from a deployment (the UI's form, a schedule, the API) may set it; "refused"
    where only the worker's config file or IMAGELAKE_* environment may (infra/settings.py:refuse_unsafe).
    cap: for an allowed setting, ("at most" | "at least", limit): a run may only set values on the safe side of it.
    where: True for a setting in a stage's key that says only where its output lives (an experiment, a store), never
    what it is: a model's record leaves it out of the settings that reproduce it (`reproducing`).

    The declaration rides in the field's metadata, which pydantic leaves out of validation and of JSON schemas: the
    Prefect form shows the field as pydantic's Field alone would.
    """
    if not isinstance(stages, tuple) or not all(isinstance(stage, str) and stage for stage in stages):
        raise TypeError(f"stages must be a tuple of stage names, or () for none: got {stages!r}")
    if runs not in get_args(Runs):
        raise ValueError(f"runs must be 'allowed' or 'refused': got {runs!r}")
    if cap is not None:
        if runs != "allowed":
            raise ValueError(f"cap={cap!r} on a setting runs may not set: a cap is for runs='allowed'")
        if len(cap) != 2 or cap[0] not in get_args(Side) or not isinstance(cap[1], int | float):
            raise ValueError(f"cap must be ('at most' | 'at least', number): got {cap!r}")
    info = Field(**field)
    # First: pydantic's own bounds (Ge, Le...) stay at the end, where readers of field.metadata look for them.
    info.metadata.insert(0, Declared(stages=stages, runs=runs, cap=cap, where=where))
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
