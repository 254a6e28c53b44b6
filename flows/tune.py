"""Hyperparameter search: the data stages as in a run (their stored results reused), then Ray Tune over the cached
splits; with `promote`, the best trial's settings trained on the full budget and promoted through the gate."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from imagelake.flows.flow import check_weights, imagelake_flow, resolved_signature, run_settings
from imagelake.flows.pipeline import form_model, form_overrides, land
from imagelake.infra.prefect_env import stage_results
from imagelake.infra.settings import load_settings
from imagelake.tasks.rules.tuning import DEFAULT_SPACE, check_space, read_space, space_from_text
from imagelake.tasks.stages.cache import cache
from imagelake.tasks.stages.promote import promote as promote_stage
from imagelake.tasks.stages.split import split
from imagelake.tasks.stages.train import train
from imagelake.tasks.stages.tune import Search, tune


@imagelake_flow("imagelake-tune")
def tune_flow(
    source: Annotated[str, Field(min_length=1, description="Folder or URI of images laid out as <label>/<file>")],
    trials: Annotated[int, Field(ge=1, description="Trials to run, each a training run of up to max_epochs")] = 8,
    space: Annotated[
        dict[str, Any] | None,
        Field(description="Search space {setting: {choice|uniform|loguniform|randint: [...]}}; default: built in"),
    ] = None,
    space_file: Annotated[str | None, Field(description="Search space file (YAML) on the worker, instead")] = None,
    time_budget_s: Annotated[
        float | None, Field(gt=0, description="Seconds the search may take; no trial starts after them")
    ] = None,
    promote: Annotated[
        bool, Field(description="Train the best trial's settings and promote them through the gate")
    ] = False,
    config_file: str | None = None,
    overrides: dict[str, Any] | None = None,
    refresh: bool = False,
) -> dict[str, Any]:
    """Search SOURCE's training settings over TRIALS trials: the default space, or SPACE ({setting: {kind: values}}) or
    the YAML file SPACE_FILE (docs/training.md), for at most TIME_BUDGET_S seconds; PROMOTE trains the best settings
    and promotes them through the gate."""
    settings = run_settings(config_file, overrides)
    search = Search(
        space=search_space(space, space_file, settings.image_size),
        trials=trials,
        time_budget_s=time_budget_s,
        seed=settings.seed,
    )
    check_weights(settings)
    with stage_results(settings, refresh):
        _, written = land(source, settings)
        cached = cache(split(written, settings), settings)
        searched = tune(cached, settings, search)
        summary: dict[str, Any] = {**searched.model_dump(), "promoted": None}
        if promote and searched.best_settings:
            best = load_settings(config_file, {**(overrides or {}), **searched.best_settings})
            trained = train(cached, best)
            summary["promoted"] = promote_stage(trained, cached, best).model_dump()
        return summary


def search_space(space: dict[str, Any] | None, space_file: str | None, image_size: int) -> dict[str, Any]:
    """The run's space, checked before any stage runs: SPACE, else the file SPACE_FILE, else the default one."""
    if space and space_file:
        raise ValueError("give the search space as `space` or as `space_file`, not both")
    if space:
        return check_space(space, image_size, "the search space given as the run's `space` parameter")
    if space_file:
        return check_space(read_space(space_file), image_size, f"the search space file {space_file}")
    return check_space(DEFAULT_SPACE, image_size, "the default search space")


# The search's own fields of the tune deployment's form, as tune_flow declares them (types, defaults, limits), and the
# space as text: the Prefect UI has no input for a free-form mapping, so a form run writes it as YAML or JSON.
FORM_SEARCH = ("trials", "space_file", "time_budget_s", "promote")
SPACE_TEXT = Field(
    default="",
    description="Search space as YAML or JSON text, e.g. {base_lr: {loguniform: [0.0001, 0.01]}, augment: "
    "{choice: [none, light]}} (docs/training.md); empty: the default space",
)


def tune_form_model() -> type:
    """TuneParameters: the source, the search's fields, the form's settings (flows/pipeline.py:form_model)."""
    declared = resolved_signature(tune_flow).parameters
    extra: dict[str, Any] = {"trials": (declared["trials"].annotation, declared["trials"].default)}
    extra["space"] = (str, SPACE_TEXT)
    extra.update({name: (declared[name].annotation, declared[name].default) for name in FORM_SEARCH[1:]})
    return form_model(
        "TuneParameters",
        "What the Prefect UI's form asks for a search: its trials, space and budget, and the run's settings as the "
        "ad-hoc form has them.",
        extra,
        module=__name__,
    )


TuneParameters = tune_form_model()
TUNE_FORM_DEFAULTS = TuneParameters()


@imagelake_flow("imagelake-tune-adhoc")
def tune_adhoc(params: TuneParameters = TUNE_FORM_DEFAULTS) -> dict[str, Any]:  # type: ignore[valid-type]
    """A search from the Prefect UI: tune_flow with the form's values, its space read from the form's text."""
    overrides = form_overrides(params)
    text = params.space.strip()
    space = space_from_text(text, "the form's search space (`space`)") if text else None
    return tune_flow(
        source=params.source,
        **{name: getattr(params, name) for name in FORM_SEARCH},
        space=space,
        config_file=params.config_file,
        overrides=overrides,
        refresh=params.refresh,
    )
