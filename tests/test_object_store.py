"""Sources and Delta tables on a real S3-compatible server (S3Proxy on 127.0.0.1), with each Delta engine."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from imagelake.infra.delta import Table
from imagelake.tasks.stages.maintain import maintain_table
from tests.conftest import cli_env
from tests.lake import Lake, copy_digits


@pytest.fixture
def prefix(s3) -> str:
    return f"s3://lake/{uuid.uuid4().hex[:12]}"


def upload(s3, folder: Path, uri: str) -> None:
    fs = s3.filesystem()
    for path in sorted(folder.rglob("*.png")):
        fs.put_file(str(path), f"{uri.removeprefix('s3://')}/{path.relative_to(folder).as_posix()}")


@pytest.mark.both_engines
def test_a_source_and_tables_on_s3_land_rerun_cached_and_are_maintained(
    spark, s3, digits_dir: Path, tmp_path: Path, prefix: str, engine: str
) -> None:
    copy_digits(digits_dir, tmp_path / "src")
    upload(s3, tmp_path / "src", f"{prefix}/src")
    lake = Lake(spark, f"{prefix}/lake", engine)
    ingested, resized, written = lake.run(f"{prefix}/src")
    assert (ingested.candidates, written.rows) == (40, 40)
    assert len(lake.rows()) == 40 and all(p.startswith(f"{prefix}/src/") for p in lake.rows())
    # A re-run lists the bucket again and decodes nothing.
    ingested, resized, written = lake.run(f"{prefix}/src")
    assert (ingested.candidates, resized.decoded, written.rows) == (0, 0, 0)
    # `maintain` runs on the bucket with the same engine.
    report = maintain_table(Table(lake.table, spark, engine), 0, [])
    assert report["engine"] == engine and Table(lake.table, spark, engine).frame().count() == 40
    # The credentials stay in the environment: not in Spark's configuration, not in anything written to the bucket.
    fs = s3.filesystem()
    assert not [key for key, value in spark.sparkContext.getConf().getAll() if s3.secret in value or s3.key in value]
    written = [path for path in fs.find(prefix.removeprefix("s3://")) if not path.endswith(".png")]
    assert any("/_delta_log/" in path for path in written) and any("/staging/" in path for path in written)
    leaked = [path for path in written if s3.secret.encode() in fs.cat(path) or s3.key.encode() in fs.cat(path)]
    assert not leaked, f"a credential was written to {leaked}"


@pytest.mark.slow
def test_the_whole_pipeline_runs_on_s3_and_a_rerun_is_cached(
    s3, digits_dir: Path, tmp_path: Path, prefect_api: str
) -> None:
    """Source, tables, staging, Petastorm cache, Ray Train checkpoints and Prefect results all in the bucket."""
    bucket = f"lake/{uuid.uuid4().hex[:12]}"
    copy_digits(digits_dir, tmp_path / "src")  # 40 images: what is checked is where each part lands, not the model
    upload(s3, tmp_path / "src", f"s3://{bucket}/src")
    settings = [
        f"workspace={tmp_path / 'ws'}",
        "image_size=32",
        # One epoch on one worker: where a checkpoint lands does not depend on how many there are.
        "max_epochs=1",
        "num_workers=1",
        "batch_size=16",
        "model_name=s3-digits",
        f"table_root=s3://{bucket}/tables",
        f"staging_root=s3://{bucket}/staging",
        f"cache_root=s3://{bucket}/cache",
        f"ray_storage_root=s3://{bucket}/ray",
        f"results_root=s3://{bucket}/results",
    ]
    command = [
        str(Path(sys.executable).parent / "imagelake"),
        "run",
        "--source",
        f"s3://{bucket}/src",
        "--json",
        *[a for s in settings for a in ("--set", s)],
    ]
    env = cli_env({"PREFECT_API_URL": prefect_api})
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 40 and summary["delta_table"] == f"s3://{bucket}/tables/images"
    assert summary["checkpoint"].startswith(f"s3://{bucket}/ray/") and summary["cache_dir"].startswith(
        f"s3://{bucket}/cache/"
    )
    fs = s3.filesystem()
    written = fs.find(bucket)
    for part in ("tables/images/_delta_log/", "staging/", "cache/", "ray/", "results/"):
        assert any(f"{bucket}/{part}" in path for path in written), f"nothing under s3://{bucket}/{part}"
    assert not (tmp_path / "ws" / "ray_results").exists() and not (tmp_path / "ws" / "cache").exists()

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    again = json.loads(second.stdout.strip().splitlines()[-1])
    assert (again["files_decoded"], again["rows_added"], again["delta_version"], again["model_version"]) == (
        0,
        0,
        0,
        "1",
    )
    assert {"split", "cache", "train", "promote"} <= set(again["results_reused"])

    # The credentials were only ever in the environment.
    texts = {"output": first.stdout + first.stderr + second.stdout + second.stderr}
    leaked = [name for name, text in texts.items() if s3.secret in text or s3.key in text]
    fs.invalidate_cache()  # the listing above is from before the second run
    stored = {path: fs.cat(path) for path in fs.find(bucket) if not path.endswith("/")}
    stored.update({str(p): p.read_bytes() for p in (tmp_path / "ws").rglob("*") if p.is_file()})
    leaked += [path for path, data in stored.items() if s3.secret.encode() in data or s3.key.encode() in data]
    assert not leaked, f"a credential appears in: {leaked}"
