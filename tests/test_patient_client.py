"""The suite's client for servers under load (tests/servers.py:PatientClient), against a real HTTP server on loopback
that is slow or busy at first: a read is asked again until it is answered, a write is never sent twice."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.servers import PatientClient

STALL = 1.0  # seconds the server takes over its first answer to each path: past the clients' timeout below
TIMEOUT = 0.3


class Handler(BaseHTTPRequestHandler):
    """The first request to each path stalls; `/busy` answers 503 twice before it answers 201."""

    seen: Counter = Counter()

    def answer(self) -> None:
        self.seen[self.path] += 1
        if self.path == "/busy":
            status = 503 if self.seen[self.path] <= 2 else 201
        else:
            if self.seen[self.path] == 1:
                time.sleep(STALL)
            status = 200
        body = f'{{"seen": {self.seen[self.path]}}}'.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the client gave up waiting
            pass

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        self.answer()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.answer()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Handler.seen = Counter()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_a_read_that_is_answered_late_is_asked_again_and_a_write_is_never_sent_twice(server: str) -> None:
    with httpx.Client(base_url=server, timeout=TIMEOUT) as plain:
        with pytest.raises(httpx.ReadTimeout):
            plain.get("/stalls-a-plain-client")  # the stall is real: a client that does not ask again fails
    with PatientClient(base_url=server, timeout=TIMEOUT, backoff=0.01) as patient:
        assert patient.get("/flow_runs/1").json() == {"seen": 2}
        assert patient.post("/flow_runs/filter", json={}).json() == {"seen": 2}, "a /filter query only reads"
        with pytest.raises(httpx.ReadTimeout):
            patient.post("/deployments/1/create_flow_run", json={})
        time.sleep(STALL)
        assert Handler.seen["/deployments/1/create_flow_run"] == 1, "a write that timed out was not sent again"
        busy = patient.post("/busy", json={})
        assert (busy.status_code, busy.json()) == (201, {"seen": 3}), "503 means nothing was done: asked again"


def test_patience_runs_out(server: str) -> None:
    with PatientClient(base_url=server, timeout=TIMEOUT, patience=0, backoff=0.01) as patient:
        assert patient.post("/busy", json={}).status_code == 503
        with pytest.raises(httpx.ReadTimeout):
            patient.get("/flow_runs/2")
