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
