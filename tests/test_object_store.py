"""Sources and Delta tables on a real S3-compatible server (S3Proxy on 127.0.0.1), with each Delta engine."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from infra.delta import Table
from tasks.maintain import maintain_table
from tests.lake import Lake, copy_digits


@pytest.fixture
def prefix(s3) -> str:
    return f"s3://lake/{uuid.uuid4().hex[:12]}"


def upload(s3, folder: Path, uri: str) -> None:
    fs = s3.filesystem()
    for path in sorted(folder.rglob("*.png")):
        fs.put_file(str(path), f"{uri.removeprefix('s3://')}/{path.relative_to(folder).as_posix()}")


def test_a_source_and_tables_on_s3_land_rerun_cached_and_are_maintained(spark, s3, digits_dir: Path, tmp_path: Path, prefix: str, engine: str) -> None:
    copy_digits(digits_dir, tmp_path / "src")
    upload(s3, tmp_path / "src", f"{prefix}/src")
    lake = Lake(spark, f"{prefix}/lake", engine)
    ingested, resized, written = lake.run(f"{prefix}/src")
    assert (ingested.candidates, written.rows) == (40, 40)
    assert len(lake.rows()) == 40 and all(p.startswith(f"{prefix}/src/") for p in lake.rows())
    # A re-run lists the bucket again and decodes nothing.
    ingested, resized, written = lake.run(f"{prefix}/src")
    assert (ingested.candidates, resized.decoded, written.rows) == (0, 0, 0)
    # Maintenance runs on the bucket with the same engine.
    report = maintain_table(Table(lake.table, spark, engine), 0, [])
    assert report["engine"] == engine and Table(lake.table, spark, engine).frame().count() == 40
    # The credentials stay in the environment: not in Spark's configuration, not in anything written to the bucket.
    fs = s3.filesystem()
    assert not [key for key, value in spark.sparkContext.getConf().getAll() if s3.secret in value or s3.key in value]
    written = [path for path in fs.find(prefix.removeprefix("s3://")) if not path.endswith(".png")]
    assert any("/_delta_log/" in path for path in written) and any("/staging/" in path for path in written)
    leaked = [path for path in written if s3.secret.encode() in fs.cat(path) or s3.key.encode() in fs.cat(path)]
    assert not leaked, f"a credential was written to {leaked}"
