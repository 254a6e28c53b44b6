"""Time limits of flow runs and stages: past its deadline, the work is interrupted and fails with an error of its own.

Why not Prefect's `timeout_seconds` (Prefect 3.8, prefect/_internal/concurrency/cancellation.py): the limits are
settings, known only once a run has read its config file and overrides, after Prefect has started the flow; only the
outermost Prefect timeout of the main thread may use SIGALRM, and an inner one (a stage under a flow's) injects its
exception between two bytecodes, which never ends a call blocked in C (a sleep, a socket read, a lock); and what a
SIGALRM handler raises inside `ray.get()` is dropped, since Ray lets only KeyboardInterrupt and SystemExit out of a
signal handler.

So a deadline interrupts its thread as Ctrl-C does: SIGINT to the main thread (a blocked call returns with EINTR,
pyspark's handler cancels the running Spark jobs first, ray.get passes the KeyboardInterrupt on), or a KeyboardInterrupt
injected into another thread (a backfill's dates: that one waits for the thread's next bytecode, so a call blocked in C
runs on until it returns). The scope that set the deadline turns whatever comes out into its own error, a TimeoutError
(pyspark's clean-up after an interrupted JVM call may raise something else in the interrupt's place), and a body that
swallowed the interrupt and returned fails all the same: work that ran past its limit never counts as done.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
import time
from collections.abc import Callable, Iterator

from imagelake.infra.threads import context_thread

RESEND_SECONDS = 30.0  # an interrupt that no deadline's scope has seen yet (swallowed on the way) is sent again
DRAIN_SECONDS = 0.2  # how long a scope that passed its deadline waits for an interrupt still on its way


class Overdue(TimeoutError):
    """A flow run or a stage ran past its time limit. Never retried: a retry would block as long again, holding up every
    run queued behind it."""


class StageTimedOut(Overdue):
    """A stage ran past its time limit (settings: `<stage>_timeout_minutes` or `stage_timeout_minutes`)."""


class FlowTimedOut(Overdue):
    """A flow run ran past `flow_timeout_hours`."""


class Deadline:
    """The time limit of one thread's work, armed once the limit is known (a flow's, when the run reads its
    settings)."""

    def __init__(self) -> None:
        self.thread = threading.current_thread()
        self.error: Overdue | None = None
        self.fired = False  # the limit passed and the thread was interrupted
        self.seen = False  # an interrupt reached a scope of the thread: no need to send another
        self._ended = False
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def arm(self, seconds: float | None, error: Overdue) -> None:
        """Start the clock: SECONDS from now the thread is interrupted and ERROR raised (None: no limit). Once only."""
        if seconds is None or self.error is not None or self._ended:
            return
        self.error = error
        context_thread(self._watch, "imagelake-deadline", (seconds,)).start()

    def _watch(self, seconds: float) -> None:
        wait = seconds
        while not self._stop.wait(wait):
            with self._lock:  # never after end(): an interrupt outside the scope would hit unrelated code
                if self._ended or self.seen:
                    return
                self.fired = True
                _interrupt(self.thread)
            wait = RESEND_SECONDS

    def end(self) -> None:
        """Stop the clock; no interrupt is sent after this returns."""
        with self._lock:
            self._ended = True
        self._stop.set()


def _interrupt(thread: threading.Thread) -> None:
    """Interrupt THREAD as Ctrl-C would: a signal for the main thread, an injected KeyboardInterrupt for another."""
    if thread is threading.main_thread():
        signal.pthread_kill(thread.ident, signal.SIGINT)
    elif thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt))


_scopes = threading.local()


def _open() -> list[Deadline]:
    """This thread's deadlines, outermost first."""
    if not hasattr(_scopes, "stack"):
        _scopes.stack = []
    return _scopes.stack


def passed() -> Overdue | None:
    """The error of this thread's innermost deadline that has passed, or None."""
    for scope in reversed(_open()):
        if scope.fired:
            return scope.error
    return None


def _as_overdue(exc: BaseException) -> Overdue | None:
    """What EXC, raised under this thread's deadlines, becomes: the passed deadline's error, or None (EXC stands: it
    has nothing to do with a deadline, or it is already one's error)."""
    if isinstance(exc, Overdue):
        return None
    error = passed()
    if error is not None and isinstance(exc, KeyboardInterrupt):
        for scope in _open():
            scope.seen = scope.seen or scope.fired
    return error


@contextlib.contextmanager
def overdue_raised() -> Iterator[None]:
    """Around a Prefect task's function: an interrupt of a passed deadline, or what replaced it, comes out as that
    deadline's error (a TimeoutError: Prefect records the task run TimedOut, not Crashed), as does a return after it."""
    try:
        yield
    except BaseException as exc:
        error = _as_overdue(exc)
        if error is None:
            raise
        raise error from exc
    error = passed()
    if error is not None:
        raise error


@contextlib.contextmanager
def deadline(seconds: float | None = None, error: Overdue | None = None) -> Iterator[Deadline]:
    """Run the body under a time limit of SECONDS (None: none, or none yet: `Deadline.arm` sets it later): past it, the
    body is interrupted and ERROR raised."""
    scope = Deadline()
    _open().append(scope)
    restore = _interruptible(scope.thread)
    if seconds is not None and error is not None:
        scope.arm(seconds, error)
    try:
        try:
            yield scope
        finally:
            scope.end()
        error = passed()
        if error is not None:
            raise error
    except BaseException as exc:
        error = _as_overdue(exc)
        if error is None:
            raise
        raise error from exc
    finally:
        _open().remove(scope)
        restore()
        _drain(scope)


def _interruptible(thread: threading.Thread) -> Callable[[], None]:
    """In the main thread, make SIGINT raise KeyboardInterrupt while a deadline is open (a process started in the
    background may ignore it); return what puts the handler back."""
    if thread is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGINT)
    if callable(previous):
        return lambda: None
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def restore() -> None:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, previous)

    return restore


def _drain(scope: Deadline) -> None:
    """A scope that passed its deadline may have ended before its interrupt arrived: take that interrupt here, rather
    than let it hit whatever the thread runs next."""
    if not scope.fired or scope.seen:
        return
    try:
        time.sleep(DRAIN_SECONDS)
    except KeyboardInterrupt:
        pass


@contextlib.contextmanager
def sigint_handler_kept() -> Iterator[None]:
    """Put back the main thread's SIGINT handler after the body, however it ends.

    Ray Train's `fit()` (2.x, train v2) sets a handler of its own that aborts its training controller, and leaves it
    there: every later interrupt of the process (a later stage's deadline, a cancel) would go to a controller that is
    gone, and be swallowed or end the process. Outside the main thread there is no handler to keep.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if previous is not None and signal.getsignal(signal.SIGINT) is not previous:
            signal.signal(signal.SIGINT, previous)
