"""Summary: what one pipeline run did, as a dict and a Prefect markdown artifact."""

from __future__ import annotations

import resource
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for

from imagelake.infra.settings import Settings
from imagelake.infra.spark import spark_application, spark_started_by, spark_startup_seconds
from imagelake.infra.tracking import mlflow_client, model_version_url, run_url
from imagelake.tasks.results import CachedSplits, Promoted, Resized, TableVersion, Trained, Written
from imagelake.tasks.rules.markdown import markdown_text
from imagelake.tasks.rules.promotion import BASELINE, CHAMPION
from imagelake.tasks.rules.report import accuracy, count, counts, duration, in_split_order, margin
from imagelake.tasks.rules.training import started_from
from imagelake.tasks.stage import stage, stage_outcomes, stage_seconds


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
        "pretrained_weights": trained.pretrained_weights,
        "pretrained_sha256": trained.pretrained_sha256,
        "step_path": trained.step_path,
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


def results_report(states: dict[str, str], reasons: dict[str, str]) -> list[dict[str, str]]:
    """Each stage that ran in this flow run before the summary, in the order they ended: its stored result reused or
    computed anew, and why."""
    report = []
    for name in states:
        if name == SUMMARY_STAGE:
            continue
        reused = states[name] == "Cached"  # Prefect's name for a state whose result was reused
        why = reasons.get(name, "")
        if reused:
            why = "same code, inputs and settings as an earlier run"
        elif why.startswith("same code"):
            why = "same key as the last run, which left no result (it failed, or the results were cleared)"
        report.append({"stage": name, "result": "reused" if reused else "computed", "why": why or "-"})
    return report


# Keys of the JSON summary that were renamed, old -> new. The old ones are still written, in their old form, and the
# summary names them under `deprecated_keys`; they go in a later release.
RENAMED_KEYS = {"cache": "results", "cache_hits": "results_reused"}


def results_keys(report: list[dict[str, str]]) -> dict[str, Any]:
    """The summary's keys of the stage results report: `results`, `results_reused`, and the deprecated old ones."""
    reused = [row["stage"] for row in report if row["result"] == "reused"]
    old = [
        {"stage": row["stage"], "cache": "hit" if row["result"] == "reused" else "miss", "why": row["why"]}
        for row in report
    ]
    return {
        "results": report,
        "results_reused": reused,
        "cache": old,
        "cache_hits": reused,
        "deprecated_keys": dict(RENAMED_KEYS),
    }


def summary_markdown(summary: dict[str, Any], mlflow_link: str, model_link: str | None = None) -> str:
    """The run's report for the Prefect UI, to read at a glance: the promotion decision, then the data, the training,
    links and each stage's result. Numbers are rounded for people and text from the data (labels, paths, reasons) is
    escaped; the full record is the JSON summary."""
    return (
        "\n\n".join(
            [
                *decision_section(summary),
                "### Data",
                *data_section(summary),
                "### Training",
                *training_section(summary),
                "### Links",
                links_section(summary, mlflow_link, model_link),
                "### Stages",
                *stages_section(summary),
            ]
        )
        + "\n"
    )


def decision_section(summary: dict[str, Any]) -> list[str]:
    """The title (which version, which alias), the gate's reason, the test accuracy and who is champion."""
    model = f"{markdown_text(summary['model_name'])} v{markdown_text(summary['model_version'])}"
    baseline = summary.get("baseline_accuracy")
    test = f"Test accuracy {accuracy(summary['test_accuracy'])}" + (
        ""
        if baseline is None
        else f", {margin(summary['test_accuracy'], baseline)} over its baseline's {accuracy(baseline)} ({BASELINE})"
    )
    champion = summary.get("champion_version")
    stays = (
        f" The champion stays v{markdown_text(champion)}." if champion and champion != summary["model_version"] else ""
    )
    return [
        f"## {model} is {markdown_text(summary['model_alias'])}",
        f"**Promotion decision:** {markdown_text(summary['promotion_decision']).rstrip('.')}.",
        f"{test}.{stays}",
    ]


def data_section(summary: dict[str, Any]) -> list[str]:
    """The table version and what this run changed in it, the files read, the splits and the quarantine, the labels."""
    splits = in_split_order(summary["split_counts"])
    lines = [
        f"Delta table {markdown_text(summary['delta_table'])}, version {summary['delta_version']} "
        f"({markdown_text(summary['delta_engine'])}): {count(sum(splits.values()))} images, "
        f"{count(summary['rows_added'])} added, {count(summary['rows_retired'])} retired.",
    ]
    quarantined = summary.get("quarantined") or {}
    files = (
        f"Files: {count(summary['files_decoded'])} decoded, {count(summary['files_known'])} already known, "
        f"{count(sum(quarantined.values()))} quarantined."
    )
    unread = summary.get("files_unread") or {}
    if unread:
        files += (
            f" {count(sum(unread.values()))} could not be read "
            f"({markdown_text(counts(dict(sorted(unread.items()))))}): the next run reads them."
        )
    if summary.get("read_retries"):
        files += f" {count(summary['read_retries'])} read(s) retried."
    lines.append(files)
    rows = [f"| {markdown_text(split)} | {count(n)} |" for split, n in splits.items()]
    lines.append(
        "\n".join(["| split | images |", "|---|---:|", *rows, f"| **all** | **{count(sum(splits.values()))}** |"])
    )
    if quarantined:
        rows = [f"| {markdown_text(reason)} | {count(n)} |" for reason, n in sorted(quarantined.items())]
        lines.append("\n".join(["| quarantine reason | files |", "|---|---:|", *rows]))
    labels = summary.get("labels") or []
    shown = ", ".join(markdown_text(label) for label in labels[:LABELS_SHOWN])
    more = f", and {count(len(labels) - LABELS_SHOWN)} more" if len(labels) > LABELS_SHOWN else ""
    lines.append(f"{count(len(labels))} label(s): {shown}{more}.")
    return lines


LABELS_SHOWN = 30  # the dataset card artifact lists every label with its images per split


def training_section(summary: dict[str, Any]) -> list[str]:
    """Epochs, accuracies and time, where training started from, and where it ran (counts, not ids)."""
    seconds = summary.get("stage_seconds") or {}
    warm = summary.get("warm_started_from", "none")
    nodes = summary.get("ray_worker_nodes") or []
    spark = summary.get("spark_application")
    started_in = summary.get("spark_started_in")
    where = f"{count(len(nodes))} Ray Train rank(s) on {count(len(set(nodes)))} Ray node(s); " + (
        f"Spark on {markdown_text(spark['master'])}, started "
        + (f"in the {markdown_text(started_in)} stage" if started_in not in (None, "-") else "outside a stage")
        + f" ({duration(summary.get('spark_startup_seconds'))})"
        if spark
        else "no Spark started (no stage needed a Spark job)"
    )
    memory = summary.get("driver_peak_rss_mb")
    fit = f"fit {duration(summary.get('fit_seconds'))}"
    time = (
        f"{fit} in the run that trained it (this run reused its result)"
        if "train" in (summary.get("results_reused") or [])
        else f"{fit}, train stage {duration(seconds.get('train'))}"
    )
    return [
        f"{count(summary['epochs_run'])} epochs, val accuracy {accuracy(summary['val_accuracy'])}, test accuracy "
        f"{accuracy(summary['test_accuracy'])}; {time}; "
        + markdown_text(
            started_from(warm, summary.get("pretrained_weights", "none"), summary.get("pretrained_sha256", ""))
        )
        + "."
        + (f" Steps: {markdown_text(summary['step_path'])}." if summary.get("step_path") else ""),
        f"{where}." + (f" Driver peak memory {memory:,.0f} MB." if memory is not None else ""),
    ]


def links_section(summary: dict[str, Any], mlflow_link: str, model_link: str | None) -> str:
    """The MLflow run, the model version in the registry, the flow run's page (none on Prefect's ephemeral API)."""
    model = f"{markdown_text(summary['model_name'])} v{markdown_text(summary['model_version'])}"
    links = [
        f"- MLflow run: [{markdown_text(summary['mlflow_run_id'][:8])}]({mlflow_link})",
        f"- Model version: [{model}]({model_link})" if model_link else f"- Model version: {model}",
    ]
    if summary.get("flow_run_url"):
        links.append(
            f"- Prefect flow run: [{markdown_text(str(summary.get('flow_run_id'))[:8])}]({summary['flow_run_url']})"
        )
    return "\n".join(links)


def stages_section(summary: dict[str, Any]) -> list[str]:
    """Which stages' stored results were reused and which ran, with their wall times and why."""
    seconds = summary.get("stage_seconds") or {}
    report = summary.get("results") or []
    reused = [row["stage"] for row in report if row["result"] == "reused"]
    rows = [
        f"| {markdown_text(row['stage'])} | {row['result']} | {duration(seconds.get(row['stage']))} | "
        f"{markdown_text(row['why'])} |"
        for row in report
    ]
    return [
        f"Results reused: {', '.join(reused) or 'none'}; computed: {len(report) - len(reused)} stage(s).",
        "\n".join(["| stage | result | time | why |", "|---|---|---:|---|", *rows]),
    ]


@stage(SUMMARY_STAGE, retries=1, cache_policy=NO_CACHE)
def summarize(
    resized: Resized | None,
    table: TableVersion,
    cached: CachedSplits,
    trained: Trained,
    promoted: Promoted,
    settings: Settings,
) -> dict[str, Any]:
    """Prefect stage (runs every time): read the current champion and publish the run's summary."""
    from imagelake.tasks.registry.aliases import alias_version
    from imagelake.tasks.registry.cards import dataset_card_markdown, dataset_card_of

    client = mlflow_client(settings)
    champion_version = alias_version(client, promoted.model_name, CHAMPION)
    summary = run_summary(resized, table, cached, trained, promoted, champion_version)
    summary["flow_run_id"] = str(flow_run.id) if flow_run.id else None
    # The page Prefect's own "View at" line names; None on Prefect's ephemeral API, which has no UI.
    summary["flow_run_url"] = url_for("flow-run", obj_id=flow_run.id) if flow_run.id else None
    # Where the work ran: the Spark application (None when no stage needed a Spark job, or every stage that would have
    # reused its stored result: this process then never started Spark) and the Ray nodes of the ranks.
    summary["spark_application"] = spark_application()
    summary["ray_worker_nodes"] = getattr(trained, "worker_nodes", [])  # a result cached before this field has none
    summary.update(results_keys(results_report(*stage_outcomes(summary["flow_run_id"])) if flow_run.id else []))
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
    model_link = model_version_url(settings, promoted.model_name, promoted.model_version)
    create_markdown_artifact(summary_markdown(summary, link, model_link), key="imagelake-run-summary")
    create_table_artifact(
        summary["results"], key="imagelake-results", description="Which stages reused a stored result, and why"
    )
    # The same table under its old key, for whoever reads it by that key: deprecated, it goes in a later release.
    create_table_artifact(
        summary["cache"],
        key="imagelake-cache",
        description="Deprecated: renamed imagelake-results (with `result` reused or computed for `cache` hit or miss)",
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
