"""Rules for bad input: how large a share of a run's files may be bad, or of a date's rows retired, before the run
writes nothing."""

from __future__ import annotations

from datetime import date

from imagelake.tasks.results import Resized


class TooManyBadFiles(ValueError):
    """More of a run's files are bad than max_bad_fraction allows: nothing is written."""


def check_bad_fraction(resized: Resized, max_bad_fraction: float, known_bad: int = 0) -> None:
    """Fail before writing anything when too large a share of the run's files is bad. KNOWN_BAD of them were quarantined
    before for the same content and reason (requeued, or touched): no news, not counted."""
    # A file no read could get counts: many of them is a store in trouble.
    bad = resized.bad - known_bad + resized.unread_files
    considered = resized.decoded + resized.known + bad
    if considered and bad / considered > max_bad_fraction:
        reasons = ", ".join(
            f"{reason}: {count}" for reason, count in sorted({**resized.quarantined, **resized.unread}.items())
        )
        examples = "; ".join(f"{reason} e.g. {path}" for reason, path in sorted(resized.examples.items()))
        raise TooManyBadFiles(
            f"{bad} of {considered} files are bad ({reasons}), over max_bad_fraction={max_bad_fraction}; "
            f"nothing was written. Fix or remove them ({examples}) or raise IMAGELAKE_MAX_BAD_FRACTION."
        )


class TooManyRetired(ValueError):
    """A run would retire more of a date's rows than max_retire_fraction allows: nothing is written."""


def check_retire_fraction(
    retired: dict[date | None, int], rows: dict[date | None, int], max_retire_fraction: float
) -> None:
    """Fail before writing anything when a run would retire more than MAX_RETIRE_FRACTION of any date's rows (RETIRED
    and ROWS by date; None: rows without a date). A folder that vanished looks like this; files really deleted are let
    through by raising the setting for that run."""
    over = [
        (day, n, rows.get(day, 0))
        for day, n in sorted(retired.items(), key=lambda item: str(item[0]))
        if n > max_retire_fraction * rows.get(day, 0)
    ]
    if over:
        listed = ", ".join(f"{n} of {total} rows of {day or 'rows without a date'}" for day, n, total in over[:5])
        raise TooManyRetired(
            f"the run would retire {listed} (their files are not listed), over "
            f"max_retire_fraction={max_retire_fraction}; nothing was "
            "written. If those files are really gone, run again with max_retire_fraction=1 (`--set "
            "max_retire_fraction=1`, or "
            "IMAGELAKE_MAX_RETIRE_FRACTION=1 on the worker: a deployment run may only lower it)."
        )
