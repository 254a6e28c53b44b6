"""Ingest: list image files under a source, read their bytes with Spark's binaryFile source, hash the content."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from prefect.cache_policies import CachePolicy
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from infra.settings import Settings
from infra.spark import spark_session
from tasks.results import Ingested
from tasks.stage import STAGE_CACHE, stage


class SourceError(ValueError):
    """The source folder is missing, unreadable or holds no images."""


def source_uri(source: str) -> str:
    """A URI that Spark and fsspec both read: local paths become absolute file:// URIs."""
    if "://" in source:
        return source
    path = Path(source).expanduser().resolve()
    if not path.is_dir():
        raise SourceError(f"source {source!r} is not a folder: pass a folder of images laid out as <label>/<file>")
    return path.as_uri()


def list_images(uri: str, extensions: list[str]) -> list[tuple[str, int, str]]:
    """(path, size, modification stamp) of every image file under the source, sorted."""
    fs, root = fsspec.core.url_to_fs(uri)
    found = fs.find(root, detail=True)
    wanted = tuple(ext.lower() for ext in extensions)
    listing = [
        (path, int(info.get("size") or 0), str(info.get("mtime") or info.get("LastModified") or info.get("ETag") or ""))
        for path, info in found.items()
        if info.get("type", "file") == "file" and path.lower().endswith(wanted)
    ]
    return sorted(listing)


def listing_fingerprint(uri: str, extensions: list[str]) -> str:
    """A hash of the listing (paths, sizes, stamps): changes when files are added, removed or rewritten."""
    digest = hashlib.sha256(uri.encode())
    for path, size, stamp in list_images(uri, extensions):
        digest.update(f"\n{path}\t{size}\t{stamp}".encode())
    return digest.hexdigest()


@dataclass
class SourceListing(CachePolicy):
    """Cache key part for ingest: a listing of the source, so new or changed files are a miss without reading them."""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any):
        settings: Settings = inputs["settings"]
        return listing_fingerprint(source_uri(inputs["source"]), settings.image_extensions)


def ingest_images(spark: SparkSession, uri: str, extensions: list[str], staging_uri: str) -> Ingested:
    """Read every image under `uri` (labels from parent folder names) with its sha256 into staging Parquet."""
    pattern = r"(?i)(" + "|".join(ext.replace(".", r"\.") for ext in extensions) + r")$"
    files = (
        spark.read.format("binaryFile")
        .option("recursiveFileLookup", "true")
        .load(uri)
        .where(F.col("path").rlike(pattern))
        .select(
            "path",
            F.regexp_extract("path", r"([^/]+)/[^/]+$", 1).alias("label"),
            F.sha2("content", 256).alias("sha256"),
            F.col("length").alias("size"),
            "content",
        )
    )
    files.write.mode("overwrite").parquet(staging_uri)
    staged = spark.read.parquet(staging_uri)
    summary = staged.agg(
        F.count("*").alias("rows"),
        F.sort_array(F.collect_set("label")).alias("labels"),
        F.sha2(F.concat_ws(",", F.sort_array(F.collect_list(F.concat_ws(":", "sha256", "label")))), 256).alias("fp"),
    ).first()
    if summary["rows"] == 0:
        raise SourceError(
            f"no image files ({', '.join(extensions)}) under {uri}: lay images out as <label>/<file> under the source"
        )
    return Ingested(staging_uri=staging_uri, rows=summary["rows"], labels=list(summary["labels"]), content_fingerprint=summary["fp"])


@stage("ingest", cache_policy=STAGE_CACHE + SourceListing())
def ingest(source: str, settings: Settings) -> Ingested:
    """Prefect stage: ingest the source folder into staging."""
    uri = source_uri(source)
    staging = settings.staging_dir / f"ingest-{listing_fingerprint(uri, settings.image_extensions)[:16]}"
    return ingest_images(spark_session(settings), uri, settings.image_extensions, str(staging))
