"""How the resize stage deals files to Spark tasks: a similar count and a similar number of bytes for each."""

from __future__ import annotations

# Rows per decode task beyond one task per core: small enough to balance a long list, large enough to amortise a task.
ROWS_PER_DECODE_TASK = 2048


def balanced_partitions(rows: list[dict], partitions: int) -> list[list[dict]]:
    """Deal the files largest first, in a snake order, so every task gets a similar count and a similar number of
    bytes."""
    groups: list[list[dict]] = [[] for _ in range(partitions)]
    for index, row in enumerate(sorted(rows, key=lambda r: -(r["size"] or 0))):
        turn, position = divmod(index, partitions)
        groups[position if turn % 2 == 0 else partitions - 1 - position].append(row)
    return [group for group in groups if group]
