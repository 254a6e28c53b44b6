"""Backfills: plan the date partitions of a range, ingest each date as its own subflow run, then train once."""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from typing import Any

from prefect.artifacts import create_table_artifact

from imagelake.flows.flow import check_weights, imagelake_flow, run_settings
from imagelake.flows.pipeline import train_and_promote
from imagelake.infra.prefect_env import stage_results
from imagelake.infra.settings import Settings
from imagelake.tasks.data.changes import date_counts
from imagelake.tasks.data.listing import save_listing, source_uri
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.results import TableVersion
from imagelake.tasks.rules.listed_files import Scope, check_date_range, date_plan
from imagelake.tasks.stages.ingest import ingest
from imagelake.tasks.stages.resize import resize
from imagelake.tasks.stages.write import requeue_by_setting, write


class BackfillFailed(RuntimeError):
    """Some dates of a backfill failed; the others landed."""


def plan_dates(table: ImageTable, settings: Settings, source: str, start: date, end: date) -> list[dict[str, Any]]:
    """Each date in the range that has source files or table rows: missing, stale or done (see
    imagelake.tasks.rules.listed_files.date_plan).
    The listing goes to staging and is compared with the tables by Spark; the driver gets counts per date."""
    scope = Scope(tuple(e.lower() for e in settings.image_extensions), start, end, settings.max_file_bytes)
    return date_plan(
        date_counts(table, save_listing(source_uri(source), scope, settings.staging_uri), scope, settings.staging_uri),
        start,
        end,
    )


@imagelake_flow("imagelake-ingest-date")
def ingest_date(
    source: str, day: str, config_file: str | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Ingest, resize and write one date partition (re-running it replaces exactly that date's rows)."""
    settings = run_settings(config_file, overrides, start_date=day, end_date=day)
    with stage_results(settings):
        written = write(resize(ingest(source, settings), settings), settings)
    return {"date": day, "version": written.version, "rows_added": written.rows, "rows_retired": written.retired}


@imagelake_flow("imagelake-backfill")
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
    check_date_range(start_date, end_date)
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    settings = run_settings(config_file, overrides)
    if not dry_run:
        check_weights(settings)
    table = ImageTable.of(settings)
    if (
        settings.requeue_reasons and not dry_run
    ):  # once, before the plan (which then finds their dates stale); never per date
        with stage_results(settings):
            requeue_by_setting(settings)
        overrides = {**(overrides or {}), "requeue_reasons": []}
    plan = plan_dates(table, settings, source, start_date, end_date)
    if not plan:
        raise ValueError(f"no date=YYYY-MM-DD folders between {start_date} and {end_date} under {source}")
    create_table_artifact(
        plan, key="imagelake-backfill-plan", description=f"Dates {start_date} to {end_date}: missing, stale or done"
    )
    todo = [item["date"] for item in plan if item["status"] != "done"]
    print(f"backfill plan: {len(todo)} of {len(plan)} dates to ingest ({', '.join(todo) or 'none'})")
    if dry_run:
        return {"plan": plan, "dry_run": True}

    failed: dict[str, str] = {}
    landed: list[dict[str, Any]] = []
    pool = ThreadPoolExecutor(max_workers=max_concurrency)
    # Each date runs in a copy of this flow's context, so it is recorded as a subflow run of the backfill.
    futures = {
        day: pool.submit(contextvars.copy_context().run, ingest_date, source, day, config_file, overrides)
        for day in todo
    }
    try:
        for day, future in futures.items():
            try:
                landed.append(future.result())
            except Exception as exc:  # one date's failure must not stop the others
                failed[day] = f"{type(exc).__name__}: {exc}"
    except BaseException:
        # Cancelled, timed out, or the worker died: dates not started yet must not start, and the flow does not wait for
        # a date that hangs (its Spark and Ray are released by the run's hooks).
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    result: dict[str, Any] = {"plan": plan, "dry_run": False, "ingested": landed, "failed": failed}
    if table.images.exists():
        version = TableVersion(table_uri=table.uri, version=table.images.version(), engine=table.engine)
        with stage_results(settings):
            summary = train_and_promote(version, settings)
        result.update(
            delta_version=version.version, model_version=summary["model_version"], model_alias=summary["model_alias"]
        )
    if failed:
        raise BackfillFailed(
            f"{len(failed)} of {len(todo)} dates failed; re-run them: "
            + "; ".join(f"{day}: {why}" for day, why in sorted(failed.items()))
        )
    return result
