"""Stage results that are reused when right: keyed on data (table version, listing), code and the settings that matter;
refresh; a report of why."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from imagelake.flows.pipeline import pipeline
from imagelake.flows.score import score_flow
from imagelake.infra.settings import load_settings
from imagelake.infra.spark import spark_asks
from imagelake.tasks import code_graph
from imagelake.tasks.stage import explain, key_parts, stage_outcomes
from imagelake.tasks.stages.summary import RENAMED_KEYS, results_keys, results_report
from tests.lake import copy_digits

ALL = ["ingest", "resize", "write", "split", "cache", "train", "promote"]


def test_explain_names_what_changed() -> None:
    code = {f"code tasks/m{i}.py": "a" for i in range(5)}
    parts = {**code, "input listed": "b", "setting image_size": "32", "table version": "0"}
    assert explain(None, "k", parts, False) == "no earlier run of this stage in these results"
    assert explain({"key": "k", "parts": parts}, "k", parts, False).startswith("same code")
    assert explain({"key": "k", "parts": parts}, "k", parts, True).startswith("refresh requested")
    changed = explain(
        {"key": "j", "parts": {**parts, "setting image_size": "64", "code tasks/m1.py": "z"}}, "k", parts, False
    )
    assert changed == "code tasks/m1.py changed; setting image_size changed 64 -> 32"
    many = explain({"key": "j", "parts": {**parts, **dict.fromkeys(code, "z")}}, "k", parts, False)
    assert many == "code of 5 files changed (tasks/m0.py, tasks/m1.py, tasks/m2.py, ...)"
    # A key recorded by an imagelake that keyed the code as one digest: one reason, not one for each file.
    earlier = {"code": "old", "input listed": "b", "setting image_size": "32", "table version": "0"}
    assert explain({"key": "j", "parts": earlier}, "k", parts, False) == (
        "code changed (the last key was made by an earlier imagelake)"
    )


def test_store_uris_enter_the_key_as_digests_only() -> None:
    settings = load_settings(overrides={"mlflow_tracking_uri": "postgresql://ml-pipeline@db.internal/mlflow"})
    parts = key_parts(pipeline.fn, {"settings": settings}, ("tracking_uri", "image_size"))
    assert (
        "ml-pipeline" not in str(parts)
        and "db.internal" not in str(parts)
        and parts["setting tracking_uri"].startswith("digest ")
    )
    other = key_parts(
        pipeline.fn,
        {"settings": load_settings(overrides={"mlflow_tracking_uri": "postgresql://ml-pipeline@db2.internal/mlflow"})},
        ("tracking_uri",),
    )
    assert other["setting tracking_uri"] != parts["setting tracking_uri"], "a new store is still a miss"


STAGE_MODULES = [
    f"imagelake.tasks.stages.{name}" for name in ("ingest", "resize", "write", "split", "cache", "train")
] + [f"imagelake.tasks.stages.{name}" for name in ("promote", "score", "summary", "maintain", "retention")]


def copy_code(folder: Path) -> Path:
    """A copy of imagelake's source (flows/, tasks/, infra/) under FOLDER, to edit without touching the real one."""
    for name, source in code_graph.code_folders().items():
        shutil.copytree(source, folder / name.rpartition(".")[2], ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def stage_keys(folders: dict[str, Path]) -> dict[str, str]:
    return {module: code_graph.code_digest(module, folders) for module in STAGE_MODULES}


def test_a_stage_s_code_key_changes_with_each_file_it_reaches_and_only_those(tmp_path: Path) -> None:
    """Editing any file of imagelake changes the code key of exactly the stages whose module reaches it through
    imports; the train stage's key covers the network, the training loop, the augmentation and the loader; a file no
    stage reaches (the CLI) changes no key."""
    folders = code_graph.folders_under(copy_code(tmp_path / "code"))
    before = stage_keys(folders)
    reaches = {module: set(code_graph.repo_files(module, folders)) for module in STAGE_MODULES}
    edited_any = set()
    for path in sorted((tmp_path / "code").rglob("*.py")):
        shown = str(path.relative_to(tmp_path / "code"))
        text = path.read_text(encoding="utf-8")
        path.write_text(text + "\n_edited = 1\n", encoding="utf-8")
        changed = {module for module, key in stage_keys(folders).items() if key != before[module]}
        path.write_text(text, encoding="utf-8")
        assert changed == {module for module in STAGE_MODULES if shown in reaches[module]}, shown
        edited_any |= changed
    assert edited_any == set(STAGE_MODULES)
    for worker in ("model", "train_loop", "augment", "loader"):
        assert f"tasks/worker/{worker}.py" in reaches["imagelake.tasks.stages.train"], worker
    assert not any("flows/cli.py" in files for files in reaches.values())


def test_a_stage_s_code_key_reads_the_program_not_its_comments_docstrings_or_layout(tmp_path: Path) -> None:
    """A comment, a docstring or a line break in a module every stage reaches (the settings) changes no stage's key; a
    changed statement of the network changes the train stage's key and not the resize stage's."""
    folders = code_graph.folders_under(copy_code(tmp_path / "code"))
    before = stage_keys(folders)
    settings = tmp_path / "code" / "infra" / "settings.py"
    text = settings.read_text(encoding="utf-8")
    assert '"""' in text and "\ndef " in text
    for edited in (
        text.replace("\ndef ", "\n# a comment added\ndef ", 1),
        text.replace('"""', '"""A docstring edited. ', 1),
        text.replace("\ndef ", "\n\n\ndef ", 1),
    ):
        settings.write_text(edited, encoding="utf-8")
        assert stage_keys(folders) == before
    settings.write_text(text, encoding="utf-8")

    model = tmp_path / "code" / "tasks" / "worker" / "model.py"
    model.write_text(model.read_text(encoding="utf-8") + "\n_EDITED = 1\n", encoding="utf-8")
    after = stage_keys(folders)
    assert after["imagelake.tasks.stages.train"] != before["imagelake.tasks.stages.train"]
    assert after["imagelake.tasks.stages.resize"] == before["imagelake.tasks.stages.resize"]


def test_a_stage_s_code_key_covers_every_module_its_modules_hold_code_of() -> None:
    """Read from the running code rather than the source: every module, function or class of imagelake that a module of
    a stage's key holds (imported, at any depth) comes from a module also in that key, so the graph misses no import."""
    import importlib
    import inspect

    for stage_module in STAGE_MODULES:
        importlib.import_module(stage_module)
        keyed = set(code_graph.reached(stage_module))
        for name in keyed:
            # Imported here too where the stage imports it only inside a function (the registry's served model).
            for value in vars(importlib.import_module(name)).values():
                if not (callable(value) or inspect.ismodule(value)):
                    continue
                origin = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
                # A package's submodules are its attributes once anything imports them: not an import of its own.
                if isinstance(origin, str) and origin.startswith("imagelake.") and not origin.startswith(f"{name}."):
                    assert origin in keyed, f"{name} holds {origin}, which the key of {stage_module} leaves out"


def test_results_report_says_reused_or_computed_and_why() -> None:
    states = {"ingest": "Cached", "resize": "Completed", "write": "Completed", "summarize": "Running"}
    reasons = {
        "ingest": "same code, inputs and settings as the last run",
        "resize": "table version changed None -> 0",
        "write": "same code, inputs and settings as the last run",
    }
    report = results_report(states, reasons)
    assert [(row["stage"], row["result"]) for row in report] == [
        ("ingest", "reused"),
        ("resize", "computed"),
        ("write", "computed"),
    ]
    assert report[1]["why"] == "table version changed None -> 0"
    assert "left no result" in report[2]["why"]
    keys = results_keys(report)
    assert keys["results"] == report and keys["results_reused"] == ["ingest"]
    # The summary's old keys stay, in their old form, and the summary says what they became.
    assert keys["deprecated_keys"] == RENAMED_KEYS == {"cache": "results", "cache_hits": "results_reused"}
    assert keys["cache_hits"] == ["ingest"]
    assert [(row["stage"], row["cache"]) for row in keys["cache"]] == [
        ("ingest", "hit"),
        ("resize", "miss"),
        ("write", "miss"),
    ]


def cache_line(summary: dict):
    """The cache line of SUMMARY's run and each split's manifest for the run's table version."""
    from imagelake.tasks.data.cache_files import CacheLine

    line = CacheLine(summary["cache_dir"])
    return line, line.read(summary["delta_version"])


def part_files(summary: dict, split: str) -> list[Path]:
    """The Parquet files SPLIT's manifest names for SUMMARY's run."""
    line, manifest = cache_line(summary)
    return [Path(line.root) / name for name in manifest[split]["files"]]


def cut_short(path: Path) -> None:
    """Rewrite a Parquet file without its last row."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows - 1), path)


def damage_inside(path: Path) -> None:
    """Flip bytes in the middle of a Parquet file, its size and footer kept (its rows still count right)."""
    with path.open("r+b") as handle:
        handle.seek(path.stat().st_size // 3)
        data = handle.read(16)
        handle.seek(path.stat().st_size // 3)
        handle.write(bytes(b ^ 0xFF for b in data))


def rows_cached(summary: dict) -> dict[str, int]:
    """Rows in the files each split's manifest names, for the run's table version."""
    line, manifest = cache_line(summary)
    return {split: line.rows_in(m["files"]) for split, m in manifest.items()}


def run(source: Path, overrides: dict, **kwargs) -> tuple[dict, dict[str, str]]:
    summary = pipeline(str(source), overrides=overrides, **kwargs)
    return summary, {row["stage"]: row["why"] for row in summary["results"] if row["result"] == "computed"}


def asked_for_spark_since(before: dict[str, int]) -> dict[str, int]:
    """The stages that asked for the process's SparkSession since BEFORE (`spark_asks()`), with how often. The test
    process shares one session, so a stage that asks gets it at once: what a run's own process would start is the
    asking."""
    return {stage: n - before.get(stage, 0) for stage, n in spark_asks().items() if n > before.get(stage, 0)}


@pytest.mark.slow
def test_same_data_hits_new_file_reruns_from_ingest_new_size_from_resize(
    prefect_api: str, digits_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1", "2", "3", "4"), per_label=12)
    results = tmp_path / "results"
    overrides = {
        "workspace": str(tmp_path / "ws"),
        "results_root": str(results),
        "image_size": 16,
        "max_epochs": 1,
        "num_workers": 1,
        "batch_size": 16,
        "model_name": "digits-cache",
    }

    first, missed = run(source, overrides)
    assert sorted(missed) == sorted(ALL) and first["results_reused"] == []
    assert all(why == "no earlier run of this stage in these results" for why in missed.values())
    assert (results / "cache-keys" / "train.json").is_file() and len(list(results.iterdir())) > len(ALL), (
        "results persist where configured"
    )

    # The run that follows a first write: the listing is the same, but the table moved to v0, so resize checks again
    # (decoding nothing); everything downstream of the unchanged table version reuses its stored result.
    asked = spark_asks()
    second, missed = run(source, overrides)
    assert second["results_reused"] == ["ingest", "split", "cache", "train", "promote"], second["results"]
    # Resize finds the tables in step with the listing and write has nothing to land: no stage asks for Spark, so a
    # run in a process of its own (a scheduled run) starts none.
    assert asked_for_spark_since(asked) == {}
    assert missed["resize"] == "table version changed None -> 0"
    assert (second["files_decoded"], second["delta_version"], second["model_version"]) == (
        0,
        first["delta_version"],
        first["model_version"],
    )

    # Same data again, with a setting that changes no stage's output: every stage reuses its result.
    third, missed = run(source, {**overrides, "spark_log_level": "WARN"})
    assert third["results_reused"] == ALL and missed == {}
    assert third["model_version"] == first["model_version"]

    # The code as an upgrade changes it (the keys read a copy of imagelake's source, edited): the CLI's help text, which
    # no stage reaches, and a comment in the settings, which every stage reaches, recompute nothing; a statement of the
    # promote stage, which only that stage reaches, runs it again on the training it reuses. (That the train stage's key
    # covers the training loop and the network its Ray workers run is checked on the keys themselves, above.)
    copy = copy_code(tmp_path / "code")
    monkeypatch.setattr(code_graph, "code_folders", lambda: code_graph.folders_under(copy))
    cli = copy / "flows" / "cli.py"
    cli.write_text(cli.read_text(encoding="utf-8").replace('help="', 'help="(edited) ', 1), encoding="utf-8")
    settings_file = copy / "infra" / "settings.py"
    settings_file.write_text("# a comment added\n" + settings_file.read_text(encoding="utf-8"), encoding="utf-8")
    unrelated, missed = run(source, overrides)
    assert unrelated["results_reused"] == ALL and missed == {}, unrelated["results"]
    promote_code = copy / "tasks" / "stages" / "promote.py"
    promote_code.write_text(
        promote_code.read_text(encoding="utf-8") + "\n_CHANGED = 1  # a change to the promote stage\n", encoding="utf-8"
    )
    promoted_again, missed = run(source, overrides)
    assert sorted(missed) == ["promote"], promoted_again["results"]
    assert missed["promote"] == "code tasks/stages/promote.py changed"
    assert (promoted_again["mlflow_run_id"], promoted_again["model_version"]) == (
        third["mlflow_run_id"],
        third["model_version"],
    )
    monkeypatch.undo()

    # A part file of the cached train split cut short, then one deleted (a cleaned disk): the cache stage's result is
    # no result, the report says why, and the split is written again whole; training never sees the partial split.
    damaged = third
    for damage, why in (
        (cut_short, r"the cached train split .* holds \d+ rows where its table version has \d+"),
        (Path.unlink, r"needs file://.*\.parquet, which is gone"),
        (damage_inside, r"the cached train split .* names .*\.parquet, which is damaged"),
    ):
        damage(part_files(damaged, "train")[0])
        damaged, missed = run(source, overrides)
        assert re.search(f"stored result changed .* -> {why}", missed["cache"]), damaged["results"]
        assert damaged["split_counts"] == third["split_counts"] and damaged["model_version"] == third["model_version"]
        assert rows_cached(damaged) == damaged["split_counts"], "the cache holds every planned row again"

    # One new file: ingest onward re-runs, and only that file is decoded.
    shutil.copy(sorted((digits_dir / "5").glob("*.png"))[0], source / "4" / "new.png")
    fourth, missed = run(source, overrides)
    assert sorted(missed) == sorted(ALL), fourth["results"]
    assert missed["ingest"] == "source listing changed"
    assert (fourth["files_decoded"], fourth["delta_version"]) == (1, first["delta_version"] + 1)
    assert fourth["model_version"] != first["model_version"]

    # A new image size: the listing is reused, resize onward re-runs.
    fifth, missed = run(source, {**overrides, "image_size": 20})
    assert fifth["results_reused"] == ["ingest"]
    assert sorted(missed) == sorted(set(ALL) - {"ingest"})
    assert "setting image_size changed 16 -> 20" in missed["resize"]
    assert fifth["files_decoded"] == fourth["rows"]
    # The gate compared the 20 px candidate with the 16 px champion on the test rows decoded again at 16 px.
    assert re.search(r"(beats|does not beat) champion \d\.\d{4}", fifth["promotion_decision"]), fifth[
        "promotion_decision"
    ]

    # Another resize mode at a size the table holds is refused before anything is decoded: one size, one crop.
    with pytest.raises(Exception, match=r"holds its 16 px images cut by resize_mode=letterbox"):
        run(source, {**overrides, "resize_mode": "center_crop"})

    # refresh: every stage recomputes though a stored result of each is there.
    sixth, missed = run(source, {**overrides, "image_size": 20}, refresh=True)
    assert sixth["results_reused"] == [] and set(missed.values()) == {
        "refresh requested: recomputed whatever results are stored"
    }
    # Training really ran again, from scratch: a new Ray run and MLflow run, not a resume of the cached one.
    assert (
        sixth["mlflow_run_id"] != fifth["mlflow_run_id"]
        and Path(sixth["checkpoint"]).parent.parent != Path(fifth["checkpoint"]).parent.parent
    )

    # Batch scoring with the champion these runs registered (`imagelake score`'s flow): the alias resolved at each run,
    # the score stage a hit while the source has not changed, a miss that answers only a new file, and a miss again
    # (everything answered anew) once the predictions table is gone.
    landing = tmp_path / "landing"
    landing.mkdir()
    for path in sorted(source.rglob("*.png"))[:6]:
        shutil.copy(path, landing / f"{path.parent.name}-{path.name}")

    def score(folder: Path) -> tuple[dict, str]:
        state = score_flow("digits-cache@champion", str(folder), overrides=overrides, return_state=True)
        outcomes, _ = stage_outcomes(str(state.state_details.flow_run_id))
        return state.result(), outcomes["score"]

    scored, outcome = score(landing)
    assert scored["model"].startswith("digits-cache/") and (scored["answered"], scored["result_reused"], outcome) == (
        6,
        False,
        "Completed",
    )
    again, outcome = score(landing)
    assert (again["answered"], again["predictions_version"], again["result_reused"], outcome) == (
        0,
        None,
        True,
        "Cached",
    )
    shutil.copy(sorted((digits_dir / "9").glob("*.png"))[0], landing / "new.png")
    grown, outcome = score(landing)
    assert (grown["answered"], grown["predictions_version"], outcome) == (
        1,
        scored["predictions_version"] + 1,
        "Completed",
    )
    shutil.rmtree(grown["predictions_uri"])
    anew, outcome = score(landing)
    assert (anew["answered"], outcome) == (7, "Completed")
