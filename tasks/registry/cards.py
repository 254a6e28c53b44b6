"""What a run's data and model are, for people: per-class metrics, the dataset card, the model card.

Pure functions of counts, arrays and plain values: no MLflow, Spark or Prefect here.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from imagelake.tasks.rules.markdown import markdown_text
from imagelake.tasks.rules.promotion import BASELINE

if TYPE_CHECKING:
    from matplotlib.figure import Figure  # loaded by the function that draws (start-up)


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, classes: int) -> np.ndarray:
    """Counts of (true class, predicted class)."""
    matrix = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    return matrix


def per_class_metrics(matrix: np.ndarray, names: list[str]) -> list[dict[str, Any]]:
    """Precision, recall, F1 and support of every class, from a confusion matrix (rows true, columns predicted).

    A class never predicted has precision 0; a class absent from the split has recall 0 and support 0.
    """
    if matrix.shape != (len(names), len(names)):
        raise ValueError(f"a confusion matrix of {matrix.shape} does not fit {len(names)} class names")
    rows = []
    for index, name in enumerate(names):
        hits, predicted, actual = int(matrix[index, index]), int(matrix[:, index].sum()), int(matrix[index].sum())
        precision = hits / predicted if predicted else 0.0
        recall = hits / actual if actual else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        rows.append(
            {
                "label": name,
                "precision": precision,
                "recall": recall,
                "f1": f1,
                "support": actual,
                "predicted": predicted,
                "correct": hits,
            }
        )
    return rows


def metric_keys(names: list[str], limit: int = 200) -> list[str]:
    """Class names as MLflow accepts them inside a metric key (word characters, - . / and spaces), cut to `limit`
    characters and kept distinct (a name that clashes with an earlier one gets its index)."""
    keys: list[str] = []
    for index, name in enumerate(names):
        key = re.sub(r"[^\w\-./ ]", "_", name)[:limit]
        keys.append(f"{key[: limit - 8]}_{index}" if key in keys else key)
    return keys


def per_class_table(rows: list[dict[str, Any]]) -> str:
    """The per-class metrics as a markdown table."""
    lines = ["| label | precision | recall | F1 | support |", "|---|---|---|---|---|"]
    lines += [
        f"| {markdown_text(r['label'])} | {r['precision']:.3f} | {r['recall']:.3f} | {r['f1']:.3f} | {r['support']} |"
        for r in rows
    ]
    return "\n".join(lines)


def dataset_card(
    table_uri: str, version: int, image_size: int, label_counts: dict[str, dict[str, int]], quarantined: dict[str, int]
) -> dict[str, Any]:
    """The card's facts: images per label in each split (class balance), and quarantined files by reason."""
    labels = sorted({label for counts in label_counts.values() for label in counts})
    splits = {split: {label: counts.get(label, 0) for label in labels} for split, counts in label_counts.items()}
    totals = {split: sum(counts.values()) for split, counts in splits.items()}
    largest = max((sum(splits[s][label] for s in splits) for label in labels), default=0)
    smallest = min((sum(splits[s][label] for s in splits) for label in labels), default=0)
    return {
        "table": table_uri,
        "version": version,
        "image_size": image_size,
        "labels": labels,
        "images_per_label": splits,
        "images_per_split": totals,
        "imbalance": round(largest / smallest, 3) if smallest else None,
        "quarantined": dict(sorted(quarantined.items())),
    }


def dataset_card_of(cached: Any) -> dict[str, Any]:
    """The dataset card of a cached table version (a CachedSplits: its table, version, size and counts)."""
    return dataset_card(
        cached.table_uri, cached.table_version, cached.image_size, cached.label_counts, cached.quarantined
    )


def dataset_card_markdown(card: dict[str, Any], samples_link: str | None = None) -> str:
    """The dataset card as markdown: class balance per split, quarantine by reason, a link to the sample grid."""
    splits = list(card["images_per_label"])
    head = "| label | " + " | ".join(splits) + " | all |\n|---|" + "---|" * (len(splits) + 1)
    rows = [
        f"| {markdown_text(label)} | "
        + " | ".join(str(card["images_per_label"][s][label]) for s in splits)
        + f" | {sum(card['images_per_label'][s][label] for s in splits)} |"
        for label in card["labels"]
    ]
    rows.append(
        "| **all** | "
        + " | ".join(str(card["images_per_split"][s]) for s in splits)
        + f" | {sum(card['images_per_split'].values())} |"
    )
    quarantine = "\n".join(f"| {reason} | {count} |" for reason, count in card["quarantined"].items()) or "| none | 0 |"
    imbalance = f"largest class / smallest class: {card['imbalance']}" if card["imbalance"] else "a class has no images"
    samples = (
        f"\n\nSample images per label, as stored ({card['image_size']} px): [samples.png]({samples_link})"
        if samples_link
        else ""
    )
    return (
        f"## Dataset card\n\nDelta table `{card['table']}` version {card['version']}, {card['image_size']} "
        "px images.\n\n"
        f"### Images per label and split\n\n{head}\n" + "\n".join(rows) + f"\n\n{imbalance}\n\n"
        f"### Quarantined files by reason\n\n| reason | files |\n|---|---|\n{quarantine}{samples}\n"
    )


GRID_LABELS = 40  # rows of the sample grid: beyond this a figure is too tall to draw or read


def sample_grid(samples: dict[str, np.ndarray]) -> Figure:
    """One row per label (the first 40 in order) of sample images (N, H, W, 3 uint8), as the model sees them."""
    from matplotlib.figure import Figure

    labels = sorted(samples)[:GRID_LABELS]
    size = max((s.shape[1] for s in samples.values() if len(s)), default=8)
    columns = max((len(s) for s in samples.values()), default=1)
    mosaic = np.full((len(labels) * (size + 2), columns * (size + 2), 3), 255, dtype=np.uint8)
    for row, label in enumerate(labels):
        for column, image in enumerate(samples[label]):
            top, left = row * (size + 2) + 1, column * (size + 2) + 1
            mosaic[top : top + image.shape[0], left : left + image.shape[1]] = image
    figure = Figure(figsize=(1 + 0.9 * columns, 0.5 + 0.9 * max(1, len(labels))))
    axis = figure.subplots()
    axis.imshow(mosaic, interpolation="nearest")
    axis.set_yticks([row * (size + 2) + size / 2 for row in range(len(labels))], labels)
    axis.set_xticks([])
    shown = "" if len(samples) <= GRID_LABELS else f" (first {GRID_LABELS} of {len(samples)} labels)"
    axis.set_title(f"samples per label, as stored in the table{shown}")
    figure.tight_layout()
    return figure


def model_card(
    model_name: str,
    version: str,
    data: dict[str, Any],
    params: dict[str, str],
    metrics: dict[str, float],
    per_class: list[dict[str, Any]],
    decision: str,
    alias: str,
    baseline: float | None = None,
    started: str = "",
) -> str:
    """The registered version's description: its data, how it was trained, how it scored (and by how much it beats its
    run's plain baseline), and the promotion decision."""
    settings = "\n".join(f"| {key} | {value} |" for key, value in sorted(params.items()))
    weights = f"Weights: {markdown_text(started)}.\n\n" if started else ""
    scores = "\n".join(f"| {key} | {value:.4f} |" for key, value in metrics.items())
    if baseline is not None:
        scores += (
            f"\n| baseline accuracy ({BASELINE}) | {baseline:.4f} |\n| margin over the baseline | "
            f"{metrics['accuracy'] - baseline:+.4f} |"
        )
    return (
        f"# {model_name} v{version}\n\n## Data\n\nDelta table `{data['table']}` version {data['version']}, "
        f"{data['image_size']} px, "
        f"rows per split {json.dumps(data['counts'], sort_keys=True)}, labels "
        f"{', '.join(markdown_text(label) for label in data['labels'])}.\n\n"
        f"## Training settings\n\n{weights}| setting | value |\n|---|---|\n{settings}\n\n"
        f"## Test metrics\n\n| metric | value |\n|---|---|\n{scores}\n\n{per_class_table(per_class)}\n\n"
        f"## Promotion\n\n**{alias}**: {decision}\n"
    )
