"""Prefect's API and result storage for a run, from settings."""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

from prefect.context import FlowRunContext
from prefect.filesystems import LocalFileSystem, RemoteFileSystem, WritableFileSystem
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_LOCAL_STORAGE_PATH,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    PREFECT_TASKS_REFRESH_CACHE,
    PREFECT_UI_URL,
    temporary_settings,
)

from imagelake.infra.compat import flow_run_context_with_result_storage
from imagelake.infra.holders import ORPHANED_AFTER_LEASES, file_lock, orphan_check, shared, shared_record, waiting_for
from imagelake.infra.lease import LeaseLost
from imagelake.infra.settings import Settings


@contextlib.contextmanager
def prefect_for(settings: Settings, api_url: str | None = None) -> Iterator[None]:
    """Results persist under the workspace; the API is the configured server, else API_URL (a temporary server the
    command started: infra/prefect_server.py), else Prefect's own default."""
    # No telemetry: an ephemeral server would try to reach the internet on every run.
    updates = {PREFECT_LOCAL_STORAGE_PATH: settings.prefect_results_dir, PREFECT_SERVER_ANALYTICS_ENABLED: False}
    if settings.prefect_api_url:
        updates[PREFECT_API_URL] = settings.prefect_api_url
    elif api_url:  # a temporary server, which serves no UI: no "View at" links to it
        updates.update({PREFECT_API_URL: api_url, PREFECT_UI_URL: ""})
    with temporary_settings(updates=updates):
        yield


def result_storage(uri: str) -> WritableFileSystem:
    """A Prefect file system for a folder or an fsspec URI (s3://, gs://, abfs://...)."""
    if "://" in uri and not uri.startswith("file://"):
        return RemoteFileSystem(basepath=uri)
    return LocalFileSystem(basepath=uri.removeprefix("file://"))


@contextlib.contextmanager
def stage_results(settings: Settings, refresh: bool = False) -> Iterator[None]:
    """Inside a flow: stages cache their results under settings.results_uri; with refresh, every stage recomputes."""
    context = FlowRunContext.get()
    if context is None:
        raise RuntimeError("stage_results() belongs inside a flow run")
    staged = flow_run_context_with_result_storage(context, result_storage(settings.results_uri))
    # A deployment run gets no say over the worker's Prefect settings: the flow picks the store itself.
    refresh = refresh or bool(
        PREFECT_TASKS_REFRESH_CACHE.value()
    )  # the environment's PREFECT_TASKS_REFRESH_CACHE still counts
    with staged, temporary_settings(updates={PREFECT_TASKS_REFRESH_CACHE: refresh}):
        yield


def prefect_api_in_use(settings: Settings) -> str | None:
    """The Prefect API URL runs will talk to, or None for Prefect's ephemeral local server."""
    if settings.prefect_api_url:
        return settings.prefect_api_url
    return PREFECT_API_URL.value() or None


def lock_name(what: str) -> str:
    """A name for a lock file and a Prefect concurrency limit: WHAT's safe characters and a digest of all of it."""
    return f"imagelake-{re.sub(r'[^A-Za-z0-9_.-]', '-', what)[:80]}-{hashlib.sha256(what.encode()).hexdigest()[:8]}"


@contextlib.contextmanager
def one_at_a_time(settings: Settings, what: str, timeout: float | None = 600) -> Iterator[None]:
    """Hold the lock on WHAT: a file lock in the workspace for this machine's runs, and a Prefect global concurrency
    limit of one slot for every run that talks to the same Prefect server, on any host (its lease lapses if the holder
    dies). On Prefect's ephemeral server, which lives on this machine, the file lock is the lock. The holder is written
    down as it enters (infra/holders.py); a wait of more than TIMEOUT seconds (None: as long as it takes) raises
    LockBusy,
    a TimeoutError naming the holder and what to do."""
    name = lock_name(what)
    folder = settings.workspace_dir / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / f"{name}.lock", what, timeout):
        api = prefect_api_in_use(settings)
        if api is None:
            yield
            return
        from imagelake.infra.lease import acquire

        with temporary_settings(updates={PREFECT_API_URL: api}):
            ensure_one_slot(name)
            # A lease renewal that fails once (a busy server) must not end an hours-long training that holds the slot:
            # the
            # lease may then lapse and the next holder go on, so what the lock protects is fenced (`fence`).
        with waiting_for(what, timeout, lambda: shared_record(api, name)):
            lease = acquire(
                api,
                name,
                timeout,
                duration=LEASE_SECONDS,
                on_busy=orphan_check(api, name, what, ORPHANED_AFTER_LEASES * LEASE_SECONDS),
            )
        token = _leases.set({**_leases.get(), what: lease})
        try:
            with shared(api, name, lease):  # every host that may wait for it can name the holder
                yield
        finally:
            _leases.reset(token)
            lease.release()


LEASE_SECONDS = 60  # a holder that cannot renew for this long loses the lock to the next caller

# The Prefect leases this thread holds, by what they lock (never changed in place: a new mapping is set).
_leases: contextvars.ContextVar[Mapping] = contextvars.ContextVar("imagelake_leases", default=MappingProxyType({}))


def fence(what: str) -> None:
    """Before changing what the lock on WHAT protects (an alias move, a commit): raise infra/lease.py:LeaseLost if this
    thread's lease on it lapsed and another holder may be in. A lock held by its file alone (no Prefect API) holds for
    as long as the process lives, and needs no fence."""
    lease = _leases.get().get(what)
    if lease is not None:
        lease.check()


def lease_watch(
    what: str,
    logger: logging.Logger | logging.LoggerAdapter,
    on_lost: Callable[[LeaseLost], None] | None = None,
) -> Callable[[], None]:
    """For a long hold of the lock on WHAT (hours of training): a check to call every few minutes from any thread that
    renews the lease at once and, the first time it finds it lost, says so in the log and calls ON_LOST (another run
    may now enter and do the same work: stop what is under way); `fence(WHAT)` before the result is published then
    refuses it. Nothing to check for a lock held by its file alone."""
    lease = _leases.get().get(what)  # read here: the calling thread's leases, which a report thread does not inherit
    lost: list[Exception] = []

    def watch() -> None:
        if lease is None or lost:
            return
        try:
            lease.check()
        except LeaseLost as exc:
            lost.append(exc)
            logger.warning(
                f"{what}: {exc}; "
                + ("the work stops at its next step" if on_lost else "the work goes on")
                + ", and its result will be refused at the end"
            )
            if on_lost is not None:
                on_lost(exc)

    return watch


def ensure_one_slot(limit: str) -> None:
    """A Prefect global concurrency limit of one slot named LIMIT, created if missing (two creators at once: one
    wins)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            found = client.read_global_concurrency_limit_by_name(limit)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=limit, limit=1))
            except ObjectAlreadyExists:
                pass
            return
    if found.limit != 1 or not found.active:
        raise RuntimeError(
            f"Prefect's global concurrency limit {limit!r} must be active with 1 slot; it has {found.limit} "
            f"(active: {found.active})"
        )
