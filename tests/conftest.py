"""Shared fixtures: demo images, a workspace per test, one real Spark session, Prefect's test server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before Prefect is imported: the test server must not try to send telemetry.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from infra.settings import Settings, load_settings
from flows.demo_data import write_digits

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 demo digit PNGs (30 per label), 64x64, in ImageFolder layout."""
    out = tmp_path_factory.mktemp("digits")
    write_digits(out, size=64, per_label=30)
    return out


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Settings with a fresh workspace, small images and a short training run."""
    return load_settings(overrides={"workspace": str(tmp_path / "ws"), "image_size": 32, "max_epochs": 2})


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A real S3-compatible server (S3Proxy) on 127.0.0.1 for the session, with a bucket `lake`.

    Its address and random credentials are in this process's environment (AWS_*), the only place
    imagelake takes them from; the Spark session below starts after it, so S3A sees them too.
    """
    from tests.s3 import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    saved = {key: os.environ.get(key) for key in server.env}
    os.environ.update(server.env)
    try:
        server.create_bucket("lake")
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory, s3):
    """One real local SparkSession for the whole test session (S3A pointed at the test's S3 server)."""
    from infra.spark import spark_session

    session = spark_session(Settings(workspace=tmp_path_factory.mktemp("spark-ws"), spark_master="local[2]"))
    yield session
    session.stop()


@pytest.fixture(params=["delta-rs", "spark"])
def engine(request: pytest.FixtureRequest) -> str:
    """Each Delta engine in turn: delta-rs, and Spark's Delta (its jars come with `make install`)."""
    return request.param


@pytest.fixture
def lake(spark, tmp_path: Path, engine: str):
    """Empty images and quarantine tables in a temp folder, with the data stages wired to them, on each Delta engine."""
    from tests.lake import Lake

    return Lake(spark, tmp_path, engine)


DIGITS = tuple(str(d) for d in range(10))


@pytest.fixture
def digits_cached(spark, lake, digits_dir: Path, tmp_path: Path, settings):
    """100 digits at 24x24, split and cached (a CachedSplits, what the train stage takes)."""
    from tasks.cache import cache_splits
    from tasks.split import plan_splits
    from tests.lake import copy_digits

    copy_digits(digits_dir, tmp_path / "src", labels=DIGITS, per_label=10)
    _, _, written = lake.run(tmp_path / "src")
    plan = plan_splits(spark, written, settings.model_copy(update={"image_size": 24}))
    return cache_splits(spark, plan, 24, settings.cache_uri)


@pytest.fixture(scope="session")
def prefect_api():
    """Prefect's test harness: a temporary Prefect server on 127.0.0.1 with its own SQLite database."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for running the `imagelake` command in a subprocess."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("IMAGELAKE_")}
    env.update(extra or {})
    return env
