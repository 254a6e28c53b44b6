"""Pins each private library behaviour that infra/compat.py wraps, with the real library (one test per use)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imagelake.infra import compat

# --- pyspark ---------------------------------------------------------------------------------


def test_collect_arrow_gives_record_batches(spark) -> None:
    frame = spark.range(5).selectExpr("id", "cast(id as string) as name")
    batches = compat.collect_arrow(frame)
    assert batches and all(isinstance(batch, pa.RecordBatch) for batch in batches)
    table = pa.Table.from_batches(batches)
    assert table.column_names == ["id", "name"] and sorted(table.column("id").to_pylist()) == [0, 1, 2, 3, 4]
    assert not compat.collect_arrow(frame.where("id < 0")), (
        "no rows: an empty (falsy) result, which read_current relies on"
    )


def test_instantiated_session_is_seen_from_any_thread(spark) -> None:
    assert compat.instantiated_spark_session() is spark
    seen: list = []
    thread = threading.Thread(target=lambda: seen.append(compat.instantiated_spark_session()))
    thread.start()
    thread.join()
    assert seen == [spark]


def test_active_spark_context_is_the_sessions(spark) -> None:
    assert compat.active_spark_context() is spark.sparkContext


def test_load_jvm_class_finds_spark_and_raises_for_missing(spark) -> None:
    compat.load_jvm_class(spark, "org.apache.spark.sql.SparkSession")
    with pytest.raises(Exception, match="ClassNotFoundException"):
        compat.load_jvm_class(spark, "io.imagelake.NoSuchClass")


def test_the_suite_s_spark_compiles_no_class_for_a_new_query(spark) -> None:
    """The suite's own Spark settings (tests/conftest.py's SUITE_SPARK_CONF, given to every driver it starts): with
    the internal factoryMode=NO_CODEGEN and whole-stage code generation off, a projection and a filter unlike any query
    before them compile no Java class, where Spark's defaults compile some, and both answer the same."""
    import random

    from tests.conftest import SUITE_SPARK_CONF

    conf = spark.sparkContext.getConf()
    assert {key: conf.get(key) for key in SUITE_SPARK_CONF} == SUITE_SPARK_CONF, "PYSPARK_SUBMIT_ARGS set elsewhere?"
    compiled = spark._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()  # noqa: SLF001

    def query(settings: dict[str, str]) -> tuple[int, list[int]]:
        """Classes compiled for a new query under SETTINGS, and its answer."""
        saved = {key: spark.conf.get(key) for key in settings}
        for key, value in settings.items():
            spark.conf.set(key, value)
        try:
            factor = random.randrange(2, 1 << 30)  # a literal of its own: no class made for an earlier query fits
            before = compiled.getCount()
            rows = spark.range(40).selectExpr(f"id * {factor} AS x").where(f"x % {factor} = 0 AND x > {factor}")
            answer = [row.x // factor for row in rows.collect()]
            return compiled.getCount() - before, answer
        finally:
            for key, value in saved.items():
                spark.conf.set(key, value)

    suite, answer = query(SUITE_SPARK_CONF)
    defaults, same = query({"spark.sql.codegen.wholeStage": "true", "spark.sql.codegen.factoryMode": "FALLBACK"})
    assert (suite, answer) == (0, list(range(2, 40))), f"{suite} classes compiled"
    assert defaults > 0 and same == answer, "Spark's defaults compile the query's classes"


# --- petastorm -------------------------------------------------------------------------------


def test_petastorm_results_reader_can_be_replaced(tmp_path: Path) -> None:
    from petastorm import make_batch_reader
    from petastorm.arrow_reader_worker import ArrowReaderWorkerResultsQueueReader
    from petastorm.workers_pool import EmptyResultError

    pq.write_table(pa.table({"x": list(range(10))}), tmp_path / "part.parquet", row_group_size=5)

    class Tables(ArrowReaderWorkerResultsQueueReader):
        """Hands over each worker result (one row group, as an Arrow table) untouched."""

        def read_next(self, workers_pool, schema, ngram):
            try:
                return workers_pool.get_results()
            except EmptyResultError:
                raise StopIteration from None

    with make_batch_reader(f"file://{tmp_path}", num_epochs=1, workers_count=1, shuffle_row_groups=False) as reader:
        compat.replace_petastorm_results_reader(reader, Tables())
        groups = list(reader)
    assert all(isinstance(group, pa.Table) for group in groups), "the reader yields what read_next returns"
    assert sorted(x for group in groups for x in group.column("x").to_pylist()) == list(range(10))
    assert len(groups) == 2, "read_next is called once per row group"

    with pytest.raises(RuntimeError, match="pin petastorm 0.12.1"):
        compat.replace_petastorm_results_reader(object(), Tables())


# --- ray -------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray.scripts imports Ray Serve's pydantic models
def test_keep_ray_loopback_keeps_127_0_0_1() -> None:
    import ray.scripts.scripts as scripts
    from ray._private import services

    assert scripts.services is services, "`ray start` must look the function up on the module the patch changes"
    original = services.resolve_ip_for_localhost
    with compat.keep_ray_loopback():
        assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
        assert services.resolve_ip_for_localhost("localhost") == "localhost"
        assert services.canonicalize_bootstrap_address("127.0.0.1:6379") == "127.0.0.1:6379"
    assert services.resolve_ip_for_localhost is original
    assert original("10.1.2.3") == "10.1.2.3"


def test_a_local_ray_holds_no_prestarted_workers(ray_local) -> None:
    """The session's Ray is started as every local Ray is (connect_ray, with compat.RAY_NO_PRESTARTED_WORKERS): over
    a few seconds, none of its processes is an idle Python worker (by default two here, one per core)."""
    import psutil

    def idle_workers() -> list[int]:
        found = []
        for process in psutil.Process().children(recursive=True):
            try:
                if process.cmdline()[:1] == ["ray::IDLE"]:
                    found.append(process.pid)
            except psutil.Error:
                continue
        return found

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert not idle_workers(), "idle Ray workers started ahead of demand"
        time.sleep(0.25)


# --- prefect ---------------------------------------------------------------------------------


def test_flow_run_context_swap_moves_task_results(prefect_api: str, tmp_path: Path) -> None:
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from prefect.filesystems import LocalFileSystem

    calls: list[int] = []
    storage = tmp_path / "results"

    @task(persist_result=True, cache_key_fn=lambda *_: "compat-pinned-key")
    def answer() -> int:
        calls.append(1)
        return 42

    @flow
    def staged() -> tuple[int, bool, bool]:
        outer = FlowRunContext.get()
        with compat.flow_run_context_with_result_storage(outer, LocalFileSystem(basepath=str(storage))):
            inner = FlowRunContext.get()
            swapped = inner is not outer and inner.result_store.result_storage.basepath == str(storage)
            value = answer()
        return value, swapped, FlowRunContext.get() is outer

    assert staged() == (42, True, True)
    assert (storage / "compat-pinned-key").exists(), (
        "the task's result (with its metadata) went to the swapped-in storage"
    )
    assert staged()[0] == 42
    assert calls == [1], "the second flow run found the cached result in that storage"


# --- Delta log -------------------------------------------------------------------------------


def test_delta_log_mentions_every_file_ever_added(tmp_path: Path) -> None:
    from deltalake import DeltaTable, write_deltalake

    def names(table: DeltaTable) -> list[str]:  # the data files of the current version, relative to the table
        return pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist()

    uri = str(tmp_path / "table")
    write_deltalake(uri, pa.table({"x": [1, 2]}))
    first = names(DeltaTable(uri))
    write_deltalake(uri, pa.table({"x": [3]}), mode="overwrite")  # removes the first files from the current version
    second = [name for name in names(DeltaTable(uri)) if name not in first]
    assert first and second and not set(first) & set(names(DeltaTable(uri)))
    assert sorted((tmp_path / "table" / "_delta_log").glob("*.json")), "commits are JSON files in _delta_log"
    assert compat.delta_log_mentions(uri, [*first, *second, "part-00000-never-written.parquet"]) == {*first, *second}
    assert compat.delta_log_mentions(f"file://{uri}", first) == set(first)


def test_delta_log_commits_numbered_by_file_name(spark, tmp_path: Path) -> None:
    from deltalake import CommitProperties, DeltaTable, write_deltalake

    uri = str(tmp_path / "table")
    write_deltalake(
        uri, pa.table({"x": [1]}), commit_properties=CommitProperties(custom_metadata={"imagelake.test": "rs-0"})
    )
    write_deltalake(
        uri,
        pa.table({"x": [2]}),
        mode="append",
        commit_properties=CommitProperties(custom_metadata={"imagelake.test": "rs-1"}),
    )
    spark.createDataFrame([(3,)], "x long").write.format("delta").option("userMetadata", "spark-2").mode("append").save(
        uri
    )
    assert sorted(p.name for p in (tmp_path / "table" / "_delta_log").glob("*.json")) == [
        f"{v:020d}.json" for v in range(3)
    ]
    commits = list(compat.delta_log_commits(uri))
    assert [version for version, _ in commits] == [2, 1, 0], "newest first, numbered by the file's name"
    assert [info.get("imagelake.test") or info.get("userMetadata") for _, info in commits] == [
        "spark-2",
        "rs-1",
        "rs-0",
    ]
    assert all(info["operation"] in ("WRITE", "CREATE TABLE") and info["timestamp"] > 0 for _, info in commits)
    assert DeltaTable(uri).version() == 2
    assert list(compat.delta_log_commits(f"file://{uri}")) == commits


# --- torch.export ----------------------------------------------------------------------------


def saved_program(path: Path) -> Path:
    """A small module exported and saved as torch.export.save writes it."""
    import torch

    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).eval()
    torch.export.save(torch.export.export(module, (torch.zeros(4, 3),)), str(path))
    return path


def pickled_program(path: Path, marker: Path) -> Path:
    """A saved program whose first weight is stored pickled (its config says `use_pickle`), the pickle writing MARKER
    when it is loaded."""
    import io
    import json
    import zipfile

    import torch

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('payload ran')",))

    pickled = io.BytesIO()
    torch.save(Payload(), pickled)
    with zipfile.ZipFile(saved_program(path.with_name(f"plain-{path.name}"))) as source:
        (config_name,) = [name for name in source.namelist() if name.endswith("_weights_config.json")]
        config = json.loads(source.read(config_name))
        first = next(iter(config["config"].values()))
        first["use_pickle"] = True
        weight = f"{config_name.rsplit('/', 1)[0]}/{first['path_name']}"
        with zipfile.ZipFile(path, "w") as crafted:
            for item in source.infolist():
                data = {config_name: json.dumps(config).encode(), weight: pickled.getvalue()}.get(item.filename)
                crafted.writestr(item, data if data is not None else source.read(item))
    return path


def test_program_refusal_passes_a_saved_program_and_names_pickles(tmp_path: Path) -> None:
    """A program as torch.export.save writes it is data alone; one whose weight config says `use_pickle` is refused
    by name, and torch.export.load really runs its pickle (the behaviour the refusal guards against)."""
    import torch

    plain = saved_program(tmp_path / "plain.pt2")
    assert compat.program_refusal(plain) is None
    assert torch.export.load(str(plain)).module()(torch.ones(4, 3)).shape == (4, 2)

    marker = tmp_path / "payload-ran"
    crafted = pickled_program(tmp_path / "crafted.pt2", marker)
    assert "stores" in compat.program_refusal(crafted) and "pickled" in compat.program_refusal(crafted)
    assert not marker.exists()
    with pytest.raises(Exception):  # noqa: B017 - whatever torch makes of the payload's None, after running it
        torch.export.load(str(crafted))
    assert marker.exists(), "torch.export.load unpickles a weight marked use_pickle"
