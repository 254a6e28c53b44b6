"""What a run publishes: the run-summary report (a Prefect markdown artifact) and the CLI's printed summary, both
read by a person at a glance, from a summary dict built here as `summarize` builds it (no engine, no server)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from imagelake.flows.summary_text import format_summary
from imagelake.tasks.stages.summary import summary_markdown

LABEL = "a|b <img src=x> *x*"
RUN_LINK = "http://127.0.0.1:5000/#/experiments/1/runs/23b04eb6136a489d8faa99bc6bf2af8b"
MODEL_LINK = "http://127.0.0.1:5000/#/models/imagelake-classifier/versions/3"


def built_summary(**changes: Any) -> dict[str, Any]:
    """A run's summary as `imagelake run --json` prints it: unrounded floats, full paths, Ray node ids."""
    summary = {
        "delta_table": "/ws/tables/images",
        "delta_version": 3,
        "delta_engine": "delta-rs",
        "rows": 1797,
        "rows_added": 1797,
        "rows_retired": 4,
        "files_decoded": 1799,
        "files_known": 0,
        "quarantined": {"not_an_image": 2, "truncated": 1},
        "files_unread": {},
        "read_retries": 0,
        "split_counts": {"train": 1426, "val": 167, "test": 204},
        "labels": [*[str(digit) for digit in range(9)], LABEL],
        "cache_dir": "file:///ws/cache/d7c4ec7ef2a79ece587f",
        "checkpoint": "/ws/ray_results/train-5f0c/TorchTrainer_8c1e3/checkpoint_000014",
        "epochs_run": 15,
        "fit_seconds": 4.604957690999981,
        "warm_started_from": "none",
        "val_accuracy": 0.9940119760479041,
        "mlflow_run_id": "23b04eb6136a489d8faa99bc6bf2af8b",
        "model_name": "imagelake-classifier",
        "model_version": "3",
        "model_alias": "champion",
        "champion_version": "3",
        "test_accuracy": 0.9901960784313726,
        "baseline_accuracy": 0.9656862745098039,
        "promotion_decision": "candidate accuracy 0.9902 beats champion 0.9853 by more than 0.0000 (higher is better)",
        "flow_run_id": "95451925-3c8e-4410-a70b-9298abb3eecd",
        "flow_run_url": "http://127.0.0.1:4200/runs/flow-run/95451925-3c8e-4410-a70b-9298abb3eecd",
        "spark_application": {"id": "local-1795408464333", "master": "local[*]"},
        "ray_worker_nodes": ["9bdf652a0c4e7d1b2f", "9bdf652a0c4e7d1b2f"],
        "results": [
            {"stage": "ingest", "result": "reused", "why": "same code, inputs and settings as an earlier run"},
            {"stage": "resize", "result": "computed", "why": "table version changed 2 -> 3"},
            {"stage": "write", "result": "computed", "why": "input resized changed"},
            {"stage": "split", "result": "computed", "why": "input table changed"},
            {"stage": "cache", "result": "computed", "why": "input plan changed"},
            {"stage": "train", "result": "computed", "why": "input cached changed"},
            {"stage": "promote", "result": "computed", "why": "input trained changed"},
        ],
        "results_reused": ["ingest"],
        "spark_startup_seconds": 4.212345,
        "spark_started_in": "resize",
        "driver_peak_rss_mb": 812.3,
        "stage_seconds": {
            "ingest": 0.012,
            "resize": 8.2345,
            "write": 0.111,
            "split": 0.73,
            "cache": 1.944,
            "train": 125.3456,
            "promote": 1.6,
        },
        "mlflow_run_url": RUN_LINK,
    }
    return {**summary, **changes}


def report(**changes: Any) -> str:
    return summary_markdown(built_summary(**changes), RUN_LINK, model_link=MODEL_LINK)


def headings(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("#")]


def test_the_report_opens_with_the_decision_then_data_training_and_links() -> None:
    text = report()
    titles = headings(text)
    assert titles[0].startswith("## ") and "imagelake-classifier v3" in titles[0] and "champion" in titles[0], titles
    # The decision and its reason come before any other section.
    decision = text.index("beats champion 0.9853")
    assert decision < text.index("### Data") < text.index("### Training") < text.index("### Links"), titles
    assert [title for title in titles if title.startswith("### ")][:3] == ["### Data", "### Training", "### Links"]
    challenger = report(model_alias="challenger", champion_version="2", promotion_decision="does not beat")
    assert "challenger" in headings(challenger)[0] and "v2" in challenger.split("### Data")[0], challenger


def test_the_report_rounds_numbers_for_people() -> None:
    text = report()
    for raw in ("0.9901960784313726", "0.9940119760479041", "4.604957690999981", "125.3456", "8.2345", "4.212345"):
        assert raw not in text, raw
    assert "test accuracy 0.990" in text and "val accuracy 0.994" in text and "baseline's 0.966" in text, text
    assert "4.6 s" in text, "seconds to one place"
    assert "2 min 5 s" in text, "a stage of over a minute in minutes"
    assert re.search(r"\b1,797\b", text), "counts with thousands separated"
    assert not re.search(r"\d\.\d{5,}", text), "no number with five or more places"


def test_the_report_shows_the_splits_as_a_table_and_the_quarantine_by_reason() -> None:
    lines = report().splitlines()
    start = lines.index("| split | images |")
    assert lines[start : start + 6] == [
        "| split | images |",
        "|---|---:|",
        "| train | 1,426 |",
        "| val | 167 |",
        "| test | 204 |",
        "| **all** | **1,797** |",
    ]
    start = lines.index("| quarantine reason | files |")
    assert lines[start + 2 : start + 4] == ["| not\\_an\\_image | 2 |", "| truncated | 1 |"]
    assert "1,797 added, 4 retired" in "\n".join(lines)
    assert "quarantine reason" not in report(quarantined={}), "no table for an empty quarantine"


def test_the_report_holds_no_python_reprs_paths_or_node_ids() -> None:
    text = report()
    for raw in ("{'", "['", "':", "None", "checkpoint_000014", "/ws/ray_results", "9bdf652a0c4e7d1b2f", "local-1795"):
        assert raw not in text, raw


def test_the_report_links_the_mlflow_run_the_model_version_and_the_flow_run() -> None:
    links = report().split("### Links")[1]
    assert f"]({RUN_LINK})" in links and f"]({MODEL_LINK})" in links, links
    assert "](http://127.0.0.1:4200/runs/flow-run/95451925-3c8e-4410-a70b-9298abb3eecd)" in links
    assert "flow-run" not in report(flow_run_url=None), "no link to a page Prefect's ephemeral API does not have"


def test_the_report_says_which_stage_results_were_reused_and_why() -> None:
    assert "fit 4.6 s, train stage 2 min 5 s" in report()
    assert "fit 4.6 s in the run that trained it (this run reused its result)" in report(results_reused=["train"])
    text = report()
    assert "| ingest | reused | 0.0 s | same code, inputs and settings as an earlier run |" in text, text
    assert "| train | computed | 2 min 5 s | input cached changed |" in text, text
    assert "cache hit" not in text and "from cache" not in text


def test_label_names_reach_the_report_escaped() -> None:
    rows = [line for line in report().splitlines() if "img" in line]
    assert rows and all("<" not in row and "a\\|b &lt;img" in row and "\\*x\\*" in row for row in rows), rows


# What the slow tests read from a run's report on a Prefect server, under the JSON summary's names.
REPORT_FACTS = {
    "model_version": r"^## .+ v(\S+) is \S+$",
    "model_alias": r"^## .+ v\S+ is (\S+)$",
    "delta_version": r"^Delta table .+, version (\d+) \(",
    "rows_added": r"images, ([\d,]+) added, ",
    "files_decoded": r"^Files: ([\d,]+) decoded",
    "epochs_run": r"^([\d,]+) epochs, val accuracy",
    "mlflow_run_id": r"^- MLflow run: \[.*\]\(.*/runs/(\w+)\)$",
}


def report_facts(markdown: str) -> dict[str, str]:
    """REPORT_FACTS read from a run's report (counts without their thousands separators)."""
    found = {}
    for key, pattern in REPORT_FACTS.items():
        match = re.search(pattern, markdown, re.MULTILINE)
        assert match, f"no {key} in the run's report:\n{markdown}"
        found[key] = match.group(1).replace(",", "")
    return found


def test_the_figures_the_slow_tests_read_are_in_the_report() -> None:
    assert report_facts(report()) == {
        "model_version": "3",
        "model_alias": "champion",
        "delta_version": "3",
        "rows_added": "1797",
        "files_decoded": "1799",
        "epochs_run": "15",
        "mlflow_run_id": "23b04eb6136a489d8faa99bc6bf2af8b",
    }


def test_the_cli_summary_follows_the_same_order_without_reprs() -> None:
    text = format_summary(built_summary())
    lines = text.splitlines()
    assert lines[0].startswith("imagelake run 95451925") and lines[1].split()[0] == "decision", lines
    assert "imagelake-classifier v3 -> champion" in lines[1] and "beats champion 0.9853" in lines[1], lines[1]
    order = [line.split()[0] for line in lines[1:]]
    assert order.index("decision") < order.index("data") < order.index("training") < order.index("links"), order
    for raw in ("{'", "['", "0.9901960784313726", "4.604957690999981", "125.3456", "checkpoint_000014"):
        assert raw not in text, raw
    assert "splits        train 1,426, val 167, test 204" in text, text
    assert "quarantined 3 (not_an_image 2, truncated 1)" in text, text
    assert "training      15 epochs in 2 min 5 s, val accuracy 0.994" in text and "test accuracy 0.990" in text, text
    reused = format_summary(built_summary(results_reused=["ingest", "train"]))
    assert "training      15 epochs (result reused), val accuracy 0.994" in reused, reused
    assert "results reused: ingest; ran: resize (table version changed 2 -> 3)" in text, text
    assert "train 2 min 5 s" in text, text
    assert RUN_LINK in text


def test_splits_read_train_val_test_whatever_order_they_came_in() -> None:
    from imagelake.tasks.rules.report import in_split_order

    assert list(in_split_order({"test": 2, "extra": 4, "train": 1, "val": 3})) == ["train", "val", "test", "extra"]
    sorted_as_json = built_summary(split_counts={"test": 204, "train": 1426, "val": 167})
    assert "splits        train 1,426, val 167, test 204" in format_summary(sorted_as_json)
    assert "| train | 1,426 |\n| val | 167 |\n| test | 204 |" in summary_markdown(sorted_as_json, RUN_LINK)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.04, "0.0 s"), (59.94, "59.9 s"), (59.96, "1 min 0 s"), (125.3, "2 min 5 s"), (3725, "1 h 2 min")],
)
def test_durations_read_as_seconds_then_minutes(seconds: float, text: str) -> None:
    from imagelake.tasks.rules.report import duration

    assert duration(seconds) == text


def test_the_summary_names_the_log_file_the_step_path_and_how_to_open_a_link_nothing_answers() -> None:
    from imagelake.infra.tracking import ui_answers

    quiet = format_summary(
        built_summary(
            log_file="/ws/logs/imagelake-pipeline-20261205T210324Z-1.log",
            mlflow_ui_answers=False,
            step_path="eager: no GPU (compiling costs its start-up and does not pay on a CPU)",
        )
    )
    assert "  log           /ws/logs/imagelake-pipeline-20261205T210324Z-1.log (the libraries' own messages)" in quiet
    assert "  steps         eager: no GPU" in quiet
    link = next(line for line in quiet.splitlines() if line.lstrip().startswith("links"))
    assert link.endswith("(nothing answers there now: `make ui` starts the MLflow UI on the workspace)"), link
    answering = format_summary(built_summary(mlflow_ui_answers=True))
    assert "make ui" not in answering and "  log " not in answering and "  steps " not in answering
    # Nothing listens on a port just closed; a listening socket answers.
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert ui_answers(f"http://127.0.0.1:{port}")
    assert not ui_answers(f"http://127.0.0.1:{port}/")


def test_the_libraries_messages_go_to_the_log_file_and_spark_s_jvm_is_pointed_at_it(
    tmp_path, capfd, monkeypatch
) -> None:
    import logging
    import os

    from imagelake.infra import console

    saved = {
        name: (logger.handlers[:], logger.propagate, logger.level)
        for name in console.LIBRARY_LOGGERS
        for logger in [logging.getLogger(name)]
    }
    for variable in ("MLFLOW_CONFIGURE_LOGGING", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(console, "_log", {})
    assert console.spark_java_option() == "" and console.log_file() is None  # no log file named: Spark's default
    try:
        path = console.send_library_output_to(console.new_log_path(tmp_path / "ws", "imagelake-pipeline"))
        assert path.parent == tmp_path / "ws" / "logs" and path.name.startswith("imagelake-pipeline-")
        logging.getLogger("mlflow.store.db.utils").info("Creating initial MLflow database tables...")
        logging.getLogger("ray").addHandler(logging.StreamHandler())  # as `import ray` does
        console.claim_loggers("ray")
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
        out, err = capfd.readouterr()
        assert "MLflow database" not in out + err and "Ray instance" not in out + err
        logged = path.read_text()
        assert "Creating initial MLflow database tables" in logged and "Started a local Ray instance" in logged
        assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == os.environ["MLFLOW_CONFIGURE_LOGGING"] == "false"
        option = console.spark_java_option()
        config = path.parent / f"{path.stem}.log4j2.properties"
        assert option == f"-Dlog4j2.configurationFile={config.as_uri()}"
        assert f"appender.file.fileName = {path}" in config.read_text()
    finally:
        for name, (handlers, propagate, level) in saved.items():
            logger = logging.getLogger(name)
            for handler in logger.handlers:
                if handler not in handlers:
                    handler.close()
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)
