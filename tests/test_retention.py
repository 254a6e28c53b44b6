"""Retention: staging, stored stage results and checkpoints older than workspace_retention_hours go after a run;
what the next run reads first stays, whatever its age."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import fsspec
import pytest

from imagelake.flows.pipeline import pipeline
from imagelake.infra.settings import load_settings
from imagelake.tasks.stages.retention import is_old, prune_workspace, remove
from tests.lake import copy_digits

HOUR = 3600.0


def age(path: Path, hours: float) -> None:
    """Set PATH's (and everything under it) modification time HOURS back."""
    stamp = time.time() - hours * HOUR
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(item, (stamp, stamp))


def put(path: Path, hours: float, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    age(path, hours)
    return path


def test_retention_removes_old_stage_files_and_keeps_what_the_next_run_reads(tmp_path: Path) -> None:
    settings = load_settings(overrides={"workspace": str(tmp_path / "ws"), "workspace_retention_hours": 24})
    staging, results, checkpoints = (
        Path(settings.staging_uri),
        Path(settings.results_uri),
        Path(settings.ray_storage_path),
    )
    old, young = 48, 1
    gone = [
        put(staging / "listing-aaaa.parquet", old),
        put(staging / ".listing-set-aside-by-a-crash.parquet", old),
        put(staging / "ingest-aaaa.parquet", old),
        put(staging / ".ingest-aaaa.parquet.set-aside-by-a-crash", old),
        put(staging / "resize-aaaa-32-letterbox" / "part-00000.parquet", old).parent,
        put(staging / "in-sync" / "0123456789abcdef", old),
        put(staging / "split-counts" / "t1" / "v3.json", old),
        put(results / "train-0123", old),
        put(checkpoints / "train-old" / "checkpoint_000000" / "checkpoint.ckpt", old).parent.parent,
    ]
    kept = [
        put(staging / "listing-bbbb.parquet", young),
        put(staging / "listing-in-step.parquet", old),  # named by the last-*.json below: the next run diffs against it
        put(staging / "resize-bbbb-32-letterbox" / "part-00000.parquet", young).parent,
        put(staging / "in-sync" / "fedcba9876543210", young),
        put(staging / "split-counts" / "t1" / "v12.json", old),  # each table's newest record carries the counts on
        put(staging / "split-counts" / "t2" / "v0.json", old),
        put(results / "train-4567", young),
        put(results / "cache-keys" / "train.json", old),
        put(checkpoints / "train-young" / "checkpoint_000000" / "checkpoint.ckpt", young).parent.parent,
        put(staging / "notes.txt", old),  # not a file any stage writes: not retention's to remove
        put(
            staging / "named" / "0123" / "4567.parquet", old
        ),  # a manifest's record of what it named: what it may retire
    ]
    # A resize folder with one old file and one just written is in use.
    put(staging / "resize-cccc-32-letterbox" / "part-00000.parquet", old)
    kept.append(put(staging / "resize-cccc-32-letterbox" / "part-00001.parquet", young).parent)
    # A run still training: its first checkpoint is old, its latest result is not.
    put(checkpoints / "train-long" / "checkpoint_000000" / "checkpoint.ckpt", old)
    kept.append(put(checkpoints / "train-long" / "result.json", young).parent)
    record = staging / "in-sync" / "last-key.json"
    kept.append(
        put(record, old, json.dumps({"versions": [3, None], "listing": str(staging / "listing-in-step.parquet")}))
    )
    age(staging / "in-sync" / "fedcba9876543210", young)

    removed = prune_workspace(settings)

    assert removed == {"staging": 7, "stage_results": 1, "training_runs": 1}
    assert [str(p) for p in gone if p.exists()] == []
    assert [str(p) for p in kept if not p.exists()] == []
    # Nothing is old at a longer retention.
    put(staging / "ingest-dddd.parquet", old)
    assert prune_workspace(
        load_settings(overrides={"workspace": str(tmp_path / "ws"), "workspace_retention_hours": 100})
    ) == {"staging": 0, "stage_results": 0, "training_runs": 0}


def test_two_runs_ending_together_may_both_reach_for_one_old_path(tmp_path: Path) -> None:
    fs = fsspec.filesystem("file")
    paths = [str(put(tmp_path / "staging" / f"ingest-{i}.parquet", 48)) for i in range(3)]
    (tmp_path / "staging" / "resize-a").mkdir()
    paths.append(str(tmp_path / "staging" / "resize-a"))
    Path(paths[1]).unlink()  # the other run's retention came first
    assert remove(fs, paths) == [paths[0], paths[2], paths[3]]
    assert remove(fs, paths) == []
    # A path that goes while retention looks at it (another run's retention, or Ray replacing a checkpoint's file) is
    # not old: nothing to remove, and no error that would fail the run.
    assert not is_old(fs, paths[1], time.time())


@pytest.mark.slow
def test_a_run_removes_what_retention_lets_go_and_the_next_run_still_hits_its_cache(
    prefect_api: str, digits_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1", "2", "3"), per_label=10)
    overrides = {
        "workspace": str(tmp_path / "ws"),
        "image_size": 16,
        "max_epochs": 1,
        "num_workers": 1,
        "batch_size": 16,
        "model_name": "digits-retention",
    }
    settings = load_settings(overrides=overrides)
    staging, results, checkpoints = (
        Path(settings.staging_uri),
        Path(settings.results_uri),
        Path(settings.ray_storage_path),
    )

    first = pipeline(str(source), overrides=overrides)
    assert first["removed_by_retention"] == {"staging": 0, "stage_results": 0, "training_runs": 0}, (
        "the default keeps a week"
    )
    first_files = {p for folder in (staging, results) for p in folder.iterdir() if p.name != "cache-keys"}
    first_ray_run = Path(first["checkpoint"]).parent.parent
    assert first_ray_run.parent == checkpoints and first_ray_run.is_dir()
    for folder in (staging, results, checkpoints):
        age(folder, 2)

    shutil.copy(sorted((digits_dir / "5").glob("*.png"))[0], source / "3" / "new.png")
    second = pipeline(str(source), overrides={**overrides, "workspace_retention_hours": 1})
    assert second["removed_by_retention"]["training_runs"] == 1 and not first_ray_run.exists()
    assert second["removed_by_retention"]["stage_results"] >= 7
    assert Path(second["checkpoint"]).is_file(), "this run's own checkpoint stays"
    left = {p for p in first_files if p.exists()}
    assert {p.name for p in left} <= {"in-sync", "split-counts"}, left

    # What the second run left is what a third run on the same data reads: the same hits as any run after a write
    # (resize and write check the new table version), training and promotion among them.
    third = pipeline(str(source), overrides={**overrides, "workspace_retention_hours": 1})
    assert third["results_reused"] == ["ingest", "split", "cache", "train", "promote"], third["results"]
    assert third["model_version"] == second["model_version"]


def test_maintain_applies_the_workspace_retention_too(prefect_api: str, tmp_path: Path) -> None:
    from imagelake.flows.maintain import maintain

    overrides = {"workspace": str(tmp_path / "ws"), "workspace_retention_hours": 24}
    settings = load_settings(overrides=overrides)
    old = put(Path(settings.staging_uri) / "ingest-aaaa.parquet", 48)
    young = put(Path(settings.results_uri) / "write-0123", 1)
    report = maintain(overrides=overrides)
    assert report["workspace"] == {"staging": 1, "stage_results": 0, "training_runs": 0}
    assert not old.exists() and young.exists()
