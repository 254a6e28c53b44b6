"""Stage retries: a transient failure is retried and the run completes; a permanent one fails after one attempt."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow
from prefect.cache_policies import NO_CACHE
from ray.train import WorkerGroupError

from infra.settings import SettingsError
from tasks.stage import stage
from tasks.worker.train_loop import CheckpointUnusable
from tasks.rules.bad_files import TooManyBadFiles


ERRORS = {
    "transient": OSError("the object store timed out"),
    "bad settings": SettingsError("image_size must be positive"),
    "too many bad files": TooManyBadFiles("3 of 3 files are bad (not_an_image: 3), over max_bad_fraction=0.2"),
    "unusable checkpoint": CheckpointUnusable("no checkpoint under ray_results/run loads: delete that folder"),
    # How a training worker's error reaches the driver: inside Ray Train's error, by rank.
    "unusable checkpoint on a worker": WorkerGroupError("Training failed", {1: CheckpointUnusable("no checkpoint loads: delete the run folder")}),
}


def attempts(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@stage("flaky", retries=2, backoff=0.05, cache_policy=NO_CACHE)
def flaky(log: str, error: str) -> str:
    """Fails on its first attempt with `error`, then succeeds."""
    path = Path(log)
    with path.open("a") as out:
        out.write("attempt\n")
    if attempts(path) == 1:
        raise ERRORS[error]
    return "done"


@flow
def one_stage(log: str, error: str) -> str:
    return flaky(log, error)


def test_a_transient_failure_is_retried_and_the_run_completes(prefect_api: str, tmp_path: Path) -> None:
    log = tmp_path / "transient.log"
    assert one_stage(str(log), "transient") == "done"
    assert attempts(log) == 2


@pytest.mark.parametrize("error", ["bad settings", "too many bad files", "unusable checkpoint", "unusable checkpoint on a worker"])
def test_a_permanent_failure_fails_after_one_attempt(prefect_api: str, tmp_path: Path, error: str) -> None:
    log = tmp_path / "permanent.log"
    with pytest.raises(type(ERRORS[error]), match=str(ERRORS[error]).split(" ")[0]):
        one_stage(str(log), error)
    assert attempts(log) == 1


@stage("writes-a-file", needs=lambda written: [written])
def writes_a_file(path: str, settings) -> str:
    with Path(path).with_suffix(".calls").open("a") as out:
        out.write("call\n")
    Path(path).write_text("the stage's output")
    return path


@flow
def one_stage_flow(stage_name: str, path: str, settings) -> dict:
    """Run one of this file's stages on PATH; how it ended and why it was a hit or a miss."""
    from infra.prefect_env import stage_results
    from prefect.context import FlowRunContext
    from tasks.stage import stage_outcomes

    with stage_results(settings):
        {"writes-a-file": writes_a_file, "reads-what-it-can": reads_what_it_can}[stage_name](path, settings)
    states, reasons = stage_outcomes(str(FlowRunContext.get().flow_run.id))
    return {"state": states[stage_name], "why": reasons[stage_name]}


def file_flow(path: str, settings) -> dict:
    return one_stage_flow("writes-a-file", path, settings)


def test_a_cached_result_whose_file_is_gone_is_a_miss_that_says_why(prefect_api: str, tmp_path: Path) -> None:
    from infra.settings import load_settings

    settings = load_settings(overrides={"workspace": str(tmp_path / "ws")})
    output = tmp_path / "out.txt"
    assert file_flow(str(output), settings)["state"] == "Completed"
    assert file_flow(str(output), settings)["state"] == "Cached"
    output.unlink()  # a cleaned disk, a moved workspace
    again = file_flow(str(output), settings)
    assert again["state"] == "Completed" and output.exists()
    assert again["why"] == f"cached result changed None -> needs {output}, which is gone"
    assert file_flow(str(output), settings)["state"] == "Cached", "the new result is the cache from then on"
    assert len(output.with_suffix(".calls").read_text().splitlines()) == 2


@stage("reads-what-it-can", unfinished=lambda left: f"{left} file(s) could not be read then; read again" if left else None)
def reads_what_it_can(path: str, settings) -> int:
    with Path(path).with_suffix(".calls").open("a") as out:
        out.write("call\n")
    return int(Path(path).read_text())  # files this call could not read


def reading_flow(path: str, settings) -> dict:
    return one_stage_flow("reads-what-it-can", path, settings)


def test_a_cached_result_that_left_files_unread_is_a_miss_until_none_are(prefect_api: str, tmp_path: Path) -> None:
    from infra.settings import load_settings

    settings = load_settings(overrides={"workspace": str(tmp_path / "ws")})
    left = tmp_path / "left.txt"
    left.write_text("2")
    assert reading_flow(str(left), settings)["state"] == "Completed"
    again = reading_flow(str(left), settings)
    assert again["state"] == "Completed", "a result that left files unread is not reused: the next run reads them"
    assert again["why"] == "cached result changed None -> 2 file(s) could not be read then; read again"
    left.write_text("0")  # the store is back
    assert reading_flow(str(left), settings)["state"] == "Completed"
    assert reading_flow(str(left), settings)["state"] == "Cached", "a complete result is the cache from then on"
    assert len(left.with_suffix(".calls").read_text().splitlines()) == 3
