"""Summary: what one pipeline run did, as a dict and a Prefect markdown artifact."""

from __future__ import annotations

import resource
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for

from infra.settings import Settings
from infra.spark import spark_application, spark_started_by, spark_startup_seconds
from infra.tracking import mlflow_client, run_url
from tasks.cards import dataset_card_markdown, dataset_card_of
from tasks.registry import alias_version
from tasks.results import CachedSplits, Promoted, Resized, TableVersion, Trained, Written
from tasks.rules.markdown import markdown_text
from tasks.rules.promotion import CHAMPION
from tasks.stage import stage, stage_outcomes, stage_seconds


def run_summary(
    resized: Resized | None,
    table: TableVersion,
    cached: CachedSplits,
    trained: Trained,
    promoted: Promoted,
    champion_version: str | None,
) -> dict[str, Any]:
    """The run's outcome as plain values (this is what `imagelake run --json` prints).

    `table` is what this run wrote (a Written) or the version it trained on without writing (retrain, a backfill's
    training).
    """
    written = table if isinstance(table, Written) else None
    return {
        "delta_table": table.table_uri,
        "delta_version": table.version,
        "delta_engine": table.engine,
        "rows": sum(cached.counts.values()),
        "rows_added": written.rows if written else 0,
        "rows_retired": written.retired if written else 0,
        "files_decoded": resized.decoded if resized else 0,
        "files_known": resized.known if resized else 0,
        "quarantined": resized.quarantined if resized else {},
        "files_unread": resized.unread
        if resized
        else {},  # reason -> files no read could get: not in this version, read next run
        "read_retries": resized.read_retries if resized else 0,
        "split_counts": cached.counts,
        "labels": cached.labels,
        "cache_dir": cached.cache_dir,
        "checkpoint": trained.checkpoint_path,
        "epochs_run": trained.epochs_run,
        "fit_seconds": getattr(trained, "fit_seconds", 0.0),
        "warm_started_from": getattr(
            trained, "warm_started_from", "none"
        ),  # a result cached before this field has none
        "val_accuracy": trained.val_accuracy,
        "mlflow_run_id": trained.mlflow_run_id,
        "model_name": promoted.model_name,
        "model_version": promoted.model_version,
        "model_alias": promoted.alias,
        "champion_version": champion_version,
        "test_accuracy": promoted.test_accuracy,
        "baseline_accuracy": getattr(promoted, "baseline_accuracy", None),  # a result cached before this field has none
        "promotion_decision": promoted.decision,
    }


SUMMARY_STAGE = "summarize"


def cache_report(states: dict[str, str], reasons: dict[str, str]) -> list[dict[str, str]]:
    """Each stage that ran in this flow run before the summary, in the order they ended: served from the cache or computed, and why."""
    report = []
    for name in states:
        if name == SUMMARY_STAGE:
            continue
        hit = states[name] == "Cached"
        why = reasons.get(name, "")
        if hit:
            why = "same code, inputs and settings as an earlier run"
        elif why.startswith("same code"):
            why = "same key as the last run, which left no result (it failed, or the results were cleared)"
        report.append({"stage": name, "cache": "hit" if hit else "miss", "why": why or "-"})
    return report


def summary_markdown(summary: dict[str, Any], mlflow_link: str) -> str:
    """A short markdown table of the summary for the Prefect UI."""
    rows = "\n".join(
        f"| {key} | {markdown_text(value)} |" for key, value in summary.items() if key != "cache"
    )  # values hold labels and paths
    stages = "\n".join(f"| {row['stage']} | {row['cache']} | {row['why']} |" for row in summary.get("cache", []))
    return (
        f"## imagelake run\n\nMLflow run: [{summary['mlflow_run_id']}]({mlflow_link})\n\n| item | value |\n|---|---|\n{rows}\n\n"
        f"### Cache\n\n| stage | cache | why |\n|---|---|---|\n{stages}\n"
    )


@stage(SUMMARY_STAGE, retries=1, cache_policy=NO_CACHE)
def summarize(
    resized: Resized | None,
    table: TableVersion,
    cached: CachedSplits,
    trained: Trained,
    promoted: Promoted,
    settings: Settings,
) -> dict[str, Any]:
    """Prefect stage (never cached): read the current champion and publish the run's summary."""
    client = mlflow_client(settings)
    champion_version = alias_version(client, promoted.model_name, CHAMPION)
    summary = run_summary(resized, table, cached, trained, promoted, champion_version)
    summary["flow_run_id"] = str(flow_run.id) if flow_run.id else None
    # The page Prefect's own "View at" line names; None on Prefect's ephemeral API, which has no UI.
    summary["flow_run_url"] = url_for("flow-run", obj_id=flow_run.id) if flow_run.id else None
    # Where the work ran: the Spark application (None when no stage needed a Spark job, or every one that would came
    # from
    # the cache: this process then never started Spark) and the Ray nodes of the ranks.
    summary["spark_application"] = spark_application()
    summary["ray_worker_nodes"] = getattr(trained, "worker_nodes", [])  # a result cached before this field has none
    summary["cache"] = cache_report(*stage_outcomes(summary["flow_run_id"])) if flow_run.id else []
    summary["cache_hits"] = [row["stage"] for row in summary["cache"] if row["cache"] == "hit"]
    # Spark's start-up falls inside the first stage that needs it: reported apart, with that stage and the driver's peak
    # memory. None for both where this process started no Spark.
    summary["spark_startup_seconds"] = spark_startup_seconds()
    summary["spark_started_in"] = spark_started_by()
    summary["driver_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    summary["stage_seconds"] = (
        {name: seconds for name, seconds in stage_seconds(summary["flow_run_id"]).items() if name != SUMMARY_STAGE}
        if flow_run.id
        else {}
    )
    link = run_url(client, settings, trained.mlflow_run_id)
    summary["mlflow_run_url"] = link
    create_markdown_artifact(summary_markdown(summary, link), key="imagelake-run-summary")
    create_table_artifact(
        summary["cache"], key="imagelake-cache", description="Which stages came from the cache, and why"
    )
    card = summary["dataset_card"] = dataset_card_of(cached)
    create_markdown_artifact(
        dataset_card_markdown(card, f"{link}/artifacts/dataset/samples.png"),
        key="imagelake-dataset-card",
        description="The data this run's model trained on",
    )
    create_table_artifact(
        [
            {"reason": reason, "files": count}
            for reason, count in sorted((resized.quarantined if resized else {}).items())
        ]
        or [{"reason": "none", "files": 0}],
        key="imagelake-quarantine",
        description=f"Files quarantined by this run, by reason (table {settings.quarantine_uri})",
    )
    return summary
