"""A file replaced by another of the same size, keeping its mtime, is still seen: per store, by what the store gives.

Local folders: the change time and inode (which `cp -p` and `touch -r` cannot set). S3: the ETag. A store that gives
neither (fsspec's memory store here): the content's SHA-256, read at listing time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from deltalake import write_deltalake
from PIL import Image

from imagelake.infra.delta import Table
from imagelake.tasks.data.listing import list_source
from imagelake.tasks.rules.listed_files import is_changed
from imagelake.tasks.rules.schemas import IMAGE_TABLE_SCHEMA
from tests.lake import SCOPE, Lake, copy_digits


def noise_png(seed: int, side: int = 20) -> bytes:
    """An uncompressed PNG: its size depends on the dimensions only, so two seeds give two same-size files."""
    out = fsspec.filesystem("memory").open(f"/noise-{seed}.png", "wb")
    pixels = np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, "PNG", compress_level=0)
    out.close()
    return fsspec.filesystem("memory").cat(f"/noise-{seed}.png")


def test_a_local_file_rewritten_with_the_same_size_and_mtime_is_replaced(
    lake: Lake, digits_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=5)
    first, second = noise_png(1), noise_png(2)
    assert len(first) == len(second) and first != second
    target = source / "1" / "noise.png"
    target.write_bytes(first)
    lake.run(source)
    assert lake.rows()[f"file://{target}"] == hashlib.sha256(first).hexdigest()

    # `cp -p`: the new bytes land in the same file, and the old mtime is put back.
    keep = target.stat()
    staged = tmp_path / "second.png"
    staged.write_bytes(second)
    os.utime(staged, ns=(keep.st_atime_ns, keep.st_mtime_ns))
    subprocess.run(["cp", "-p", str(staged), str(target)], check=True)
    assert (target.stat().st_size, target.stat().st_mtime_ns) == (keep.st_size, keep.st_mtime_ns)
    ingested, resized, written = lake.run(source)
    assert (ingested.candidates, resized.decoded, written.rows) == (1, 1, 1)
    assert lake.rows()[f"file://{target}"] == hashlib.sha256(second).hexdigest()

    # `touch -r` after a rewrite: same again, back to the first bytes.
    reference = tmp_path / "reference"
    reference.touch()
    os.utime(reference, ns=(keep.st_atime_ns, keep.st_mtime_ns))
    target.write_bytes(first)
    subprocess.run(["touch", "-r", str(reference), str(target)], check=True)
    ingested, _, written = lake.run(source)
    assert (ingested.candidates, written.rows) == (1, 1)
    assert lake.rows()[f"file://{target}"] == hashlib.sha256(first).hexdigest()
    # Nothing changed since: nothing is read again.
    assert lake.run(source)[0].candidates == 0


@pytest.mark.both_engines  # a replace is a merge: Spark's executors read its new rows from the bucket
def test_an_object_replaced_on_s3_by_one_of_the_same_size_is_replaced(spark, s3, tmp_path: Path, engine: str) -> None:
    fs = s3.filesystem()
    prefix = f"lake/{os.urandom(6).hex()}"
    fs.pipe(f"{prefix}/src/a/noise.png", noise_png(1))
    fs.pipe(f"{prefix}/src/b/other.png", noise_png(3))
    lake = Lake(spark, f"s3://{prefix}/lake", engine)
    lake.run(f"s3://{prefix}/src")
    entry = [e for e in list_source(f"s3://{prefix}/src", SCOPE) if e["path"].endswith("noise.png")][0]
    assert entry["stamp"].startswith("etag:")
    fs.pipe(f"{prefix}/src/a/noise.png", noise_png(2))
    ingested, _, written = lake.run(f"s3://{prefix}/src")
    assert (ingested.candidates, written.rows) == (1, 1)
    assert lake.rows()[f"s3://{prefix}/src/a/noise.png"] == hashlib.sha256(noise_png(2)).hexdigest()


def test_a_store_without_stamps_is_diffed_on_content_hashes() -> None:
    memory = fsspec.filesystem("memory")
    memory.pipe("/plain-store/a/x.png", noise_png(1))
    listed = list_source("memory://plain-store", SCOPE)
    assert listed[0]["stamp"] == "sha256:" + hashlib.sha256(noise_png(1)).hexdigest()
    known = {e["path"]: (e["size"], e["mtime"], e["stamp"]) for e in listed}
    memory.pipe("/plain-store/a/x.png", noise_png(2))
    relisted = list_source("memory://plain-store", SCOPE)
    assert relisted[0]["size"] == listed[0]["size"]
    assert is_changed(relisted[0], known)


@pytest.mark.both_engines
def test_a_table_from_before_stamps_gains_the_column_without_reading_everything_again(
    spark, digits_dir: Path, tmp_path: Path, engine: str
) -> None:
    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=5)
    built = Lake(spark, tmp_path / "built", engine)
    built.run(source)
    # The same rows in a table with the earlier schema (no `stamp`), as older versions of imagelake wrote it.
    old = Lake(spark, tmp_path / "old", engine)
    rows = Table(built.table, spark, engine).read([n for n in IMAGE_TABLE_SCHEMA.names if n != "stamp"])
    write_deltalake(old.table, rows.cast(pa.schema([f for f in IMAGE_TABLE_SCHEMA if f.name != "stamp"])))
    assert "stamp" not in Table(old.table).columns()
    assert old.run(source)[0].candidates == 0, "rows without a stamp are compared on size and mtime"
    changed = sorted((source / "1").glob("*.png"))[0]
    Image.open(changed).rotate(90).save(changed)
    shutil.copy(sorted((digits_dir / "7").glob("*.png"))[0], source / "1" / "added.png")
    ingested, _, written = old.run(source)
    assert (ingested.candidates, written.rows) == (2, 2)
    table = Table(old.table, spark, engine)
    assert "stamp" in table.columns()
    stamps = dict(zip(*table.read(["path", "stamp"]).to_pydict().values(), strict=True))
    assert (
        stamps[f"file://{changed}"].startswith("ctime:")
        and stamps[f"file://{source}/0/{sorted(os.listdir(source / '0'))[0]}"] is None
    )
    assert len(old.rows()) == 11 and old.run(source)[0].candidates == 0
