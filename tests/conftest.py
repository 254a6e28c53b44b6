"""Shared fixtures: demo images, a workspace per test, one real Spark session, Prefect's test server; the suite's tiers,
the Delta engines a test runs on, and a shuffled order on request (docs/testing.md)."""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before Prefect is imported: the test server must not try to send telemetry.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Prefect's own server for a process (a CLI run) may take over its default 20 s to start on a loaded 2-core machine.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# The suite trains the small CNN from scratch (every process it starts inherits this, cli_env's too): tests of the
# pretrained default set model_arch and pretrained themselves (docs/testing.md).
os.environ.setdefault("IMAGELAKE_MODEL_ARCH", "small_cnn")
os.environ.setdefault("IMAGELAKE_PRETRAINED", "none")

from imagelake.flows.demo_data import write_digits
from imagelake.infra.settings import Settings, load_settings

REPO = Path(__file__).resolve().parent.parent
PROCESS_POOL = "infra/clusters/process-pool.json"  # imagelake's process pool's job template (make worker's)
SUITE_MODEL = {name: os.environ[name] for name in ("IMAGELAKE_MODEL_ARCH", "IMAGELAKE_PRETRAINED")}
# The Spark drivers of the processes the suite starts (CLI and flow runs, writers) live for a few small jobs: their JVMs
# compile with C1 alone and collect with one thread (bench/spark_driver.py). The session's own Spark below, which serves
# every test of a pytest process, keeps the JVM's defaults: with C1 alone its tests took longer (docs/testing.md).
CHILD_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
os.environ.setdefault("SPARK_SUBMIT_OPTS", CHILD_JVM_OPTIONS)
# Every Spark driver of the suite (the session's below and those of the processes it starts, through PySpark's submit
# arguments) evaluates Spark SQL's expressions interpreted instead of generating and compiling Java classes for each
# new query: on the suite's small tables, generating and compiling them took about a sixth of the session's CPU
# samples, and its JVM used a fifth less CPU without them (docs/testing.md). The results are the same either way.
# factoryMode is an internal Spark setting: tests/test_compat.py pins what it does.
SUITE_SPARK_CONF = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}
SUITE_SUBMIT_ARGS = [f"--conf {key}={value}" for key, value in SUITE_SPARK_CONF.items()]
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", " ".join([*SUITE_SUBMIT_ARGS, "pyspark-shell"]))


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


def start_session_spark(workspace: Path):
    """The pytest process's own SparkSession, with the JVM's defaults: CHILD_JVM_OPTIONS are for the short-lived
    processes a test starts, and a session that lives for the whole suite needs the server compiler."""
    from imagelake.infra.spark import spark_session

    ours = os.environ.get("SPARK_SUBMIT_OPTS") == CHILD_JVM_OPTIONS  # a developer's own options stay
    if ours:
        del os.environ["SPARK_SUBMIT_OPTS"]
    try:
        return spark_session(Settings(workspace=workspace, spark_master="local[2]"))
    finally:
        if ours:
            os.environ["SPARK_SUBMIT_OPTS"] = CHILD_JVM_OPTIONS


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory, s3):
    """One real local SparkSession for the whole test session (S3A pointed at the test's S3 server)."""
    session = start_session_spark(tmp_path_factory.mktemp("spark-ws"))
    yield session
    session.stop()


@pytest.fixture
def lake(spark, tmp_path: Path, engine: str):
    """Empty images and quarantine tables in a temp folder, with the data stages wired to them, on each Delta engine."""
    from tests.lake import Lake

    return Lake(spark, tmp_path, engine)


DIGITS = tuple(str(d) for d in range(10))


@pytest.fixture
def digits_cached(spark, lake, digits_dir: Path, tmp_path: Path, settings):
    """100 digits at 24x24, split and cached (a CachedSplits, what the train stage takes)."""
    from imagelake.tasks.stages.cache import cache_splits
    from imagelake.tasks.stages.split import plan_splits
    from tests.lake import copy_digits

    copy_digits(digits_dir, tmp_path / "src", labels=DIGITS, per_label=10)
    _, _, written = lake.run(tmp_path / "src")
    plan = plan_splits(spark, written, settings.model_copy(update={"image_size": 24}))
    return cache_splits(spark, plan, 24, settings.cache_uri)


@contextlib.contextmanager
def session_prefect() -> Iterator[str]:
    """Prefect's test harness: a temporary Prefect server on 127.0.0.1 with its own SQLite database; yields its API."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def prefect_api():
    """The session's Prefect server (`session_prefect`)."""
    with session_prefect() as api:
        yield api


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for running the `imagelake` command in a subprocess."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("IMAGELAKE_")}
    env.update({**SUITE_MODEL, **(extra or {})})
    return env


# --- The suite's rules (docs/testing.md) ---------------------------------------------------------------------------

ENGINES = ("delta-rs", "spark")
# A test that uses one of these starts Spark, Ray or a server (directly or through a fixture built on them).
STARTING_FIXTURES = {
    "spark",
    "s3",
    "lake",
    "prefect_api",
    "digits_cached",
    "registry",
    "deployed",
    "cluster_run",
    "load_root",
}
# These run flows or training in the test's own process: Spark (with the S3 settings) and Ray start first, the same
# way whichever test of the session comes first.
IN_PROCESS_PIPELINE = {"prefect_api", "digits_cached"}
RAY_TEST_CPUS = 4  # logical CPUs of the session's Ray: enough for the largest training a test runs (2 workers)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shuffle",
        metavar="SEED",
        default=None,
        help="run the test files, and the tests in each, in an order shuffled by SEED (an integer, or 'random')",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`engine`: both Delta engines for a test marked both_engines (the engine changes what it checks), else
    delta-rs."""
    if "engine" in metafunc.fixturenames:
        metafunc.parametrize(
            "engine", ENGINES if metafunc.definition.get_closest_marker("both_engines") else ENGINES[:1]
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if STARTING_FIXTURES & set(item.fixturenames) or any(
            item.get_closest_marker(m) for m in ("slow", "cluster", "load", "browser", "alone")
        ):
            item.add_marker(pytest.mark.starts)
    # Held to the quick tier's promise when it runs on its own: in a session with tests that start things, a server
    # or Ray can start a process of its own while a quick test runs.
    config.stash[QUICK_ONLY] = not any(item.get_closest_marker("starts") for item in items)
    seed = config.stash.get(SHUFFLE_SEED, None)
    if seed is not None:
        items[:] = shuffled(items, random.Random(seed))


SHUFFLE_SEED = pytest.StashKey[int]()
QUICK_ONLY = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    """--shuffle's seed, drawn once: pytest-xdist's processes take the controller's (each must collect the same
    order)."""
    seed = config.getoption("--shuffle")
    if seed is not None:
        given = getattr(config, "workerinput", {}).get("shuffle_seed")
        config.stash[SHUFFLE_SEED] = (
            int(given) if given is not None else random.randrange(1 << 30) if seed == "random" else int(seed)
        )


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist, in the controller: hand each process the seed drawn above."""
    seed = node.config.stash.get(SHUFFLE_SEED, None)
    if seed is not None:
        node.workerinput["shuffle_seed"] = seed


def shuffled(items: list[pytest.Item], rng: random.Random) -> list[pytest.Item]:
    """Files in a random order, and the tests of each file in a random order; a test marked ends_fixture stays after
    the others of its file (it stops what a module fixture started)."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = list(files)
    rng.shuffle(order)
    out: list[pytest.Item] = []
    for name in order:
        tests = files[name]
        rng.shuffle(tests)
        out += [t for t in tests if not t.get_closest_marker("ends_fixture")] + [
            t for t in tests if t.get_closest_marker("ends_fixture")
        ]
    return out


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.stash.get(SHUFFLE_SEED, None)
    return None if seed is None else f"shuffled order: --shuffle {seed}"


def start_session_ray():
    """This process's Ray with RAY_TEST_CPUS logical CPUs (not sized by whichever test trains first)."""
    from imagelake.infra.ray_runtime import connect_ray

    return connect_ray(Settings(workspace=Path("."), num_workers=RAY_TEST_CPUS - 1))


@pytest.fixture(scope="session")
def ray_local():
    """This process's Ray, started once (`start_session_ray`)."""
    return start_session_ray()


def _started_here() -> set[str]:
    """Spark, Ray and the child processes this process runs now."""
    import psutil

    found = {f"process {child.pid}" for child in psutil.Process().children() if child.is_running()}
    spark_context = sys.modules.get("pyspark") and sys.modules["pyspark"].SparkContext._active_spark_context
    if spark_context is not None:
        found.add("Spark")
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        found.add("Ray")
    return found


@pytest.fixture(autouse=True)
def _tier(request: pytest.FixtureRequest):
    """A test marked `starts` that runs a pipeline here gets Spark and Ray first; one that runs on an engine alone
    talks to no Prefect server but its own. In a run of the quick tier alone (`make test-quick`), a test fails if it
    leaves Spark, Ray or a process running that was not there before it."""
    item = request.node
    if item.get_closest_marker("starts") is None:
        if not item.config.stash.get(QUICK_ONLY, False):
            yield
            return
        before = _started_here()
        yield
        left = sorted(_started_here() - before)
        if left:
            pytest.fail(
                f"{item.nodeid} started {', '.join(left)}: mark it `starts` (or use a fixture that does) so that "
                "`make test-quick` stays free of Spark, Ray and servers",
                pytrace=False,
            )
        return
    if IN_PROCESS_PIPELINE & set(item.fixturenames):
        request.getfixturevalue("spark")
        request.getfixturevalue("ray_local")
    if "prefect_api" in item.fixturenames:
        yield
        return
    # The training and cache locks go through the Prefect API in use: none but a file lock here, whether or not
    # another test of this process started Prefect's test server before.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        yield
