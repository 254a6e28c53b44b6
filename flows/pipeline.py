"""The imagelake pipeline: ingest -> resize -> Delta write -> repartition -> Petastorm cache -> train -> promote."""

from __future__ import annotations

from typing import Any

from prefect import flow

from infra.delta import choose_engine
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


@flow(name="imagelake-pipeline", log_prints=True)
def pipeline(source: str, config_file: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Take a folder of labelled images to a registered, tested and (if better) promoted model."""
    settings = load_settings(config_file, overrides)
    ingested = ingest(source, settings)
    resized = resize(ingested, settings)
    written = write(resized, settings)
    plan = repartition(written, settings)
    cached = cache(plan, settings)
    trained = train(cached, settings)
    promoted = promote(trained, cached, settings)
    return summarize(resized, written, cached, trained, promoted, settings)


@flow(name="imagelake-retrain", log_prints=True)
def retrain_flow(table_uri: str, table_version: int, config_file: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train and promote again on one pinned Delta table version (what `imagelake retrain` runs)."""
    settings = load_settings(config_file, overrides)
    engine = choose_engine(settings, spark_session(settings))
    written = Written(table_uri=table_uri, version=table_version, engine=engine, rows=0)
    plan = repartition(written, settings)
    cached = cache(plan, settings)
    trained = train(cached, settings)
    promoted = promote(trained, cached, settings)
    return summarize(None, written, cached, trained, promoted, settings)
