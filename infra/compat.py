"""Every use of a library's private API, in one place, each pinned by a test (in tests/test_compat.py unless the table
names another).

A library upgrade that changes one of these fails its named test, not a pipeline run. The
libraries are imported inside the functions: importing this module must not start (or even
import) Spark, Ray, Petastorm or Prefect (infra/lifecycle.py asks whether pyspark was imported).

| library (pinned) | private use | relied on | wrapper | pinning test |
|---|---|---|---|---|
| pyspark 3.5.9 | `DataFrame._collect_as_arrow()` | Spark 3.5's only collect straight to Arrow: a list of
`pa.RecordBatch`, empty for no rows (`toArrow()` is Spark 4) | `collect_arrow` |
`test_collect_arrow_gives_record_batches` |
| pyspark 3.5.9 | `SparkSession._instantiatedSession` | the process's session whichever thread made it, read without
creating one | `instantiated_spark_session` | `test_instantiated_session_is_seen_from_any_thread` |
| pyspark 3.5.9 | `SparkContext._active_spark_context` | the running context or None, read without creating one
(`getOrCreate` would start one) | `active_spark_context` | `test_active_spark_context_is_the_sessions` |
| pyspark 3.5.9 (py4j) | `spark._jvm....Utils.classForName(name, True, False)` | asks Spark's own class loader (which
sees `spark.jars`) for a class; raises when it is missing | `load_jvm_class` |
`test_load_jvm_class_finds_spark_and_raises_for_missing` |
| petastorm 0.12.1 | `Reader._results_queue_reader` | the object whose `read_next(workers_pool, schema, ngram)` turns
each worker result into what the reader yields | `replace_petastorm_results_reader` |
`test_petastorm_results_reader_can_be_replaced` |
| ray 2.55.1 | `ray._private.services.resolve_ip_for_localhost` | `ray start` (ray.scripts.scripts) looks it up on the
module at call time to swap 127.0.0.1 for a routable address | `keep_ray_loopback` |
`test_keep_ray_loopback_keeps_127_0_0_1` |
| ray 2.55.1 | `ray.init(_system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False})` | a
local Ray's raylet starts no idle Python workers ahead of demand (by default one per logical CPU, up to the soft limit,
which Ray Train's actors never take: they start workers of their own) | `RAY_NO_PRESTARTED_WORKERS` |
`test_a_local_ray_holds_no_prestarted_workers` |
| prefect 3.8.8 | `FlowRunContext.model_copy(update={"result_store": ...})` entered as a context manager | a copy of the
flow run context, entered, becomes the current one: tasks inside it persist and look up stored results in its result
store | `flow_run_context_with_result_storage` | `test_flow_run_context_swap_moves_task_results` |
| petastorm 0.12.1 | the order `Reader._partition_row_groups` and `ConcurrentVentilator` hand a shard's row groups to
the reader's threads | with a seed: all indexes shuffled by `random.Random(seed)`, those equal to the shard modulo the
shard count kept, then (shuffle_row_groups) shuffled by `np.random.RandomState(seed)` | `petastorm_ventilation_order` |
`tests/test_loader.py::test_ventilation_order_is_petastorms` |
| Delta protocol / deltalake 1.6.6 layout | `<table>/_delta_log/*.json` commit files read as text | every commit is a
JSON-lines file under `_delta_log` naming the data files it adds (and removes) by their relative path |
`delta_log_mentions` | `test_delta_log_mentions_every_file_ever_added` |
| Delta protocol / deltalake 1.6.6 layout | `<table>/_delta_log/<20-digit version>.json`, one JSON object per line, one
of them `{"commitInfo": {...}}` | a commit's version is its file's name; delta-rs writes a commit's custom metadata as
keys of its `commitInfo`, Spark its `userMetadata` as one | `delta_log_commits` |
`test_delta_log_commits_numbered_by_file_name` |
| ray 2.55.1 | `RayTrainReportCallback.tmpdir_prefix` | the folder under `tempfile.gettempdir()` in which the callback
stages each epoch's checkpoint; it removes each epoch's subfolder once reported, never the folder |
`report_callback_staging` | `tests/test_training.py::test_the_same_data_settings_and_seed_train_the_same_model` |
| torch 2.13.0 | the layout of a `torch.export.save` archive (`torch.export.pt2_archive`) | tensors are raw bytes
named `weight_N` / `tensor_N` unless their payload config says `use_pickle`; anything else (a pickled weight or
constant, a custom or opaque object, a legacy `.pt` of weights, sample inputs that are not plain tensors) is
unpickled by `torch.export.load` | `program_refusal` | `test_program_refusal_passes_a_saved_program_and_names_pickles` |

"""

from __future__ import annotations

import contextlib
import io
import json
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    from prefect.context import FlowRunContext
    from prefect.filesystems import WritableFileSystem
    from pyspark import SparkContext
    from pyspark.sql import DataFrame, SparkSession

PETASTORM_RESULTS_READER = "_results_queue_reader"


# --- pyspark ---------------------------------------------------------------------------------


def collect_arrow(frame: DataFrame) -> list[pa.RecordBatch]:
    """The frame's rows on the driver as Arrow record batches (an empty list for no rows): Spark 3.5's private Arrow
    collect."""
    return frame._collect_as_arrow()  # noqa: SLF001


def instantiated_spark_session() -> SparkSession | None:
    """The SparkSession this process made, whichever thread made it, or None; never creates one."""
    from pyspark.sql import SparkSession

    return SparkSession._instantiatedSession  # noqa: SLF001


def active_spark_context() -> SparkContext | None:
    """The process's running SparkContext, or None; never creates one (the public getters would)."""
    from pyspark import SparkContext

    return SparkContext._active_spark_context  # noqa: SLF001


def load_jvm_class(spark: SparkSession, name: str) -> None:
    """Load (and initialize) a JVM class through Spark's own class loader, which also sees spark.jars; raises if it is
    missing."""
    spark._jvm.org.apache.spark.util.Utils.classForName(name, True, False)  # noqa: SLF001


# --- petastorm -------------------------------------------------------------------------------


def replace_petastorm_results_reader(reader: Any, new: Any) -> None:
    """Make a Petastorm Reader turn worker results into rows with `new` (its `read_next(workers_pool, schema,
    ngram)`)."""
    if not hasattr(reader, PETASTORM_RESULTS_READER):
        raise RuntimeError("this Petastorm version's Reader has no _results_queue_reader: pin petastorm 0.12.1")
    setattr(reader, PETASTORM_RESULTS_READER, new)


# --- ray -------------------------------------------------------------------------------------

# A local Ray's system config: no idle Python workers started ahead of demand. Each cost about half a CPU second to
# start and polled while idle (0.9 CPU seconds a minute for two), beside Spark on a small machine.
RAY_NO_PRESTARTED_WORKERS = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


@contextlib.contextmanager
def keep_ray_loopback() -> Iterator[None]:
    """Within the block, Ray (`ray start` included) keeps 127.0.0.1 / localhost as given instead of swapping in a
    routable IP."""
    from ray._private import services

    original = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


# --- prefect ---------------------------------------------------------------------------------


def flow_run_context_with_result_storage(context: FlowRunContext, storage: WritableFileSystem) -> FlowRunContext:
    """A copy of the flow run context whose result store writes (results and their metadata) to `storage`.

    Enter it (`with ...:`) to make it the current context: the tasks run inside persist to, and
    find stored results in, that storage; leaving the block puts the original context back.
    """
    store = context.result_store.model_copy(update={"result_storage": storage, "metadata_storage": None})
    return context.model_copy(update={"result_store": store})


# --- Delta log -------------------------------------------------------------------------------


def delta_log_mentions(table_uri: str, names: list[str]) -> set[str]:
    """Which of these data file names (paths relative to the table) any JSON commit in the table's `_delta_log` names.

    A file named in a commit was added by one (a remove names a file an earlier commit added).
    Only the JSON commits are read: commits already folded into a checkpoint and cleaned up are not seen.
    """
    import fsspec

    fs, folder = fsspec.core.url_to_fs(table_uri)
    found: set[str] = set()
    for commit in fs.glob(f"{folder}/_delta_log/*.json"):
        text = fs.cat_file(commit).decode("utf-8")
        found |= {name for name in names if f'"{name}"' in text}
    return found


def delta_log_commits(table_uri: str) -> Iterator[tuple[int, dict]]:
    """The table's JSON commits, newest first: each commit's version (its file's name) and its `commitInfo` ({} if it
    has none).

    delta-rs' `DeltaTable.history()` numbers commits by counting back from a latest version it reads
    apart from the commits, so with another writer committing meanwhile its numbers can be out by one.
    A commit file's name is its version. Commits already folded into a checkpoint and cleaned up are not seen.
    """
    import json

    import fsspec

    fs, folder = fsspec.core.url_to_fs(table_uri)
    named = {path.rsplit("/", 1)[-1]: path for path in fs.ls(f"{folder}/_delta_log", detail=False)}
    versions = sorted(
        (int(name[:-5]) for name in named if name.endswith(".json") and name[:-5].isdigit()), reverse=True
    )
    for version in versions:
        text = fs.cat_file(named[f"{version:020d}.json"]).decode("utf-8")
        info = next(
            (json.loads(line)["commitInfo"] for line in text.splitlines() if line.startswith('{"commitInfo"')), {}
        )
        yield version, info


def petastorm_ventilation_order(
    groups: int, shard: int, shard_count: int, seed: int | None, shuffle: bool
) -> list[int]:
    """The row groups of one shard in the order Petastorm 0.12.1's reader hands them to its threads (a replay of its
    private `Reader._partition_row_groups` and `ConcurrentVentilator`, which the loader needs to put arrivals in
    order)."""
    import random

    import numpy as np

    indexes = list(range(groups))
    if seed is not None:
        random.Random(seed).shuffle(indexes)
    mine = [index for index in indexes if index % shard_count == shard]
    if shuffle:
        np.random.RandomState(seed).shuffle(mine)
    return mine


# --- torch.export ----------------------------------------------------------------------------

# The files a torch.export.save archive holds when every tensor is stored as raw bytes, relative to its one top folder.
_PROGRAM_FILES = re.compile(
    r"(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id|models/[^/]+\.json"
    r"|data/weights/weight_\d+|data/weights/[^/]+_weights_config\.json"
    r"|data/constants/tensor_\d+|data/constants/[^/]+_constants_config\.json|data/sample_inputs/[^/]+\.pt)"
)


def program_refusal(path: str | Path) -> str | None:
    """Why the torch.export archive at PATH is not data alone, or None: `torch.export.load` unpickles (runs code from)
    a weight or constant whose payload config says `use_pickle`, a custom or opaque object, a legacy `.pt` of weights
    or constants, and sample inputs that do not load as plain tensors; an archive of raw tensors and JSON holds none."""
    import torch

    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        return f"not a torch.export archive ({exc})"
    with archive:
        names = [name for name in archive.namelist() if not name.endswith("/")]
        tops = {name.split("/", 1)[0] for name in names}
        if len(tops) != 1:
            return f"not one torch.export archive (top folders: {', '.join(sorted(tops))})"
        for name in names:
            inner = name.split("/", 1)[1] if "/" in name else ""
            if not _PROGRAM_FILES.fullmatch(inner):
                return f"it holds {inner or name}, which torch.export.load would unpickle or run"
            if inner.endswith("_config.json"):
                for fqn, payload in json.loads(archive.read(name)).get("config", {}).items():
                    if payload.get("use_pickle") or not re.fullmatch(r"(weight|tensor)_\d+", payload["path_name"]):
                        return f"its {inner.rsplit('/', 1)[1]} stores {fqn} pickled ({payload['path_name']})"
            if inner.startswith("data/sample_inputs/"):
                try:
                    torch.load(io.BytesIO(archive.read(name)), weights_only=True)
                except Exception as exc:  # noqa: BLE001 - anything torch's data-only loader refuses is refused here
                    return f"its sample inputs are not plain tensors ({type(exc).__name__})"
    return None


def report_callback_staging(callback: Any) -> Path:
    """The folder in which Ray Train's `RayTrainReportCallback` stages each epoch's checkpoint before reporting it."""
    return Path(callback.tmpdir_prefix)
