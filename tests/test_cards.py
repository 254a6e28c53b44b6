"""Per-class metrics, the dataset card, the model card, the learning-rate schedule and progress lines."""

from __future__ import annotations

import math
import re
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from imagelake.tasks.data.cache_files import label_samples, split_files
from imagelake.tasks.data.resize_executor import PROGRESS_FOLDER, files_done
from imagelake.tasks.progress import Every, rate_line
from imagelake.tasks.registry.cards import (
    confusion_matrix,
    dataset_card,
    dataset_card_markdown,
    metric_keys,
    model_card,
    per_class_metrics,
    per_class_table,
    sample_grid,
)
from imagelake.tasks.stages.cache import cache_splits
from imagelake.tasks.stages.split import plan_splits
from imagelake.tasks.worker.model import warmup_cosine
from tests.lake import Lake, copy_digits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_class_metrics_add_up_to_the_confusion_matrix(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, 200)
    predicted = np.where(rng.random(200) < 0.7, labels, rng.integers(0, 4, 200))
    matrix = confusion_matrix(labels, predicted, 4)
    rows = per_class_metrics(matrix, ["a", "b", "c", "d"])
    assert [r["support"] for r in rows] == np.bincount(labels, minlength=4).tolist()
    assert [r["predicted"] for r in rows] == np.bincount(predicted, minlength=4).tolist()
    assert sum(r["correct"] for r in rows) == int((labels == predicted).sum())
    for index, row in enumerate(rows):
        truth, guess = labels == index, predicted == index
        assert row["precision"] == pytest.approx((truth & guess).sum() / guess.sum())
        assert row["recall"] == pytest.approx((truth & guess).sum() / truth.sum())
        assert row["f1"] == pytest.approx(2 * row["precision"] * row["recall"] / (row["precision"] + row["recall"]))


def test_per_class_metrics_of_a_class_never_seen_or_predicted_are_zero_not_errors() -> None:
    rows = per_class_metrics(np.array([[3, 0, 0], [1, 2, 0], [0, 0, 0]]), ["x", "y", "z"])
    assert rows[2] == {
        "label": "z",
        "precision": 0.0,
        "recall": 0.0,
        "f1": 0.0,
        "support": 0,
        "predicted": 0,
        "correct": 0,
    }
    with pytest.raises(ValueError, match="does not fit 2 class names"):
        per_class_metrics(np.zeros((3, 3), dtype=int), ["x", "y"])
    keys = metric_keys(["cat/dog:1 (b)", "chat noir", "chat:noir", "chat?noir", "x" * 300, "Straße"])
    assert keys[:4] == ["cat/dog_1 _b_", "chat noir", "chat_noir", "chat_noir_3"], "clashing names stay apart"
    assert len(keys[4]) == 200 and keys[5] == "Straße" and len(set(keys)) == 6


def test_label_text_reaches_the_cards_markdown_escaped() -> None:
    """A label is any folder name: in a card's tables it stays one cell, and it opens no HTML, link or emphasis."""
    from imagelake.tasks.stages.summary import summary_markdown
    from tests.test_summary import built_summary

    label = "a|b <img src=x onerror=alert(1)> *x* [y](z)\nnext"
    per_class = per_class_table([{"label": label, "precision": 1.0, "recall": 1.0, "f1": 1.0, "support": 3}])
    card = dataset_card_markdown(dataset_card("t", 0, 8, {"train": {label: 2}, "val": {label: 1}}, {}))
    summary = summary_markdown(built_summary(labels=[label]), "link")
    for markdown in (per_class, card, summary):
        rows = [line for line in markdown.splitlines() if "img" in line]
        assert rows and all("<" not in row and "\\|" in row for row in rows), rows
    cells = [cell for cell in re.split(r"(?<!\\)\|", per_class.splitlines()[2])[1:-1]]
    assert len(cells) == 5 and cells[0].strip().startswith("a\\|b &lt;img")


def test_dataset_card_counts_and_markdown() -> None:
    card = dataset_card(
        "/t/images", 3, 32, {"train": {"a": 8, "b": 4}, "val": {"a": 1}, "test": {"b": 2}}, {"not_an_image": 2}
    )
    assert card["images_per_label"] == {"train": {"a": 8, "b": 4}, "val": {"a": 1, "b": 0}, "test": {"a": 0, "b": 2}}
    assert card["images_per_split"] == {"train": 12, "val": 1, "test": 2} and card["imbalance"] == round(9 / 6, 3)
    text = dataset_card_markdown(card, "http://mlflow/samples.png")
    assert "| a | 8 | 1 | 0 | 9 |" in text and "| not_an_image | 2 |" in text and "(http://mlflow/samples.png)" in text


def test_the_sample_grid_of_many_labels_shows_the_first_forty() -> None:
    samples = {f"label{i:02d}": np.full((2, 4, 4, 3), i, dtype=np.uint8) for i in range(45)}
    axis = sample_grid(samples).get_axes()[0]
    assert axis.get_title().endswith("(first 40 of 45 labels)") and len(axis.get_yticks()) == 40


def test_model_card_names_data_settings_metrics_and_decision() -> None:
    rows = per_class_metrics(np.array([[5, 1], [0, 4]]), ["cat", "dog"])
    data = {
        "table": "/t/images",
        "version": 7,
        "image_size": 64,
        "counts": {"train": 80, "val": 10, "test": 10},
        "labels": ["cat", "dog"],
    }
    card = model_card(
        "m", "3", data, {"max_epochs": "8", "seed": "42"}, {"accuracy": 0.9}, rows, "no champion yet", "champion"
    )
    for expected in (
        "# m v3",
        "version 7",
        '"test": 10',
        "| max_epochs | 8 |",
        "| accuracy | 0.9000 |",
        "| cat | 1.000 | 0.833 |",
        "**champion**: no champion yet",
    ):
        assert expected in card


def test_learning_rate_warms_up_then_decays_to_zero() -> None:
    factors = [warmup_cosine(step, 100, 10) for step in range(101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0) and factors[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))
    assert factors[100] == pytest.approx(0.0, abs=1e-12)
    assert factors[55] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(5, 0, 0) == 1.0, "a module without a schedule keeps its learning rate"


def test_progress_reports_while_the_block_runs_and_never_after(tmp_path: Path) -> None:
    calls: list[float] = []
    with Every(lambda: calls.append(time.monotonic()), logger=__import__("logging").getLogger("t"), seconds=0.05):
        deadline = time.monotonic() + 30
        while len(calls) < 2 and time.monotonic() < deadline:  # however slow the machine: two reports, then leave
            time.sleep(0.01)
        assert len(calls) >= 2, "reports while the block runs"
    count = len(calls)
    # The reporting thread has ended as the block did (no report can come after), and none came since.
    assert not any(t.name == "imagelake-progress" for t in threading.enumerate())
    assert count == len(calls), "no report once the block ended"
    folder = tmp_path / PROGRESS_FOLDER
    folder.mkdir()
    (folder / "00000").write_text("40")
    (folder / "00001").write_text("2")
    assert files_done(str(tmp_path)) == 42 and files_done(str(tmp_path / "none")) == 0
    assert rate_line("resize", 42, 84, 2.0, "files") == "resize: 42 of 84 files (50%), 21 files/s"


def test_a_progress_report_reaches_the_prefect_api_the_command_chose() -> None:
    # The reporting thread sees the starter's Prefect settings: a report logged for "no API" made Prefect start a
    # temporary server of its own, beside the command's, on the same database.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    seen: list[str | None] = []
    chosen = "http://127.0.0.1:9/api"
    with (
        temporary_settings(updates={PREFECT_API_URL: chosen}),
        Every(lambda: seen.append(PREFECT_API_URL.value()), logger=__import__("logging").getLogger("t"), seconds=0.01),
    ):
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    assert seen and set(seen) == {chosen}, seen


def test_the_dataset_card_counts_match_the_table_and_the_samples_are_its_pixels(
    spark, lake: Lake, digits_dir: Path, tmp_path: Path, settings
) -> None:
    copy_digits(digits_dir, tmp_path / "src", labels=("0", "1", "2"), per_label=12)
    _, _, written = lake.run(tmp_path / "src")
    plan = plan_splits(
        spark, written, settings.model_copy(update={"image_size": 24, "val_fraction": 0.2, "test_fraction": 0.2})
    )
    cached = cache_splits(spark, plan, 24, str(tmp_path / "cache"))
    card = dataset_card(cached.table_uri, cached.table_version, 24, cached.label_counts, cached.quarantined)
    for split, uri in cached.splits.items():
        labels = pq.read_table(split_files(uri)[1], columns=["label"]).column("label").to_numpy()
        assert card["images_per_label"][split] == {
            name: int((labels == i).sum()) for i, name in enumerate(cached.labels)
        }
    assert sum(card["images_per_split"].values()) == len(lake.rows()) == 36
    samples = label_samples(cached.splits["train"], 24, cached.labels, per_label=3)
    assert set(samples) == {"0", "1", "2"} and all(
        s.shape[1:] == (24, 24, 3) and 1 <= len(s) <= 3 for s in samples.values()
    )
    assert sample_grid(samples).get_axes(), "a figure with the grid"
