"""The Prefect client a lease renews through (infra/lease.py:client_of), against a real HTTPS server on loopback: the
credentials and the TLS settings in force reach it as they reach a client from Prefect's `get_client`."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prefect.settings import (
    PREFECT_API_AUTH_STRING,
    PREFECT_API_SSL_CERT_FILE,
    PREFECT_API_TLS_INSECURE_SKIP_VERIFY,
    temporary_settings,
)

from imagelake.infra.lease import client_of


class Handler(BaseHTTPRequestHandler):
    seen: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        self.seen.append((self.path, self.headers.get("Authorization")))
        body = b"true"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key, and the key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


@pytest.fixture
def https_api(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTPS server on 127.0.0.1 with a self-signed certificate: its API URL and the certificate's file."""
    Handler.seen = []
    cert_file, key_file = self_signed(tmp_path)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}/api", cert_file
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def health(api: str) -> Exception | None:
    """What the client's health check of API ran into (None: it was answered)."""
    with client_of(api) as client:
        return client.api_healthcheck()


def test_a_lease_s_client_takes_the_credentials_and_tls_settings_in_force(https_api: tuple[str, Path]) -> None:
    api, cert_file = https_api
    # Verified against certifi's bundle by default: a self-signed server is refused.
    assert "CERTIFICATE_VERIFY_FAILED" in str(health(api))
    # The server's certificate named as the one to trust, then verification turned off: both reach it, each with the
    # credentials of the settings of the time.
    with temporary_settings(updates={PREFECT_API_SSL_CERT_FILE: str(cert_file), PREFECT_API_AUTH_STRING: "a:one"}):
        assert health(api) is None
    with temporary_settings(updates={PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True, PREFECT_API_AUTH_STRING: "b:two"}):
        assert health(api) is None
        # A thread (a lease's renewal) does not inherit temporary settings: it verifies against certifi's bundle.
        found: list[Exception | None] = []
        thread = threading.Thread(target=lambda: found.append(health(api)))
        thread.start()
        thread.join()
        assert "CERTIFICATE_VERIFY_FAILED" in str(found[0])
    assert [path for path, _ in Handler.seen] == ["/api/health"] * 2
    assert [auth for _, auth in Handler.seen] == [f"Basic {base64.b64encode(s).decode()}" for s in (b"a:one", b"b:two")]
    assert "CERTIFICATE_VERIFY_FAILED" in str(health(api)), "the insecure setting ended with its context"
