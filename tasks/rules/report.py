"""Numbers as a person reads them in a run's report and the CLI's summary: counts with thousands separated,
accuracies to three places, durations in seconds to one place, then in minutes. Pure: stdlib only."""

from __future__ import annotations


def count(number: int) -> str:
    """1797 -> '1,797'."""
    return f"{number:,}"


def accuracy(value: float | None) -> str:
    """0.9901960784313726 -> '0.990'; '-' where there is none."""
    return "-" if value is None else f"{value:.3f}"


def margin(value: float, baseline: float) -> str:
    """VALUE over BASELINE as shown beside them, from the rounded figures: 0.9902 over 0.9657 -> '+0.024'."""
    return f"{round(value, 3) - round(baseline, 3):+.3f}"


def duration(seconds: float | None) -> str:
    """Under a minute in seconds to one place ('4.6 s'), under an hour in minutes and seconds ('2 min 5 s'), else in
    hours and minutes ('1 h 2 min'); '-' where there is none."""
    if seconds is None:
        return "-"
    if round(seconds, 1) < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


SPLITS = ("train", "val", "test")


def in_split_order(counts: dict[str, int]) -> dict[str, int]:
    """COUNTS by split in the order train, val, test (then any other), whatever order they came in (JSON sorts them)."""
    return {split: counts[split] for split in sorted(counts, key=lambda s: (SPLITS + (s,)).index(s))}


def counts(items: dict[str, int]) -> str:
    """{'train': 1426, 'val': 167} -> 'train 1,426, val 167'; 'none' for no items."""
    return ", ".join(f"{name} {count(value)}" for name, value in items.items()) or "none"
