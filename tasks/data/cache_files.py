"""The cached splits' files, read and kept in one place: the layout the cache stage writes, and every reader of it.

A cache line (one per table, image size, partitioning, split fractions, labels and seed) keeps its files under
`data/<split>/g<generation>/` and one manifest per cached table version, `<split>-v<version>.json`, naming the files
that hold that version's rows of the split; rows carry a `position` column (generation, then file, then row). The
cache stage writes them (tasks/stages/cache.py); training, the gate, the cards and the worker's loader read them through
this module, which imports no Petastorm and no Spark.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from imagelake.tasks.data.listing import modified_seconds
from imagelake.tasks.results import CachedSplits
from imagelake.tasks.rules.splits import SPLITS

# The cache's layout: manifests over generations of files, rows in a seeded order with a `position` column.
LAYOUT = 3


# A generation's positions start at generation << GENERATION_BITS, above every partition and row of Spark's ids.
GENERATION_BITS = 48


class CacheLine:
    """One cache line's folder: its generations of files and its manifests, one per cached table version."""

    def __init__(self, root: str) -> None:
        self.uri = root.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri)

    def manifest(self, split: str, version: int) -> str:
        return f"{self.root}/{split}-v{version}.json"

    def versions(self) -> list[int]:
        """Table versions with a complete manifest (the test split's is written last)."""
        if not self.fs.exists(self.root):
            return []
        names = [path.rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False)]
        return sorted(
            int(name[len("test-v") : -len(".json")])
            for name in names
            if name.startswith("test-v") and name.endswith(".json")
        )

    def read(self, version: int) -> dict[str, Any]:
        """The manifest of every split of VERSION: files (relative to the line), generation and the CachedSplits it
        made."""
        return {split: json.loads(self.fs.cat_file(self.manifest(split, version))) for split in SPLITS}

    def cached(self, version: int, reused: bool) -> CachedSplits:
        """The CachedSplits a version's manifest records (what the cache stage returned for it)."""
        return CachedSplits.model_validate(
            {**json.loads(self.fs.cat_file(self.manifest("test", version)))["cached"], "reused": reused}
        )

    def write(self, version: int, files: dict[str, list[str]], generation: int, cached: CachedSplits) -> None:
        # Each file's sha256, so that damage inside a file (its footer intact, its rows counted right) is found: files
        # an earlier manifest of the line recorded keep their digest, the new ones are read once to make theirs.
        known = {
            name: digest
            for earlier in self.versions()
            for manifest in self.read(earlier).values()
            for name, digest in manifest.get("digests", {}).items()
        }
        for split in SPLITS:  # test last: its manifest's presence means the version is complete
            record = {
                "files": sorted(files[split]),
                "generation": generation,
                "cached": cached.model_dump(mode="json"),
                "rows": cached.counts[split],
                "digests": {name: known.get(name) or self.digest(name) for name in sorted(files[split])},
            }
            aside = f"{self.manifest(split, version)}.{uuid.uuid4().hex}"
            self.fs.pipe_file(aside, json.dumps(record, indent=1).encode())
            self.fs.mv(aside, self.manifest(split, version))

    def generation_folder(self, split: str, generation: int) -> str:
        return f"data/{split}/g{generation:06d}"

    def files_in(self, folder: str) -> list[str]:
        found = self.fs.find(f"{self.root}/{folder}")
        return sorted(
            p[len(self.root) + 1 :]
            for p in found
            if p.endswith(".parquet") and not p.rsplit("/", 1)[-1].startswith(("_", "."))
        )

    def problem(self, version: int) -> str | None:
        """What is wrong with a cached version's files (one gone, other rows than its manifest records, or damage
        inside one: another sha256 than the one recorded when it was written); None if nothing."""
        try:
            for split, manifest in self.read(version).items():
                uri = self.fs.unstrip_protocol(self.manifest(split, version))
                check_split(uri, split, manifest["rows"])
                for name, digest in manifest.get("digests", {}).items():  # a manifest from before digests has none
                    if self.digest(name) != digest:
                        return (
                            f"the cached {split} split {uri} names {name}, which is damaged (its sha256 is not the one "
                            "recorded when it was written)"
                        )
        except (FileNotFoundError, ValueError) as exc:
            return str(exc)
        return None

    def digest(self, name: str) -> str:
        """The sha256 of the line's file NAME, read in pieces."""
        sha = hashlib.sha256()
        with self.fs.open(f"{self.root}/{name}", "rb") as handle:
            while piece := handle.read(8 << 20):
                sha.update(piece)
        return sha.hexdigest()

    def rows_in(self, files: list[str]) -> int:
        total = 0
        for name in files:
            with self.fs.open(f"{self.root}/{name}", "rb") as handle:
                total += pq.ParquetFile(handle).metadata.num_rows
        return total


def nearest(versions: list[int], version: int) -> int | None:
    """The cached version to grow from: the latest at or before VERSION, else the earliest after it."""
    before = [v for v in versions if v <= version]
    return before[-1] if before else (versions[0] if versions else None)


def mark_read(manifests: list[str]) -> None:
    """Mark the split manifests a run is about to read as in use now: each is written again as it is (aside, then
    moved over), so that `clean_cache` counts its retention from now. A run that reuses an old cache version (a
    retrain, a stored cache result) would otherwise read files `maintain` may be removing."""
    for uri in manifests:
        fs, path = fsspec.core.url_to_fs(uri)
        aside = f"{path}.{uuid.uuid4().hex}"
        fs.pipe_file(aside, fs.cat_file(path))
        fs.mv(aside, path)


def clean_cache(
    cache_root: str, keep_versions: dict[str, list[int]], retention_hours: float, now: float | None = None
) -> dict[str, int]:
    """Remove manifests and files that no kept version needs, in every cache line under CACHE_ROOT.

    Kept: each line's newest version, the versions in KEEP_VERSIONS (by table URI: what registered models were
    trained on), and manifests younger than the retention. A file goes when no kept manifest names it and it is
    older than the retention (a cache stage writing now has files no manifest names yet).
    """
    fs, root = fsspec.core.url_to_fs(cache_root)
    now = time.time() if now is None else now
    removed = {"manifests": 0, "files": 0, "bytes": 0}
    if not fs.exists(root):
        return removed
    for folder in fs.ls(root, detail=False):
        line = CacheLine(fs.unstrip_protocol(folder))
        versions = line.versions()
        if not versions:
            continue  # not a cache line of this layout
        table_uri = line.read(versions[-1])["test"]["cached"]["table_uri"]
        kept = {versions[-1], *keep_versions.get(table_uri, [])}
        # A version with a cached version's rows (a compaction) hands out that version's manifests: they stay with it.
        kept |= {line.cached(version, reused=True).table_version for version in versions if version in kept}
        needed: set[str] = set()
        for version in versions:
            young = now - modified_seconds(fs.info(line.manifest("test", version))) < retention_hours * 3600
            if version in kept or young:
                needed.update(name for manifest in line.read(version).values() for name in manifest["files"])
                continue
            for split in SPLITS:
                fs.rm(line.manifest(split, version))
                removed["manifests"] += 1
        for path, info in fs.find(f"{line.root}/data", detail=True).items():
            name = path[len(line.root) + 1 :]
            if (
                name.endswith(".parquet")
                and name not in needed
                and now - modified_seconds(info) >= retention_hours * 3600
            ):
                folder, base = path.rsplit("/", 1)
                fs.rm(path)
                if fs.exists(f"{folder}/.{base}.crc"):  # the checksum Hadoop's local file system writes beside it
                    fs.rm(f"{folder}/.{base}.crc")
                removed["files"] += 1
                removed["bytes"] += int(info.get("size") or 0)
    return removed


def cached_files(cached: CachedSplits) -> list[str]:
    """What a cache result names: each split's manifest and the files it lists (the first missing manifest ends the
    list)."""
    uris = []
    for uri in cached.splits.values():
        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.exists(path):
            return [*uris, uri]
        uris += [uri, *(fs.unstrip_protocol(name) for name in split_files(uri)[1])]
    return uris


def damaged_split(cached: CachedSplits) -> str | None:
    """Why a cache result whose files are all there is no result: what CacheLine.problem finds in its version (a split
    whose files hold other rows than the plan counted, a part file rewritten or cut short). The stage then writes it
    again."""
    return CacheLine(cached.cache_dir).problem(cached.table_version)


POSITION = "position"  # the cache's row id: names the row group a row came from


def split_files(url: str) -> tuple[Any, list[str]]:
    """A cached split's filesystem and Parquet files, sorted: those its manifest names (a .json file, names relative
    to its folder; see tasks/stages/cache.py) or those in a folder."""
    fs, path = fsspec.core.url_to_fs(url)
    if path.endswith(".json"):
        folder = path.rsplit("/", 1)[0]
        return fs, sorted(f"{folder}/{name}" for name in json.loads(fs.cat_file(path))["files"])
    return fs, sorted(
        p for p in fs.find(path) if p.endswith(".parquet") and not p.rsplit("/", 1)[-1].startswith(("_", "."))
    )


def split_urls(url: str) -> list[str]:
    """A cached split's Parquet files as URIs (what Petastorm and pyarrow are given)."""
    fs, files = split_files(url)
    return [fs.unstrip_protocol(path) for path in files]


def row_groups(url: str) -> tuple[tuple[int, int | None], ...]:
    """(rows, first position) of each row group of a cached split, in the order Petastorm numbers them
    (files by path, then row groups). The first position is None where the files have no position column."""
    fs, files = split_files(url)
    groups: list[tuple[int, int | None]] = []
    for path in files:
        with fs.open(path, "rb") as handle:
            meta = pq.ParquetFile(handle).metadata
        column = meta.schema.names.index(POSITION) if POSITION in meta.schema.names else None
        for i in range(meta.num_row_groups):
            group = meta.row_group(i)
            stats = group.column(column).statistics if column is not None else None
            # Positions rise through a file, so a group's minimum is its first row's.
            groups.append((group.num_rows, int(stats.min) if stats is not None and stats.has_min_max else None))
    return tuple(groups)


def check_split(url: str, split: str, expected_rows: int) -> None:
    """A cached split must hold the rows its plan counted: every file its manifest names is there, and their rows add
    up. Training never runs on a partial split (a part file deleted by hand, a cleaned disk)."""
    fs, files = split_files(url)
    for path in files:
        if not fs.exists(path):
            raise FileNotFoundError(
                f"the cached {split} split {url} names {fs.unstrip_protocol(path)}, which is gone: run again "
                "(the cache stage rebuilds it)"
            )
    rows = sum(rows for rows, _ in row_groups(url))
    if rows != expected_rows:
        raise ValueError(
            f"the cached {split} split {url} holds {rows} rows where its table version has {expected_rows}: "
            "run again (the cache stage rebuilds it)"
        )


def row_group_sizes(url: str) -> tuple[int, ...]:
    """Rows of each row group of a Parquet folder, in Petastorm's order."""
    return tuple(rows for rows, _ in row_groups(url))


def one_chunk(images: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A binary column as one array: a single chunk as it is (combine_chunks would copy)."""
    if isinstance(images, pa.Array):
        return images
    return images.chunk(0) if images.num_chunks == 1 else images.combine_chunks()


def value_offsets(column: pa.Array) -> np.ndarray:
    """Where each value of a binary array starts in its data buffer, and where the last ends."""
    return np.frombuffer(column.buffers()[1], dtype=np.int32, count=len(column) + 1, offset=column.offset * 4)


def pixel_rows(
    images: pa.ChunkedArray | pa.Array, pixels: int, where: str, image_format: str = "raw", threads: int = 1
) -> np.ndarray:
    """A binary column of images, `pixels` bytes each, as one (rows, pixels) uint8 view of its Arrow data buffer; a
    column of JPEG files (`image_format="jpeg"`, see encode_jpeg) decoded into a new array of the same shape, by up to
    THREADS threads.

    `where` names the data in the error.
    """
    if image_format == "jpeg":
        return decoded_rows(images, pixels, where, threads)
    column = one_chunk(images)
    offsets = value_offsets(column)
    if column.null_count or np.any(np.diff(offsets) != pixels):
        raise ValueError(
            f"{where} holds images that are not {pixels} bytes each: rebuild the cache for this image_size"
        )
    # Binary values lie back to back: one frombuffer over the data buffer reads them all.
    data = np.frombuffer(column.buffers()[2], dtype=np.uint8, count=len(column) * pixels, offset=int(offsets[0]))
    return data.reshape(len(column), pixels)


def encode_jpeg(images: pa.ChunkedArray | pa.Array, image_size: int, quality: int) -> pa.Array:
    """Raw pixel rows (image_size x image_size RGB) as JPEG files of that QUALITY, one per row. Chroma is kept at full
    resolution (4:4:4): a small image's colour edges are what 4:2:0 would blur."""
    side = (image_size, image_size)
    encoded = []
    for row in pixel_rows(images, image_size * image_size * 3, "the rows to cache"):
        out = io.BytesIO()
        Image.frombuffer("RGB", side, row, "raw", "RGB", 0, 1).save(out, "JPEG", quality=quality, subsampling=0)
        encoded.append(out.getvalue())
    return pa.array(encoded, pa.binary())


def encoded_rows(images: pa.ChunkedArray | pa.Array, where: str = "the cached split") -> list[np.ndarray]:
    """A binary column's values (a JPEG cache's files) as uint8 views of its Arrow data buffer, one per row."""
    column = one_chunk(images)
    if column.null_count:
        raise ValueError(f"{where} holds a row with no image: rebuild the cache")
    offsets = value_offsets(column)
    data = np.frombuffer(column.buffers()[2], dtype=np.uint8)
    return [data[offsets[row] : offsets[row + 1]] for row in range(len(column))]


def decoded_rows(images: pa.ChunkedArray | pa.Array, pixels: int, where: str, threads: int = 1) -> np.ndarray:
    """A binary column of JPEG files (encode_jpeg's) as (rows, pixels) uint8 pixels, read straight from the Arrow data
    buffer. With THREADS > 1, that many threads decode a share of the rows each (Pillow lets go of the interpreter
    while it decodes); they end before this returns."""
    files = encoded_rows(images, where)
    side = math.isqrt(pixels // 3)
    out = np.empty((len(files), pixels), dtype=np.uint8)
    shares = [rows for rows in np.array_split(np.arange(len(files)), max(1, min(threads, len(files)))) if len(rows)]
    if len(shares) > 1:
        with ThreadPoolExecutor(len(shares), thread_name_prefix="jpeg-decode") as pool:
            list(pool.map(lambda rows: decode_into(out, rows, files, side, where), shares))
    elif shares:
        decode_into(out, shares[0], files, side, where)
    return out


def decode_into(out: np.ndarray, rows: np.ndarray, files: list[np.ndarray], side: int, where: str) -> None:
    """Decode the JPEG FILES of ROWS into those rows of OUT."""
    for row in rows.tolist():
        try:
            with Image.open(io.BytesIO(files[row]), formats=["JPEG"]) as image:
                if image.size != (side, side) or image.mode != "RGB":
                    raise ValueError(f"a {image.mode} image of {image.size[0]}x{image.size[1]}")
                out[row] = np.asarray(image).reshape(-1)
        except UnidentifiedImageError:  # its own message names the in-memory buffer, which tells the user nothing
            raise ValueError(f"{where} holds an image that is not a JPEG: rebuild the cache") from None
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{where} holds an image that is not a {side}x{side} RGB JPEG ({exc}): rebuild the cache"
            ) from None


def split_format(url: str) -> str:
    """How a cached split holds its images, as its manifest records ("raw" for a folder, or a manifest written before
    JPEG caches)."""
    fs, path = fsspec.core.url_to_fs(url)
    if not path.endswith(".json"):
        return "raw"
    return json.loads(fs.cat_file(path)).get("cached", {}).get("image_format", "raw")


def label_samples(
    url: str, image_size: int, labels: list[str], per_label: int = 8, max_groups: int = 64
) -> dict[str, np.ndarray]:
    """The first `per_label` images of each label of a cached split (its rows are in a seeded random order),
    from at most `max_groups` row groups: a rare label may show fewer."""
    fs, files = split_files(url)
    image_format = split_format(url)
    found: dict[int, list[np.ndarray]] = {index: [] for index in range(len(labels))}
    read = 0
    for path in files:
        with fs.open(path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            for group in range(parquet.num_row_groups):
                if read >= max_groups or all(len(images) >= per_label for images in found.values()):
                    break
                read += 1
                table = parquet.read_row_group(group, columns=["image", "label"])
                kept, wanted = [], {index: per_label - len(images) for index, images in found.items()}
                for row, label in enumerate(table.column("label").to_numpy().tolist()):
                    if wanted[label] > 0:
                        wanted[label] -= 1
                        kept.append((row, label))
                if not kept:
                    continue
                pixels = pixel_rows(  # only the rows kept: a JPEG cache decodes no other
                    table.column("image").take(pa.array([row for row, _ in kept])),
                    image_size * image_size * 3,
                    f"cached split {url}",
                    image_format,
                )
                for (_, label), image in zip(kept, pixels, strict=True):
                    found[label].append(image.reshape(image_size, image_size, 3))  # a copy, not a view of the group
    return {
        labels[index]: np.stack(images) if images else np.zeros((0, image_size, image_size, 3), np.uint8)
        for index, images in found.items()
    }
