"""Pure decisions: split by hash, steps per epoch and batch sizes, content hash, stage keys (the promotion rule is in
test_registry)."""

from __future__ import annotations

import hashlib

import pytest

from imagelake.tasks.rules.splits import split_of
from imagelake.tasks.worker.loader import ShardTooSmall, batch_sizes, steps_per_epoch


def digest(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def test_split_is_stable_and_close_to_the_fractions() -> None:
    splits = [split_of(digest(i), 0.1, 0.2) for i in range(5000)]
    assert splits == [split_of(digest(i), 0.1, 0.2) for i in range(5000)]
    share = {name: splits.count(name) / len(splits) for name in ("train", "val", "test")}
    assert share["test"] == pytest.approx(0.2, abs=0.03)
    assert share["val"] == pytest.approx(0.1, abs=0.03)
    assert share["train"] == pytest.approx(0.7, abs=0.03)


@pytest.mark.parametrize("prefix,expected", [("00000000", "test"), ("20000000", "val"), ("ffffffff", "train")])
def test_split_boundaries(prefix: str, expected: str) -> None:
    # 0x20000000 / 2**32 = 0.125: past test (0.1), inside val (0.1 + 0.1).
    assert split_of(prefix + "0" * 56, 0.1, 0.1) == expected


def test_an_image_keeps_its_split_when_the_data_grows() -> None:
    before = {digest(i): split_of(digest(i), 0.1, 0.1) for i in range(100)}
    after = {digest(i): split_of(digest(i), 0.1, 0.1) for i in range(1000)}
    assert all(after[key] == value for key, value in before.items())


@pytest.mark.parametrize("bad", ["", "abc", "zzzzzzzz" + "0" * 56])
def test_split_rejects_what_is_not_a_hex_digest(bad: str) -> None:
    with pytest.raises(ValueError, match="sha256"):
        split_of(bad, 0.1, 0.1)


@pytest.mark.parametrize("shards,batch,steps", [([100], 10, 10), ([50, 50], 10, 5), ([51, 50], 10, 6), ([3, 2], 32, 1)])
def test_steps_per_epoch_fit_the_largest_shard(shards: list[int], batch: int, steps: int) -> None:
    assert steps_per_epoch(shards, batch) == steps
    assert steps * batch >= max(shards)


def test_steps_per_epoch_refuses_an_empty_shard() -> None:
    with pytest.raises(ValueError, match="empty shard"):
        steps_per_epoch([10, 0], 32)


@pytest.mark.parametrize("rows,steps", [(100, 10), (101, 10), (45, 6), (7, 7)])
def test_batch_sizes_cover_the_shard_exactly_once(rows: int, steps: int) -> None:
    sizes = batch_sizes(rows, steps)
    assert len(sizes) == steps and sum(sizes) == rows and max(sizes) - min(sizes) <= 1


def test_batch_sizes_refuse_a_shard_too_small_for_the_steps() -> None:
    with pytest.raises(ShardTooSmall, match="fewer workers"):
        batch_sizes(3, 4)


def test_what_a_run_did_stays_out_of_the_next_stage_key() -> None:
    from prefect.utilities.hashing import hash_objects

    from imagelake.tasks.results import Written

    first = Written(table_uri="/t", version=3, engine="delta-rs", rows=1797)
    rerun = Written(table_uri="/t", version=3, engine="delta-rs", rows=0)
    assert hash_objects(first) == hash_objects(rerun)
    assert hash_objects(first) != hash_objects(first.model_copy(update={"version": 4}))
    assert rerun.rows == 0


def latest_gpu_limits(arch: str) -> dict[str, float] | None:
    """The eager and compiled limits of ARCH's latest bench/results record that has both (all layers trained)."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "results" / f"gpu_{arch}_all.jsonl"
    found = None
    for line in path.read_text().splitlines() if path.exists() else []:
        figures = json.loads(line)["figures"]
        eager, compiled = (figures.get(f"limit_fused_{kind}_b256_w_images_per_s") for kind in ("eager", "compile"))
        if eager is not None and compiled is not None:
            found = {"eager": eager, "compiled": compiled}
    return found


def test_the_gpu_step_table_is_the_benchmarks_latest_measurement_and_picks_the_faster_path() -> None:
    from imagelake.tasks.rules.training import GPU_LIMITS, step_path

    for arch, limits in GPU_LIMITS.items():
        assert latest_gpu_limits(arch) == limits, f"{arch}: tasks/rules/training.py:GPU_LIMITS against bench/results"
        mode, why = step_path(arch, None, "default", gpu=True)
        faster = "eager" if limits["eager"] >= limits["compiled"] else "compiled"
        assert (mode is None) == (faster == "eager") and why.startswith(faster), (arch, why)
    assert step_path("mobilenet_v2", None, "default", gpu=True)[0] is None  # the default model: eager on a GPU
    assert step_path("efficientnet_b0", None, "reduce-overhead", gpu=True)[0] == "reduce-overhead"
    assert step_path("densenet121", None, "default", gpu=True) == (
        "default",
        "compiled (default): no measurement of densenet121; compiling was faster for most models measured",
    )
    # The settings win over the table; no GPU: eager.
    assert step_path("mobilenet_v2", True, "reduce-overhead", gpu=True)[0] == "reduce-overhead"
    assert step_path("resnet50", False, "default", gpu=True)[0] is None
    assert step_path("resnet50", "max-autotune", "default", gpu=True)[0] == "max-autotune"
    assert step_path("resnet50", None, "default", gpu=False) == (
        None,
        "eager: no GPU (compiling costs its start-up and does not pay on a CPU)",
    )
