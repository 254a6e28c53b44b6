"""One slot of a Prefect global concurrency limit, held under a lease this process renews, with a fence.

A lease lapses when it is not renewed in time (the Prefect server or the network away for longer than the lease), and
the server then gives the slot to the next caller while the first holder may still be working. So what the lock protects
(an alias move, a commit) is fenced: `HeldLease.check()` renews the lease at once and raises LeaseLost when the server
no longer knows it, or when it cannot be renewed and may have lapsed. Only the Prefect client's public methods are used.
"""

from __future__ import annotations

import functools
import ssl
import threading
import time
from collections.abc import Callable
from uuid import UUID

import certifi
from prefect.client.orchestration import SyncPrefectClient
from prefect.exceptions import PrefectHTTPStatusError
from prefect.settings import (
    PREFECT_API_AUTH_STRING,
    PREFECT_API_KEY,
    PREFECT_API_SSL_CERT_FILE,
    PREFECT_API_TLS_INSECURE_SKIP_VERIFY,
)

from imagelake.infra.threads import context_thread


def client_of(api: str) -> SyncPrefectClient:
    """A client of the Prefect API at API, whichever thread asks (a thread does not inherit temporary settings), with
    the credentials and TLS settings in force. Built directly rather than through `get_client` under temporary
    settings, which validates every setting anew on each call (a quarter of a second of CPU), and with a TLS context
    made once rather than by each client (reading the CA bundle, 50 ms): a held lease calls this at every renewal."""
    insecure = bool(PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value())
    return SyncPrefectClient(
        api,
        auth_string=PREFECT_API_AUTH_STRING.value(),
        api_key=PREFECT_API_KEY.value(),
        httpx_settings={"verify": tls_context(insecure, None if insecure else PREFECT_API_SSL_CERT_FILE.value())},
    )


@functools.lru_cache(maxsize=8)
def tls_context(insecure: bool, cert_file: str | None) -> ssl.SSLContext:
    """The TLS context Prefect's client makes for these settings: no verification when INSECURE, else the certificates
    of CERT_FILE (certifi's bundle when unset)."""
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=cert_file or certifi.where())


class LeaseLost(RuntimeError):
    """The lock's lease lapsed (or cannot be shown to hold): another holder may have entered; nothing more is done."""


class HeldLease:
    """A lease on one slot of the limit NAME, renewed every quarter of its duration by a thread of its own."""

    def __init__(self, api: str, name: str, lease_id: UUID, duration: float) -> None:
        self.api, self.name, self.lease_id, self.duration = api, name, lease_id, duration
        self.renewed = time.monotonic()  # when the server last confirmed the lease
        self.lost: str | None = None  # why the server said it no longer holds
        self._stop = threading.Event()
        self._thread = context_thread(self._keep, f"lease-{name}")
        self._thread.start()

    def _renew(self) -> None:
        """Renew now: record when it held, or that the server dropped it (HTTP 404 or 410); other errors pass up."""
        try:
            with client_of(self.api) as client:
                client.renew_concurrency_lease(self.lease_id, self.duration)
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code in (404, 410):
                self.lost = (
                    f"the Prefect server no longer holds lease {self.lease_id} of {self.name!r} (HTTP "
                    f"{exc.response.status_code})"
                )
            raise
        self.renewed = time.monotonic()

    def _keep(self) -> None:
        while not self._stop.wait(self.duration / 4) and self.lost is None:
            try:
                self._renew()
            except Exception:  # noqa: BLE001 - a busy or absent server: the next try, or check(), decides
                pass

    def check(self) -> None:
        """The fence: raise LeaseLost unless the lease holds now and for at least half its duration more."""
        try:
            self._renew()
        except Exception as exc:  # noqa: BLE001 - sorted below
            left = self.duration - (time.monotonic() - self.renewed)
            if self.lost is not None or left < self.duration / 2:
                raise LeaseLost(
                    f"the lock {self.name!r} may be held by another run now "
                    f"({self.lost or f'its lease could not be renewed: {exc}'}); "
                    "nothing was changed under it. Run again once the Prefect server answers."
                ) from exc
        if self.lost is not None:
            raise LeaseLost(
                f"the lock {self.name!r} may be held by another run now ({self.lost}); nothing was changed under it"
            )

    def release(self) -> None:
        """Stop renewing and give the slot back (a lease the server dropped already has none to give)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.lost is None:
            try:
                with client_of(self.api) as client:
                    client.release_concurrency_slots_with_lease(self.lease_id)
            except PrefectHTTPStatusError as exc:
                if exc.response.status_code not in (404, 410):
                    raise


def acquire(
    api: str, name: str, timeout: float | None, duration: float = 60, on_busy: Callable[[], None] | None = None
) -> HeldLease:
    """Wait for the one slot of limit NAME on the Prefect API at API (TimeoutError after TIMEOUT seconds; None: as long
    as it takes) and hold it. ON_BUSY is called each time the slot is found taken (it may raise)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            with client_of(api) as client:
                response = client.increment_concurrency_slots_with_lease([name], 1, "concurrency", duration)
            granted = response.json()
            if not granted.get("limits"):  # the server skips a limit that does not exist: no slot, so no lock
                raise RuntimeError(f"Prefect's global concurrency limit {name!r} does not exist: no lock was taken")
            return HeldLease(api, name, UUID(granted["lease_id"]), duration)
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code != 423:  # 423: the slot is taken
                raise
            wait = float(exc.response.headers.get("Retry-After", 1) or 1)
        if on_busy is not None:
            on_busy()
        if deadline is not None and time.monotonic() + wait > deadline:
            raise TimeoutError(f"the lock {name!r} was not free within {timeout:.0f} s")
        time.sleep(min(wait, 5))
