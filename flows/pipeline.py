"""The imagelake pipeline: ingest -> resize -> Delta write -> repartition -> Petastorm cache -> train -> promote."""

from __future__ import annotations

from datetime import date
from typing import Any, Literal

from prefect import flow
from pydantic import BaseModel, Field

from infra.delta import choose_engine
from infra.lifecycle import release_compute, watch_worker
from infra.prefect_env import stage_results
from infra.settings import load_settings
from infra.spark import spark_session
from tasks.cache import cache
from tasks.ingest import ingest
from tasks.promote import promote
from tasks.repartition import repartition
from tasks.resize import resize
from tasks.results import Written
from tasks.summary import summarize
from tasks.train import train
from tasks.write import write


@flow(name="imagelake-pipeline", log_prints=True, on_running=[watch_worker], on_cancellation=[release_compute], on_crashed=[release_compute])
def pipeline(source: str, config_file: str | None = None, overrides: dict[str, Any] | None = None, refresh: bool = False) -> dict[str, Any]:
    """Take a folder of labelled images to a registered, tested and (if better) promoted model; `refresh` recomputes every stage."""
    settings = load_settings(config_file, overrides)
    with stage_results(settings, refresh):
        listed = ingest(source, settings)
        resized = resize(listed, settings)
        written = write(resized, settings)
        plan = repartition(written, settings)
        cached = cache(plan, settings)
        trained = train(cached, settings)
        promoted = promote(trained, cached, settings)
        return summarize(resized, written, cached, trained, promoted, settings)


@flow(name="imagelake-retrain", log_prints=True, on_running=[watch_worker], on_cancellation=[release_compute], on_crashed=[release_compute])
def retrain_flow(table_uri: str, table_version: int, config_file: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train and promote again on one pinned Delta table version (what `imagelake retrain` runs)."""
    settings = load_settings(config_file, overrides)
    engine = choose_engine(settings, spark_session(settings))
    written = Written(table_uri=table_uri, version=table_version, engine=engine, rows=0)
    with stage_results(settings):
        plan = repartition(written, settings)
        cached = cache(plan, settings)
        trained = train(cached, settings)
        promoted = promote(trained, cached, settings)
        return summarize(None, written, cached, trained, promoted, settings)


class RunParameters(BaseModel):
    """What the Prefect UI's form asks for an ad-hoc run: typed, with defaults, validated before any work starts."""

    source: str = Field(default=".imagelake/demo-digits", min_length=1, description="Folder or URI of images laid out as [date=YYYY-MM-DD/]<label>/<file>")
    image_size: int = Field(default=224, ge=8, le=1024, description="Side of the square images stored and trained on")
    max_epochs: int = Field(default=8, ge=1, le=1000)
    batch_size: int = Field(default=32, ge=1, le=4096, description="Per worker")
    num_workers: int = Field(default=2, ge=1, le=256, description="Ray Train workers")
    model_arch: Literal["small_cnn", "resnet18", "resnet50"] = "small_cnn"
    promotion_margin: float = Field(default=0.0, ge=0.0, le=1.0)
    start_date: date | None = Field(default=None, description="Only source files dated from this day")
    end_date: date | None = Field(default=None, description="Only source files dated up to this day")
    config_file: str | None = Field(default=None, description="Settings file on the worker; these fields override it")
    refresh: bool = Field(default=False, description="Recompute every stage even where the cache holds a result")


@flow(name="imagelake-adhoc", log_prints=True, on_running=[watch_worker], on_cancellation=[release_compute], on_crashed=[release_compute])
def adhoc(params: RunParameters = RunParameters()) -> dict[str, Any]:
    """An ad-hoc run from the Prefect UI: the pipeline with the form's values."""
    overrides = params.model_dump(exclude={"source", "config_file", "refresh"}, exclude_none=True, mode="json")
    return pipeline(source=params.source, config_file=params.config_file, overrides=overrides, refresh=params.refresh)
