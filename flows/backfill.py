"""Backfills: plan the date partitions of a range, ingest each date as its own subflow run, then train once."""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from datetime import date, timedelta
from typing import Any

from deltalake import DeltaTable
from prefect import flow
from prefect.artifacts import create_table_artifact
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.delta import Engine, choose_engine, read_current, table_exists
from infra.lifecycle import release_compute, watch_worker
from infra.prefect_env import stage_results
from infra.settings import Settings, load_settings
from infra.spark import spark_session
from tasks.cache import cache
from tasks.ingest import Scope, ingest, known_files, list_source, source_uri
from tasks.promote import promote
from tasks.repartition import repartition
from tasks.resize import resize
from tasks.results import Written
from tasks.train import train
from tasks.write import write


class BackfillFailed(RuntimeError):
    """Some dates of a backfill failed; the others landed."""


def plan_dates(spark: SparkSession, engine: Engine, settings: Settings, source: str, start: date, end: date) -> list[dict[str, Any]]:
    """Each date in the range that has source files or table rows: missing (no rows yet), stale (files new, changed or gone) or done."""
    scope = Scope(tuple(e.lower() for e in settings.image_extensions), start, end, settings.max_file_bytes)
    entries = list_source(source_uri(source), scope)
    _, known, _ = known_files(spark, engine, settings.table_uri, settings.image_size, settings.quarantine_uri)
    in_range = (F.col("image_size") == settings.image_size) & (F.col("date") >= F.lit(start)) & (F.col("date") <= F.lit(end))
    rows = read_current(spark, settings.table_uri, engine, ["path", "date"], in_range).to_pylist() if table_exists(settings.table_uri) else []
    table_paths: dict[date, set[str]] = {}
    for row in rows:
        table_paths.setdefault(row["date"], set()).add(row["path"])
    listed: dict[date, list[dict]] = {}
    for entry in entries:
        listed.setdefault(entry["date"], []).append(entry)
    plan = []
    day = start
    while day <= end:
        files, present = listed.get(day, []), table_paths.get(day, set())
        if files or present:
            changed = sum(1 for e in files if known.get(e["path"]) != (e["size"], e["mtime"]))
            gone = len(present - {e["path"] for e in files})
            status = "missing" if not present and changed == len(files) else ("stale" if changed or gone else "done")
            plan.append({"date": day.isoformat(), "files": len(files), "new_or_changed": changed, "gone": gone, "status": status})
        day += timedelta(days=1)
    return plan


@flow(name="imagelake-ingest-date", log_prints=True, on_running=[watch_worker], on_cancellation=[release_compute], on_crashed=[release_compute])
def ingest_date(source: str, day: str, config_file: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ingest, resize and write one date partition (re-running it replaces exactly that date's rows)."""
    settings = load_settings(config_file, {**(overrides or {}), "start_date": day, "end_date": day})
    with stage_results(settings):
        written = write(resize(ingest(source, settings), settings), settings)
    return {"date": day, "version": written.version, "rows_added": written.rows, "rows_retired": written.retired}


@flow(name="imagelake-backfill", log_prints=True, on_running=[watch_worker], on_cancellation=[release_compute], on_crashed=[release_compute])
def backfill(
    source: str,
    start_date: date,
    end_date: date,
    max_concurrency: int = 2,
    dry_run: bool = False,
    config_file: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Plan the dates from start_date to end_date, publish the plan, then (unless dry_run) ingest each date that is
    not done as its own subflow run, at most max_concurrency at once, and train once on the resulting table version."""
    if start_date > end_date:
        raise ValueError(f"start_date {start_date} is after end_date {end_date}: swap them")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    settings = load_settings(config_file, overrides)
    spark = spark_session(settings)
    engine = choose_engine(settings, spark)
    plan = plan_dates(spark, engine, settings, source, start_date, end_date)
    if not plan:
        raise ValueError(f"no date=YYYY-MM-DD folders between {start_date} and {end_date} under {source}")
    create_table_artifact(plan, key="imagelake-backfill-plan", description=f"Dates {start_date} to {end_date}: missing, stale or done")
    todo = [item["date"] for item in plan if item["status"] != "done"]
    print(f"backfill plan: {len(todo)} of {len(plan)} dates to ingest ({', '.join(todo) or 'none'})")
    if dry_run:
        return {"plan": plan, "dry_run": True}

    failed: dict[str, str] = {}
    landed: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
        # Each date runs in a copy of this flow's context, so it is recorded as a subflow run of the backfill.
        futures = {day: pool.submit(contextvars.copy_context().run, ingest_date, source, day, config_file, overrides) for day in todo}
        try:
            for day, future in futures.items():
                try:
                    landed.append(future.result())
                except Exception as exc:  # one date's failure must not stop the others
                    failed[day] = f"{type(exc).__name__}: {exc}"
        except BaseException:  # cancelled, or the worker died: dates not started yet must not start
            for future in futures.values():
                future.cancel()
            raise
    result: dict[str, Any] = {"plan": plan, "dry_run": False, "ingested": landed, "failed": failed}
    if table_exists(settings.table_uri):
        written = Written(table_uri=settings.table_uri, version=DeltaTable(settings.table_uri).version(), engine=engine, rows=0)
        with stage_results(settings):
            cached = cache(repartition(written, settings), settings)
            promoted = promote(train(cached, settings), cached, settings)
        result.update(delta_version=written.version, model_version=promoted.model_version, model_alias=promoted.alias)
    if failed:
        raise BackfillFailed(f"{len(failed)} of {len(todo)} dates failed; re-run them: " + "; ".join(f"{day}: {why}" for day, why in sorted(failed.items())))
    return result
