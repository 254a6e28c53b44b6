"""Progress lines for long stages: a report every few seconds from a background thread, never a flood."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from imagelake.infra.threads import context_thread

REPORT_SECONDS = 15.0  # at most four lines a minute per stage


def stage_logger() -> logging.Logger | logging.LoggerAdapter:
    """The run's logger inside a Prefect task or flow (console and the run's logs), else a plain one."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("imagelake")


class Every:
    """Calls `report` every `seconds` while the block runs (not at its start, and not after it ends)."""

    def __init__(
        self,
        report: Callable[[], None],
        logger: logging.Logger | logging.LoggerAdapter,
        seconds: float = REPORT_SECONDS,
    ) -> None:
        self.report, self.logger, self.seconds = report, logger, seconds
        self._stop = threading.Event()
        self._thread = context_thread(self._run, "imagelake-progress")

    def __enter__(self) -> Every:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        # A report stuck in a slow call (a tracking server's retries) must not hold up the stage; the thread is a
        # daemon.
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            try:
                self.report()
            except Exception as exc:  # a progress line is never worth failing the stage it describes
                self.logger.debug(f"progress report failed: {type(exc).__name__}: {exc}")


def rate_line(stage: str, done: int, total: int, seconds: float, unit: str) -> str:
    """'resize: 812 of 1797 files (45%), 160 files/s'."""
    share = f" ({100 * done / total:.0f}%)" if total else ""
    return f"{stage}: {done} of {total} {unit}{share}, {done / max(seconds, 1e-9):.0f} {unit}/s"
