"""The imagelake pipeline: ingest -> resize -> Delta write -> split -> Petastorm cache (repartitioned) -> train ->
promote.

Every flow that trains (the pipeline, `retrain`, a backfill) reaches training through one chain,
`train_and_promote`, from a version of the images table.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, create_model

from imagelake.flows.flow import check_run_parameters, check_weights, imagelake_flow, run_settings
from imagelake.infra.delta import Table
from imagelake.infra.prefect_env import stage_results
from imagelake.infra.settings import Settings
from imagelake.tasks.results import Resized, TableVersion
from imagelake.tasks.stages.cache import cache
from imagelake.tasks.stages.ingest import ingest
from imagelake.tasks.stages.promote import promote
from imagelake.tasks.stages.resize import resize
from imagelake.tasks.stages.retention import retention
from imagelake.tasks.stages.split import split
from imagelake.tasks.stages.summary import summarize
from imagelake.tasks.stages.train import train
from imagelake.tasks.stages.write import requeue_by_setting, write


def train_and_promote(table: TableVersion, settings: Settings, resized: Resized | None = None) -> dict[str, Any]:
    """Plan the splits of one table version, cache them, train, promote through the gate and summarise the run.

    Called inside a flow (under `stage_results`): its stages are task runs of that flow run, so one run page and one
    results report show every stage. `resized` is the run's own resize result, if it ingested anything.
    """
    plan = split(table, settings)
    cached = cache(plan, settings)
    trained = train(cached, settings)
    promoted = promote(trained, cached, settings)
    summary = summarize(resized, table, cached, trained, promoted, settings)
    summary["removed_by_retention"] = retention(settings)
    return summary


@imagelake_flow("imagelake-pipeline")
def pipeline(
    source: str, config_file: str | None = None, overrides: dict[str, Any] | None = None, refresh: bool = False
) -> dict[str, Any]:
    """Take a folder of labelled images to a registered, tested and (if better) promoted model; `refresh` recomputes
    every stage."""
    settings = run_settings(config_file, overrides)
    check_weights(settings)
    with stage_results(settings, refresh):
        resized, written = land(source, settings)
        return train_and_promote(written, settings, resized)


def land(source: str, settings: Settings) -> tuple[Resized, TableVersion]:
    """Bring SOURCE's new and changed images into the images table (within a flow, under `stage_results`): the run's
    resize result and the table version written."""
    if settings.requeue_reasons:
        requeue_by_setting(settings)
    listed = ingest(source, settings)
    resized = resize(listed, settings)
    return resized, write(resized, settings)


@imagelake_flow("imagelake-retrain")
def retrain_flow(
    table_uri: str, table_version: int, config_file: str | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train and promote again on one pinned Delta table version (what `imagelake retrain` runs)."""
    settings = run_settings(config_file, overrides)
    check_weights(settings)
    table = TableVersion(table_uri=table_uri, version=table_version, engine=Table.open(table_uri, settings).engine)
    with stage_results(settings):
        return train_and_promote(table, settings)


# The ad-hoc form's settings: their types, defaults, limits and descriptions are Settings' own, so the two cannot drift.
FORM_SETTINGS = (
    "image_size",
    "max_epochs",
    "batch_size",
    "num_workers",
    "model_arch",
    "promotion_margin",
    "start_date",
    "end_date",
)


def form_model(name: str, doc: str, extra: dict[str, Any] | None = None, module: str = __name__) -> type[BaseModel]:
    """The model NAME (of MODULE) of a form run from the Prefect UI: the source, then EXTRA fields ({name: (type,
    default or Field)}), the form's settings as Settings declares them, a settings file and refresh."""
    fields: dict[str, Any] = {
        "source": (
            str,
            Field(
                default=".imagelake/demo-digits",
                min_length=1,
                description="Folder or URI of images laid out as [date=YYYY-MM-DD/]<label>/<file>",
            ),
        ),
        **(extra or {}),
    }
    for setting in FORM_SETTINGS:
        declared = Settings.model_fields[setting]
        fields[setting] = (declared.annotation, declared)
    fields["config_file"] = (
        str | None,
        Field(default=None, description="Settings file on the worker; these fields override it"),
    )
    fields["refresh"] = (
        bool,
        Field(default=False, description="Recompute every stage even where a stored result fits"),
    )
    model = create_model(name, __module__=module, **fields)
    model.__doc__ = doc
    return model


def form_overrides(params: BaseModel) -> dict[str, Any]:
    """The settings a form run sets (its FORM_SETTINGS fields), checked against the run policy: the form's flow runs
    its work as a subflow run, which is not the deployment's run that check_run_parameters looks for."""
    overrides = params.model_dump(include=set(FORM_SETTINGS), exclude_none=True, mode="json")
    check_run_parameters(params.config_file, overrides)  # type: ignore[attr-defined]
    return overrides


RunParameters = form_model(
    "RunParameters",
    "What the Prefect UI's form asks for an ad-hoc run: typed, with defaults, validated before any work starts.",
)
FORM_DEFAULTS = RunParameters()  # the ad-hoc form as it first shows: every field at its default


@imagelake_flow("imagelake-adhoc")
def adhoc(params: RunParameters = FORM_DEFAULTS) -> dict[str, Any]:  # type: ignore[valid-type]
    """An ad-hoc run from the Prefect UI: the pipeline with the form's values."""
    overrides = form_overrides(params)
    return pipeline(source=params.source, config_file=params.config_file, overrides=overrides, refresh=params.refresh)
