"""The imagelake pipeline: ingest -> resize -> Delta write -> repartition -> Petastorm cache -> train -> promote."""

from __future__ import annotations

from typing import Any

from prefect import flow

from infra.settings import load_settings
from tasks.cache import cache
from tasks.ingest import ingest
from tasks.promote import promote
from tasks.repartition import repartition
from tasks.resize import resize
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
