"""What the `imagelake` command prints of a summary: a run's (format_summary) and a search's (format_search), as text
for a person; `--json` prints the summary itself."""

from __future__ import annotations

from typing import Any

from imagelake.tasks.rules.report import accuracy, count, counts, duration, in_split_order, margin
from imagelake.tasks.rules.training import started_from


def recomputed(report: list[dict[str, str]]) -> str:
    """The stages that ran, grouped by why: '; ran: resize, write (table version changed 0 -> 1)'."""
    reasons: dict[str, list[str]] = {}
    for row in report:
        if row["result"] == "computed":
            reasons.setdefault(row["why"], []).append(row["stage"])
    return "".join(f"; ran: {', '.join(stages)} ({why})" for why, stages in reasons.items())


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines a person reads after a run, in the order of the run's report: the promotion decision first, then
    the data, the training, the links and the stages."""
    start = started_from(
        summary.get("warm_started_from", "none"),
        summary.get("pretrained_weights", "none"),
        summary.get("pretrained_sha256", ""),
    )
    quarantined = summary["quarantined"] or {}
    return "\n".join(
        [
            f"imagelake run {summary.get('flow_run_id')}"
            + (f"  ({summary['flow_run_url']})" if summary.get("flow_run_url") else ""),
            f"  decision      {summary['model_name']} v{summary['model_version']} -> {summary['model_alias']}: "
            f"{summary['promotion_decision']}",
            f"  model         test accuracy {accuracy(summary['test_accuracy'])}{over_baseline(summary)}; "
            f"champion is v{summary['champion_version']}",
            f"  data          {summary['delta_table']} v{summary['delta_version']} ({count(summary['rows'])} images, "
            f"{count(summary['rows_added'])} added, {count(summary['rows_retired'])} retired, "
            f"writer {summary['delta_engine']})",
            f"  files         {count(summary['files_decoded'])} decoded, "
            f"{count(summary['files_known'])} already known, "
            + (
                f"quarantined {count(sum(quarantined.values()))} ({counts(dict(sorted(quarantined.items())))})"
                if quarantined
                else "quarantined none"
            )
            + unread_line(summary),
            f"  splits        {counts(in_split_order(summary['split_counts']))}",
            f"  cache         {summary['cache_dir']}",
            f"  training      {count(summary['epochs_run'])} epochs{training_time(summary)}, "
            f"val accuracy {accuracy(summary['val_accuracy'])}" + f", {start}",
            *([f"  steps         {summary['step_path']}"] if summary.get("step_path") else []),
            f"  links         MLflow run {summary.get('mlflow_run_url') or summary['mlflow_run_id']}"
            + ui_hint(summary),
            f"  stages        results reused: {', '.join(summary.get('results_reused') or []) or 'none'}"
            f"{recomputed(summary.get('results', []))}",
            f"  stage times   {timings(summary.get('stage_seconds') or {})}",
            f"  ran on        {engines(summary)}",
        ]
        + ([f"  log           {summary['log_file']} (the libraries' own messages)"] if summary.get("log_file") else [])
    )


def ui_hint(summary: dict[str, Any]) -> str:
    """How to open the MLflow link where no UI answers at its address (a run on the workspace's own store)."""
    if summary.get("mlflow_ui_answers") is False and summary.get("mlflow_run_url"):
        return " (nothing answers there now: `make ui` starts the MLflow UI on the workspace)"
    return ""


def training_time(summary: dict[str, Any]) -> str:
    """' in 48.6 s' (the train stage's time), or ' (result reused)' where this run reused an earlier run's training."""
    if "train" in (summary.get("results_reused") or []):
        return " (result reused)"
    seconds = (summary.get("stage_seconds") or {}).get("train")
    return "" if seconds is None else f" in {duration(seconds)}"


def over_baseline(summary: dict[str, Any]) -> str:
    """The model's margin over its run's plain baseline, where the run fitted one."""
    baseline = summary.get("baseline_accuracy")
    return (
        ""
        if baseline is None
        else f", {margin(summary['test_accuracy'], baseline)} over its baseline's {accuracy(baseline)}"
    )


def unread_line(summary: dict[str, Any]) -> str:
    """Files no read could get (left out of this version, read again by the next run) and reads that were retried."""
    unread, retries = summary.get("files_unread") or {}, summary.get("read_retries") or 0
    text = (
        f"; could not read {sum(unread.values())} ({', '.join(f'{k}: {v}' for k, v in sorted(unread.items()))}), "
        "the next run reads them"
        if unread
        else ""
    )
    return text + (f"; {retries} read(s) retried" if retries else "")


def timings(seconds: dict[str, float]) -> str:
    """Each stage's wall time, in pipeline order: 'ingest 0.4 s, resize 9.8 s, ..., train 2 min 5 s'."""
    return ", ".join(f"{name} {duration(value)}" for name, value in seconds.items()) or "-"


def engines(summary: dict[str, Any]) -> str:
    """Where the work ran: the Spark application and master, the Ray nodes of the training ranks."""
    spark = summary.get("spark_application")
    nodes = summary.get("ray_worker_nodes") or []
    where = f"Spark {spark['id']} on {spark['master']}" if spark else "Spark: not started (no stage needed a Spark job)"
    distinct = len(set(nodes))
    return f"{where}; Ray Train: {len(nodes)} rank(s) on {distinct} Ray node(s)" + (
        f" ({', '.join(n[:8] for n in nodes)})" if nodes else ""
    )


def format_search(summary: dict[str, Any]) -> str:
    """The search's table, its best settings and where they were saved, and the promotion's decision."""
    from imagelake.tasks.rules.tuning import search_table

    best = summary["best_settings"]
    lines = [
        f"imagelake tune {summary['search_name']}: {len(summary['trials'])} trial(s) in {duration(summary['seconds'])}",
        search_table(summary["trials"]),
        (
            f"best          {', '.join(f'{k}={v}' for k, v in sorted(best.items()))} "
            f"(val accuracy {accuracy(summary['best_val_accuracy'])})"
            if best
            else "best          none: no trial reported a validation accuracy"
        ),
        f"settings file {summary['settings_file']} (imagelake run --config ...)",
        f"MLflow run    {summary['mlflow_run_id']} (a child run per trial)",
    ]
    promoted = summary.get("promoted")
    if promoted:
        lines.append(
            f"decision      {promoted['model_name']} v{promoted['model_version']} -> {promoted['alias']}: "
            f"{promoted['decision']}"
        )
    return "\n".join(lines)
