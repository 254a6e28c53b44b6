"""S3 for tests: S3Proxy (from Maven Central, fetched by `make install`) on 127.0.0.1, and an endpoint that only
throttles."""

from __future__ import annotations

import secrets
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from imagelake.infra.jars import TEST_JARS, test_jar
from imagelake.infra.java import ensure_java
from imagelake.infra.local.cluster import free_port
from tests.servers import stop_group


class S3Server:
    """S3Proxy with its in-memory store, AWS signatures v2/v4, a random access key and secret; its log under ROOT.

    The in-memory store keeps keys flat as S3 does; its filesystem stores map "folders" to directories and refuse
    to delete a folder's marker while the folder has files, which S3A's commits do.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.key, self.secret = "test" + secrets.token_hex(6), secrets.token_hex(20)
        self.log = root / "s3proxy.log"
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment a client needs: where the server is and the credentials (nothing else carries them)."""
        return {
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> S3Server:
        jar = test_jar(TEST_JARS[0])
        if jar is None:
            raise RuntimeError(
                f"S3Proxy's jar ({TEST_JARS[0]}) is not installed: run `make install` (it fetches it with mvn)"
            )
        java = ensure_java() / "bin" / "java"
        self.root.mkdir(parents=True, exist_ok=True)
        properties = self.root / "s3proxy.properties"
        properties.write_text(
            "\n".join(
                [
                    f"s3proxy.endpoint={self.endpoint}",
                    "s3proxy.authorization=aws-v2-or-v4",
                    # botocore sends CRC32 checksum headers (x-amz-checksum-*) that S3Proxy does not implement.
                    "s3proxy.ignore-unknown-headers=true",
                    f"s3proxy.identity={self.key}",
                    f"s3proxy.credential={self.secret}",
                    "jclouds.provider=transient",
                ]
            )
            + "\n"
        )
        self.process = subprocess.Popen(
            [str(java), "-Xmx1g", "-jar", str(jar), "--properties", str(properties)],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"S3Proxy exited {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"S3Proxy did not listen on {self.endpoint} within 60 s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)

    def create_bucket(self, name: str) -> None:
        # With botocore: s3fs takes S3Proxy's answer to its bucket probe for "exists" and will not create it.
        import botocore.session

        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)

    def filesystem(self):
        """An s3fs client for this server."""
        import s3fs

        return s3fs.S3FileSystem(
            key=self.key, secret=self.secret, client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"}
        )


SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message><RequestId>0</RequestId></Error>"
)


class SlowDownHandler(BaseHTTPRequestHandler):
    """Every request answered as S3 answers when it throttles: 503 SlowDown (HEAD without a body, as S3 does)."""

    def answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(SLOW_DOWN)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(SLOW_DOWN)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = answer

    def log_message(self, *args) -> None:
        pass


class SlowDownServer:
    """An S3 endpoint on 127.0.0.1 that throttles every request, so that S3 clients raise what they raise for a 503."""

    def __enter__(self) -> str:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), SlowDownHandler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
