"""Who holds a lock of `one_at_a_time` (infra/prefect_env.py): written down when it is taken, named when a wait for it
gives up, so that the run that waited says which run to wait for or cancel rather than just that it timed out.

The record is a small JSON file beside the lock file (this machine's runs) and, where the lock is a Prefect concurrency
limit, a Prefect variable of the same name (every host that talks to that server). Both are best effort: a record that
cannot be written or read leaves the lock itself as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from filelock import FileLock

from imagelake.infra.lease import client_of
from imagelake.infra.threads import context_thread


class LockBusy(TimeoutError):
    """A wait for a lock gave up: the message names who holds it and what to do. Never retried (the retry would wait as
    long)."""


class OrphanedSlot(LockBusy):
    """The Prefect slot of a lock is taken, but its holder stopped renewing its lease long ago: a Prefect server that
    keeps leases in memory lost them in a restart, and nothing will ever give the slot back."""


# A holder whose published record was not renewed for this many lease durations holds no live lease.
ORPHANED_AFTER_LEASES = 3


def orphan_check(api: str, limit: str, what: str, after_seconds: float) -> Callable[[], None]:
    """For the wait on LIMIT's slot: raise OrphanedSlot when the slot is taken and its holder's record (renewed with
    its lease) is older than AFTER_SECONDS, rather than wait forever for a slot no lease holds."""

    def check() -> None:
        holder = _quietly(lambda: shared_record(api, limit))
        renewed = (holder or {}).get("renewed_at")
        if not renewed:
            return  # a record of an older imagelake, or none: nothing to judge by
        age = (datetime.now(UTC) - datetime.fromisoformat(renewed)).total_seconds()
        if age > after_seconds:
            raise OrphanedSlot(
                f"the lock on {what} is taken on the Prefect server at {api}, but its holder ({describe(holder)}) "
                f"last renewed its lease {age:.0f} s ago: no live run holds it (a Prefect server keeping leases in "
                "memory forgets them when it restarts). Free the slot with `prefect global-concurrency-limit update "
                f"{limit} --active-slots 0` once that run is gone, and keep leases across restarts with "
                "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem on the "
                "server (as imagelake's own servers do)"
            )

    return check


def holder_now() -> dict[str, Any]:
    """This process, and the flow run it works for, if any: what a waiter needs to find and judge the holder."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "flow_run_id": str(run.id) if run is not None else None,
        "flow_run_name": run.name if run is not None else None,
        "flow_name": context.flow.name if context is not None and context.flow is not None else None,
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def describe(holder: dict[str, Any] | None) -> str:
    """A holder in words: its flow run (name, id, flow), its process and host, since when."""
    if not holder:
        return "a holder that left no record (a run of an older imagelake, or one letting go just now)"
    who = "a process outside any flow run"
    if holder.get("flow_run_id"):
        who = f"flow run {holder['flow_run_name']!r} ({holder['flow_run_id']}) of {holder['flow_name']}"
    return f"{who}, pid {holder['pid']} on {holder['host']}, since {holder['since']}"


def busy_message(what: str, timeout: float | None, holder: dict[str, Any] | None) -> str:
    """Why a wait gave up, whom it waited for, and what to do."""
    if holder and holder.get("flow_run_id"):
        cancel = f"cancel that run (`prefect flow-run cancel {holder['flow_run_id']}`, or its page in the Prefect UI)"
    elif holder:
        cancel = f"cancel it (stop pid {holder['pid']} on {holder['host']})"
    else:
        cancel = "cancel the run that holds it (the Prefect UI lists the runs in progress)"
    waited = "" if timeout is None else f" after {timeout:g} s"
    setting = next(
        (f"; {name} sets how long to wait" for prefix, name in WAIT_SETTINGS.items() if what.startswith(prefix)), ""
    )
    return (
        f"gave up waiting for the lock on {what}{waited}: {describe(holder)} holds it. "
        f"Wait for it to end and run again or, if it hangs, {cancel}{setting}"
    )


# Locks whose wait is a setting, by the start of what they lock (tasks/stages/cache.py, tasks/stages/train.py).
WAIT_SETTINGS = {"cache-": "cache_lock_wait_minutes", "train-": "train_lock_wait_minutes"}


@contextlib.contextmanager
def waiting_for(what: str, timeout: float | None, holder: Callable[[], dict[str, Any] | None]) -> Iterator[None]:
    """Around the wait for the lock on WHAT (and nothing else): a TimeoutError there becomes LockBusy naming
    HOLDER()."""
    try:
        yield
    except LockBusy:
        raise
    except TimeoutError as exc:
        raise LockBusy(busy_message(what, timeout, _quietly(holder))) from exc


def _quietly(read: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    try:
        return read()
    except Exception:  # noqa: BLE001 - the record is best effort: the error still says what timed out
        return None


# --- this machine: a file beside the lock file -------------------------------------------------------------------


def read_record(path: Path) -> dict[str, Any] | None:
    """The holder recorded in PATH, or None."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def recorded(path: Path) -> Iterator[None]:
    """While the body holds the lock: this holder in PATH, removed before the lock is let go."""
    holder = holder_now()
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        aside.write_text(json.dumps(holder))
        os.replace(aside, path)  # whole or not at all: a waiter never reads half a record
    except OSError:
        pass
    try:
        yield
    finally:
        if read_record(path) == holder:
            with contextlib.suppress(OSError):
                path.unlink()


@contextlib.contextmanager
def file_lock(path: Path, what: str, timeout: float | None) -> Iterator[None]:
    """Hold the file lock PATH (waiting up to TIMEOUT seconds; None: as long as it takes), recorded beside it; a wait
    that gives up raises LockBusy naming the holder."""
    lock = FileLock(str(path), timeout=-1 if timeout is None else timeout)
    record = path.with_suffix(".holder")
    with waiting_for(what, timeout, lambda: read_record(record)):
        lock.acquire()
    try:
        with recorded(record):
            yield
    finally:
        lock.release()


# --- every host of one Prefect server: a Prefect variable -------------------------------------------------------


def variable_name(limit: str) -> str:
    """The Prefect variable holding the holder of concurrency limit LIMIT (variables take lowercase, digits, - and
    _)."""
    return re.sub(r"[^a-z0-9_-]", "-", f"{limit}-holder".lower())[:255]


def shared_record(api: str, limit: str) -> dict[str, Any] | None:
    """The holder of LIMIT as its holder published it on the Prefect API at API, or None."""
    with client_of(api) as client:
        found = client.read_variable_by_name(variable_name(limit))
    return found.value if found is not None and isinstance(found.value, dict) else None


@contextlib.contextmanager
def shared(api: str, limit: str, lease: Any) -> Iterator[None]:
    """While the body holds the slot of LIMIT under LEASE (infra/lease.py:HeldLease): this holder in a Prefect variable,
    its `renewed_at` brought up to date as long as the lease is renewed, removed before the slot is given back."""
    holder = {**holder_now(), "lease_id": str(lease.lease_id)}
    stop = threading.Event()

    def publish() -> None:
        renewed = datetime.now(UTC) - timedelta(seconds=time.monotonic() - lease.renewed)
        _quietly(lambda: _publish(api, limit, {**holder, "renewed_at": renewed.isoformat(timespec="seconds")}))

    def keep() -> None:
        while not stop.wait(lease.duration / 4) and lease.lost is None:
            publish()

    publish()
    keeper = context_thread(keep, f"holder-{limit}")
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join(timeout=5)
        _quietly(lambda: _withdraw(api, limit, holder))


def _publish(api: str, limit: str, holder: dict[str, Any] | None) -> None:
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    name = variable_name(limit)
    with client_of(api) as client:
        if client.read_variable_by_name(name) is None:
            client.create_variable(VariableCreate(name=name, value=holder))
        else:
            client.update_variable(VariableUpdate(name=name, value=holder))


def _withdraw(api: str, limit: str, holder: dict[str, Any]) -> None:
    """Remove the record if it is still this holder's (a lease that lapsed may have let another holder write its
    own)."""
    if (shared_record(api, limit) or {}).get("lease_id") != holder["lease_id"]:
        return
    with client_of(api) as client:
        client.delete_variable_by_name(variable_name(limit))
