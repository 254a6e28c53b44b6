"""The walk of a folder source: in path order, a folder's names at a time, each file described as it is yielded, and
the listing written a batch at a time; the same rows and fingerprint as listing each folder whole with fsspec."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

import imagelake.tasks.data.listing as listing
from imagelake.tasks.data.listing import ListingIncomplete, list_source, local_info, save_listing, walk_files
from imagelake.tasks.rules.listed_files import Scope, listing_fingerprint

SCOPE = Scope((".png", ".jpg"))


def whole_folder_walk(fs: Any, folder: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The walk as it was: each folder's entries all described by fsspec's ls, then sorted (a folder's name with a
    slash)."""
    for info in sorted(
        fs.ls(folder, detail=True), key=lambda item: item["name"] + ("/" if item["type"] == "directory" else "")
    ):
        if info["type"] == "directory":
            yield from whole_folder_walk(fs, info["name"])
        else:
            yield info["name"], info


def touch(path: Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def odd_tree(root: Path, outside: Path) -> None:
    """Every rule of a folder walk: dates good and bad, label folders, a file beside a folder of its name's prefix
    (`a.png` sorts before `a/`, `a0.png` after), hidden and `_` folders, links in and out, dangling, to a folder."""
    for day in ("date=2024-03-01", "date=2024-03-02", "date=2024-13-01"):
        for label in ("cat", "dog"):
            for name in ("1.png", "2.PNG", "3.jpg", "notes.txt"):
                touch(root / day / label / name)
    for name in (
        "a.png",
        "a-b.png",
        "a0.png",
        "a/x.png",
        "a/b/y.png",
        "_under/u.png",
        ".hidden/h.png",
        "é.png",
        "top.png",
    ):
        touch(root / name)
    touch(root / "cat" / "empty.png", b"")
    touch(outside / "secret.png")
    (root / "cat" / "in.png").symlink_to(root / "a" / "x.png")
    (root / "cat" / "out.png").symlink_to(outside / "secret.png")
    (root / "cat" / "dangling.png").symlink_to(root / "missing.png")
    (root / "cat" / "folder.png").symlink_to(root / "a")


def test_a_folder_listing_streams_in_path_order_with_the_rows_and_fingerprint_of_whole_folder_listings(
    tmp_path: Path, monkeypatch
) -> None:
    source = tmp_path / "src"
    odd_tree(source, tmp_path / "outside")
    fs, uri = LocalFileSystem(), f"file://{source}"
    for folder, _, _ in os.walk(source):  # each entry described as fsspec's ls describes it
        with os.scandir(folder) as entries:
            for entry in entries:
                assert local_info(fs._strip_protocol(entry.path)) == fs.info(entry), entry.path

    with monkeypatch.context() as patch:
        patch.setattr(listing, "walk_files", whole_folder_walk)
        whole = list_source(uri, SCOPE)
    walk = walk_files(fs, str(source))
    assert isinstance(walk, Iterator), "the walk is lazy: a generator, not a list"
    assert [path for path, _ in walk] == [path for path, _ in whole_folder_walk(fs, str(source))]

    monkeypatch.setattr(listing, "LISTING_BATCH", 4)
    listed = save_listing(uri, SCOPE, str(tmp_path / "staging"))
    rows = pq.read_table(listed.manifest_uri.removeprefix("file://")).to_pylist()
    assert len(whole) > 4 * 3 and rows == whole
    assert listed.listing_fingerprint == listing_fingerprint(whole)
    assert [row["path"] for row in rows] == sorted(row["path"] for row in rows), "the listing comes out in path order"
    issues = {Path(row["path"]).name: row["issue"] for row in rows if row["issue"]}
    expected = {
        "out.png": "symlink_outside_source",
        "dangling.png": "unreadable",
        "h.png": "hidden_path",
        "empty.png": "empty_file",
    }
    assert expected.items() <= issues.items()
    metadata = pq.ParquetFile(listed.manifest_uri.removeprefix("file://")).metadata
    sizes = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    assert max(sizes) <= 4 and sum(sizes) == len(rows), (
        f"written a batch of at most LISTING_BATCH rows at a time: {sizes}"
    )


def test_the_walk_holds_a_folders_names_and_describes_each_file_only_as_it_yields_it(tmp_path: Path) -> None:
    folder = tmp_path / "src" / "cat"
    for n in range(50):
        touch(folder / f"{n:02d}.png")
    walk = walk_files(LocalFileSystem(), str(tmp_path / "src"))
    first, _ = next(walk)
    for path in folder.iterdir():
        if str(path) != first:
            path.unlink()
    assert [path for path, _ in walk] == [], (
        "the walk described the whole folder before its first file: a folder of a million files held a million"
    )


def test_a_local_folder_that_cannot_be_read_stops_the_walk_naming_it(tmp_path: Path, monkeypatch) -> None:
    for name in ("a/1.png", "b/2.png"):
        touch(tmp_path / "src" / name)
    scandir = os.scandir

    def refusing(path: str):
        if str(path).endswith("/b"):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(ListingIncomplete, match=r"could not list file://.*/src/b \(PermissionError"):
        list_source(f"file://{tmp_path / 'src'}", SCOPE)


def test_an_object_store_walk_keeps_no_listed_folder_in_its_cache(s3) -> None:
    fs = s3.filesystem()
    prefix = f"lake/{os.urandom(6).hex()}"
    names = ["date=2024-03-01/cat/1.png", "date=2024-03-01/dog/2.png", "date=2024-03-02/cat/3.png", "top.png"]
    for name in reversed(names):
        fs.pipe(f"{prefix}/src/{name}", b"x")
    listed = list_source(f"s3://{prefix}/src", SCOPE)
    assert [e["path"].split("/src/")[1] for e in listed] == names, "in path order"
    store = fsspec.core.url_to_fs(f"s3://{prefix}/src")[0]
    assert not [folder for folder in store.dircache if prefix in folder], (
        "the store's cache held every folder listed: the whole tree"
    )


def test_a_manifest_written_again_while_another_run_reads_it_is_never_seen_partial(tmp_path: Path) -> None:
    """Two runs of the same source diff it to the same manifest (its name is the diff's fingerprint) at the same time:
    one writes it again while the other's resize reads it. The reader sees the whole file, old or new, never one cut
    short (which Arrow refuses with a ValueError, an error no retry mends: the run failed)."""
    import threading

    import pyarrow as pa

    from imagelake.tasks.data.listing import write_manifest
    from imagelake.tasks.rules.schemas import LISTING_SCHEMA

    row = {name: None for name in LISTING_SCHEMA.names}
    entries = pa.Table.from_pylist([{**row, "path": f"/src/{i:06d}.png"} for i in range(20_000)], schema=LISTING_SCHEMA)
    manifest = str(tmp_path / "ingest-0123456789abcdef0123.parquet")
    write_manifest(entries, manifest)
    stop, seen, failures = threading.Event(), [], []

    def write_again() -> None:
        while not stop.is_set():
            write_manifest(entries, manifest)

    writer = threading.Thread(target=write_again)
    writer.start()
    try:
        for _ in range(200):
            try:
                seen.append(pq.read_table(manifest).num_rows)
            except (OSError, ValueError) as exc:  # a file cut short: Arrow's ArrowInvalid is a ValueError
                failures.append(repr(exc))
    finally:
        stop.set()
        writer.join()
    assert not failures, f"{len(failures)} of 200 reads saw a partial manifest: {failures[0]}"
    assert seen == [20_000] * 200
    assert [p.name for p in tmp_path.iterdir()] == [Path(manifest).name], "no file left aside"
