"""The Spark session factory: one session per process, configured from settings."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from pyspark.sql import SparkSession

from imagelake.infra.class_archive import driver_java_options
from imagelake.infra.compat import instantiated_spark_session, load_jvm_class
from imagelake.infra.console import spark_java_option
from imagelake.infra.jars import jar_folder, runtime_jars
from imagelake.infra.java import ensure_java
from imagelake.infra.lifecycle import exit_on_cancel
from imagelake.infra.settings import Settings

DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
# Spark's own variable for its shared secret (spark.authenticate): standalone workers hand it to their executors in
# it, and every Spark process reads it before its configuration's spark.authenticate.secret.
SPARK_AUTH_SECRET = "_SPARK_AUTH_SECRET"
# What the driver's configuration holds for the secret, which a driver for a standalone master must set: the value
# Spark uses is the environment's (pyspark puts the configuration on spark-submit's command line, which `ps` shows).
SECRET_IN_ENVIRONMENT = "in-the-environment"

_lock = threading.Lock()
_started_in: list[float] = []  # seconds this process took to start its SparkSession (empty: none started)
_started_by: list[str] = []  # the stage that started it
_asked: Counter[str] = Counter()  # calls of spark_session, by the stage that made them

# A session, or a function that gets (or starts) one when first called: what a stage hands on where it may need none.
SparkSource = SparkSession | Callable[[], SparkSession]


def spark_startup_seconds() -> float | None:
    """How long this process's SparkSession took to start (None: this process started none)."""
    return _started_in[-1] if _started_in else None


def spark_started_by() -> str | None:
    """The stage (Prefect task) in which this process started its SparkSession ("-": outside one; None: none
    started)."""
    return _started_by[-1] if _started_by else None


def spark_asks() -> dict[str, int]:
    """How many times each stage ("-": code outside a stage) asked for this process's SparkSession. The first ask of a
    process starts Spark, which costs seconds whatever the data: a stage that can answer without a Spark job must not
    ask."""
    with _lock:
        return dict(_asked)


def _asking_stage() -> str:
    """The name of the Prefect task this thread runs, "-" outside one (Prefect is not imported for the question)."""
    context = sys.modules.get("prefect.context")
    run = context.TaskRunContext.get() if context is not None else None
    return run.task.name if run is not None else "-"


class OnDemand:
    """The process's SparkSession for some settings, got (or started) only when called: what a Table or a stage holds
    where it may need no Spark job at all. Its repr names the master alone (settings may hold store addresses)."""

    __slots__ = ("settings",)

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def __call__(self) -> SparkSession:
        return spark_session(self.settings)

    def __repr__(self) -> str:
        return f"OnDemand({self.settings.spark_master})"


def on_demand(settings: Settings) -> OnDemand:
    """The process's SparkSession for these settings, got (or started) only when the function is called."""
    return OnDemand(settings)


def session_of(spark: SparkSource) -> SparkSession:
    """The session itself: SPARK, or the one its function gets (starting it on the process's first ask)."""
    return spark if isinstance(spark, SparkSession) else spark()


def spark_session(settings: Settings) -> SparkSession:
    """Get or start the process's SparkSession for these settings."""
    exit_on_cancel()  # on every call, as a subflow may have put Prefect's handler back (see infra/lifecycle.py)
    asking = _asking_stage()
    with _lock:
        _asked[asking] += 1
        active = SparkSession.getActiveSession()
        if active is not None:
            active.sparkContext.setLogLevel(settings.spark_log_level)
            return active
        started = time.perf_counter()
        java_home = ensure_java()
        loopback = on_loopback(settings.spark_master)
        if loopback:
            # An embedded Spark, or one on this machine's loopback, listens on loopback only.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # Executors must run this interpreter, or the UDFs cannot import Pillow and pyarrow.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        partitions = str(max(4, (os.cpu_count() or 2) * 2))
        builder = (
            SparkSession.builder.master(settings.spark_master)
            .appName("imagelake")
            .config("spark.driver.memory", settings.spark_driver_memory)
            .config("spark.driver.bindAddress", "127.0.0.1" if loopback else "0.0.0.0")
            .config("spark.driver.host", "127.0.0.1" if loopback else _hostname())
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            # Decoded 224x224 images are ~150 KB each: keep Arrow batches small.
            .config("spark.sql.execution.arrow.maxRecordsPerBatch", "256")
            .config("spark.sql.shuffle.partitions", partitions)
            .config("spark.sql.session.timeZone", "UTC")
        )
        jars = spark_jars(settings)
        if jars:
            builder = builder.config("spark.jars", ",".join(jars))
        if delta_jars_on_classpath(settings):
            # A catalog class that is missing fails every write, so these are set only when the jars are there.
            builder = (
                builder.config("spark.sql.extensions", DELTA_EXTENSION)
                .config("spark.sql.catalog.spark_catalog", DELTA_CATALOG)
                # Retention is `maintain`'s own setting (vacuum_retention_hours), checked there.
                .config("spark.databricks.delta.retentionDurationCheck.enabled", "false")
                # The log is replayed in this many tasks (50 unless set), whatever its size: as many as shuffles use.
                .config("spark.databricks.delta.snapshotPartitions", partitions)
            )
        for key, value in s3a_conf(jars).items():
            builder = builder.config(key, value)
        for key, value in settings.spark_conf.items():
            builder = builder.config(key, value)
        # The classes of a driver's JVM, mapped from the archive `make install` made (infra/class_archive.py).
        java_options = driver_java_options(
            java_home, settings.spark_conf.get("spark.driver.extraJavaOptions", ""), jar_folder(settings.jars_dir)
        )
        # The driver's log: to the command's log file where it names one (infra/console.py), else Spark's default.
        java_options = " ".join(part for part in (java_options, spark_java_option()) if part)
        if java_options:
            builder = builder.config("spark.driver.extraJavaOptions", java_options)
        for key, value in authentication_conf(settings.spark_master).items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        session.sparkContext.setLogLevel(settings.spark_log_level)
        # One empty job: the first job of a session waits for its executors and loads the classes every job needs,
        # seconds that every run pays once, whatever its data; they count as start-up, not as the first stage's work.
        session.range(1).count()
        _started_in.append(round(time.perf_counter() - started, 3))
        _started_by.append(asking)
        return session


def authentication_conf(master: str) -> dict[str, str]:
    """Spark's authentication (spark.authenticate) for a standalone master, when this process's environment holds the
    cluster's shared secret in _SPARK_AUTH_SECRET (the local cluster's cluster.env does); nothing otherwise.

    The secret stays in the environment, which the driver's JVM inherits and reads before its configuration (the
    cluster run in tests/test_cluster.py depends on that order); settings never hold it.
    """
    if not master.startswith("spark://") or not os.environ.get(SPARK_AUTH_SECRET):
        return {}
    return {"spark.authenticate": "true", "spark.authenticate.secret": SECRET_IN_ENVIRONMENT}


def on_loopback(master: str) -> bool:
    """Whether a Spark master URL is this process (local[...]) or a cluster on this machine's loopback."""
    from urllib.parse import urlsplit

    if master.startswith("local"):
        return True
    hosts = (
        [urlsplit(f"spark://{part}").hostname for part in master.removeprefix("spark://").split(",")]
        if master.startswith("spark://")
        else []
    )
    return bool(hosts) and all(host in ("127.0.0.1", "localhost") for host in hosts)


def spark_application() -> dict[str, str] | None:
    """The Spark application this process runs (id, master), or None if it started no Spark."""
    active = SparkSession.getActiveSession() or instantiated_spark_session()  # the session of another thread
    if active is None:
        return None
    context = active.sparkContext
    return {"id": context.applicationId, "master": context.master}


def s3a_conf(jars: list[str]) -> dict[str, str]:
    """Spark's settings for s3:// and s3a:// URIs where the S3A jars are there: both schemes go through S3A.

    Credentials are never put in Spark's configuration: S3A takes them from the environment (AWS_ACCESS_KEY_ID, ...)
    or the machine's role. AWS_ENDPOINT_URL (an S3-compatible server) and AWS_REGION are passed on.
    """
    if not any(Path(jar).name.startswith("hadoop-aws-") for jar in jars):
        return {}
    conf = {
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        # Leave directory markers alone instead of deleting the parents' markers after every write (fewer requests;
        # a store that keeps folders as real directories, as S3Proxy on a filesystem does, refuses those deletes).
        "spark.hadoop.fs.s3a.directory.marker.retention": "keep",
    }
    endpoint = s3_endpoint()
    if endpoint:
        conf["spark.hadoop.fs.s3a.endpoint"] = endpoint
        conf["spark.hadoop.fs.s3a.path.style.access"] = "true"
        conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] = str(endpoint.startswith("https://")).lower()
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        conf["spark.hadoop.fs.s3a.endpoint.region"] = region
    return conf


def s3_endpoint() -> str | None:
    """The S3 endpoint the environment names (an S3-compatible server), as AWS' own tools read it; None: AWS itself."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def spark_jars(settings: Settings) -> list[str]:
    """The settings' jars, then the Delta and S3A jars `make install` put in the environment (infra/jars.py)."""
    return list(dict.fromkeys([*settings.spark_jars, *runtime_jars(jar_folder(settings.jars_dir))]))


def delta_jars_on_classpath(settings: Settings) -> bool:
    """Whether a delta-spark jar is among Spark's jars or in the pyspark installation's jars folder."""
    import pyspark

    bundled = [path.name for path in (Path(pyspark.__file__).parent / "jars").glob("*.jar")]
    names = [Path(jar).name for jar in spark_jars(settings)] + bundled
    return any(name.startswith(("delta-spark_", "delta-core_")) for name in names)


def delta_jars_loaded(spark: SparkSession) -> bool:
    """Whether Spark's JVM can load Delta Lake's classes (format("delta") works)."""
    try:
        # Spark's own class loader also sees jars added through spark.jars.
        load_jvm_class(spark, DELTA_EXTENSION)
    except Exception:  # py4j wraps ClassNotFoundException in its own error type
        return False
    return True


def _hostname() -> str:
    """This machine's address as executors reach it: the IP its host name resolves to (a pod's IP on Kubernetes)."""
    import socket

    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name
