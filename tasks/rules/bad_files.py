"""Rules for bad input: how large a share of a run's files may be bad before the run writes nothing."""

from __future__ import annotations

from tasks.results import Resized


class TooManyBadFiles(ValueError):
    """More of a run's files are bad than max_bad_fraction allows: nothing is written."""


def check_bad_fraction(resized: Resized, max_bad_fraction: float) -> None:
    """Fail before writing anything when too large a share of the run's files is bad."""
    considered = resized.decoded + resized.known + resized.bad
    if considered and resized.bad / considered > max_bad_fraction:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(resized.quarantined.items()))
        examples = "; ".join(f"{reason} e.g. {path}" for reason, path in sorted(resized.examples.items()))
        raise TooManyBadFiles(
            f"{resized.bad} of {considered} files are bad ({reasons}), over max_bad_fraction={max_bad_fraction}; "
            f"nothing was written. Fix or remove them ({examples}) or raise IMAGELAKE_MAX_BAD_FRACTION."
        )
