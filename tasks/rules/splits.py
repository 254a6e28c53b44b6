"""The split rule: an image's train/val/test split follows from its content hash alone."""

from __future__ import annotations

SPLITS = ("train", "val", "test")


BUCKETS = float(2**32)


def split_of(sha256_hex: str, val_fraction: float, test_fraction: float) -> str:
    """The split of an image by its content hash: stable as data grows, independent of order."""
    prefix = sha256_hex[:8]
    if len(prefix) < 8 or any(c not in "0123456789abcdefABCDEF" for c in prefix):
        raise ValueError(f"not a sha256 hex digest: {sha256_hex!r}")
    bucket = int(prefix, 16) / BUCKETS
    if bucket < test_fraction:
        return "test"
    return "val" if bucket < test_fraction + val_fraction else "train"


def check_splits(
    label_counts: dict[str, dict[str, int]], table: str, image_size: int
) -> tuple[dict[str, int], list[str]]:
    """Each split's size and the labels, from images per (split, label); a split left empty, or fewer than two labels,
    is an error that says what to do (TABLE names the table version in it)."""
    counts = {split: sum(by_label.values()) for split, by_label in label_counts.items() if by_label}
    labels = sorted({label for by_label in label_counts.values() for label in by_label})
    empty = [split for split in SPLITS if counts.get(split, 0) == 0]
    if empty:
        raise ValueError(
            f"split(s) {', '.join(empty)} of {table} are empty "
            f"({sum(counts.values())} images of size {image_size}): add images or raise val_fraction/test_fraction"
        )
    if len(labels) < 2:
        raise ValueError(f"{table} has {len(labels)} label(s): a classifier needs at least 2 label folders")
    return counts, labels
