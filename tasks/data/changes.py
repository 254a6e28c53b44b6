"""What is new or changed: a listing diffed against the images table (at one image size) and the quarantine.

The resize stage runs this diff, since what is new depends on the image size; only the files it keeps are read. The
diff is a Spark join of the listing with the table's small columns, so no key or hash of the table reaches the
driver: only the changed entries do. A write that leaves the table in step with a listing says so with a marker
(named by the listing, the diff's inputs and the tables' versions), and a run that finds it skips the join.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from imagelake.infra.compat import collect_arrow
from imagelake.tasks.data.listing import LISTING_BATCH, canonical_uri, is_manifest, save_listing, write_manifest
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.results import Listed, ListingDiff
from imagelake.tasks.rules.listed_files import Scope
from imagelake.tasks.rules.schemas import CHANGES_SCHEMA, LISTING_SCHEMA


def state_key(table: ImageTable, scope: Scope, retire_deleted: bool, source: str) -> str:
    """Everything the diff depends on besides the listing and the tables' versions, hashed. The source is part of it:
    a diff retires only its source's rows, so one source's diff (or the listing the tables were last in step with)
    says nothing of another's, even where both list the same files."""
    quarantine = table.quarantine.uri if table.quarantine is not None else None
    parts = [
        table.uri,
        quarantine,
        table.image_size,
        str(scope.start),
        str(scope.end),
        retire_deleted,
        canonical_uri(source),
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def diff_basis(listed: Listed, table: ImageTable, scope: Scope, retire_deleted: bool) -> str:
    """Everything the diff depends on besides the tables' versions, hashed."""
    key = state_key(table, scope, retire_deleted, listed.source_uri)
    return hashlib.sha256(f"{listed.listing_fingerprint}|{key}".encode()).hexdigest()


# Staging's folder of what each manifest's listings named: a folder per manifest, a file per set of paths it listed.
# Kept whatever its age: a manifest retires only rows whose paths it once named, and without the record it retires none.
NAMED = "named"


@dataclass(frozen=True)
class Owner:
    """The table rows a source may retire. Rows do not record which source landed them, and other sources may land
    rows of the same dates in the same table: a run retires only what it can tell is its own. A folder source owns
    the paths below its folder (on a path boundary: `/data/a` does not own `/data/ab/x.png`). A manifest's files may
    lie anywhere in its folder and manifest_roots, beside another manifest's or a folder source's: it owns only the
    paths that its own listings named (NAMED, record_named's record); a path it never named, or named only in a
    listing whose record is gone, is not provably its own and is kept."""

    prefix: str | None = None  # a folder source: the canonical URI of its folder, with a trailing slash
    named: str | None = None  # a manifest: the folder of Parquet files of the paths its listings named

    def rows(self, frame: DataFrame) -> DataFrame:
        """The rows of FRAME (with a path column) that are this source's."""
        if self.prefix is not None:
            return frame.where(F.col("path").startswith(self.prefix))
        named = frame.sparkSession.read.schema("path string").parquet(self.named)
        return frame.join(named, "path", "left_semi")


def named_folder(staging_dir: str, source: str) -> str:
    """The folder of a manifest's record of the paths its listings named."""
    return f"{staging_dir.rstrip('/')}/{NAMED}/{hashlib.sha256(canonical_uri(source).encode()).hexdigest()[:32]}"


def record_named(listed: Listed, folder: str) -> None:
    """Add a manifest listing's paths to its record, a batch at a time: a file per set of paths, named by their hash
    (a listing whose files only changed adds nothing). Written aside, then moved (readers skip a dot file), and never
    rewritten, so two runs of one manifest never overwrite each other's paths."""
    fs, root = fsspec.core.url_to_fs(folder)
    fs.makedirs(root, exist_ok=True)
    aside, digest = f"{root}/.{uuid.uuid4().hex}.parquet", hashlib.sha256()
    try:
        with fsspec.open(listed.manifest_uri, "rb") as handle, fs.open(aside, "wb") as out:
            with pq.ParquetWriter(out, pa.schema([("path", pa.string())])) as writer:
                for batch in pq.ParquetFile(handle).iter_batches(batch_size=LISTING_BATCH, columns=["path"]):
                    digest.update("\n".join(batch.column(0).to_pylist()).encode() + b"\n")
                    writer.write_batch(batch)
        named = f"{root}/{digest.hexdigest()[:32]}.parquet"
        if not fs.exists(named):
            fs.mv(aside, named)
    finally:
        if fs.exists(aside):
            fs.rm(aside)


def owner_of(listed: Listed, staging_dir: str) -> Owner:
    """Which rows the listed source may retire (a manifest's listing is added to its record first)."""
    if not is_manifest(listed.source_uri):
        return Owner(prefix=canonical_uri(listed.source_uri).rstrip("/") + "/")
    folder = named_folder(staging_dir, listed.source_uri)
    record_named(listed, folder)
    return Owner(named=folder)


IN_SYNC = "in-sync"  # staging's folder of in-sync markers and last-<key>.json records


def in_sync_marker(folder: str, basis: str, versions: tuple[int | None, int | None]) -> str:
    """The file that says: the tables at VERSIONS already hold everything the listing of BASIS brings."""
    return f"{folder}/{hashlib.sha256(f'{basis}|{versions[0]}|{versions[1]}'.encode()).hexdigest()[:32]}"


def table_versions(table: ImageTable) -> tuple[int | None, int | None]:
    """The images table's and the quarantine's current versions (None: no table yet, or no quarantine consulted)."""
    return table.images.version(), table.quarantine.version() if table.quarantine is not None else None


def mark_in_sync(
    folder: str, basis: str, versions: tuple[int | None, int | None], key: str = "", listing_uri: str = ""
) -> None:
    """Write the marker; with the diff's KEY and the listing, also record the listing as the last one in step with
    the tables at VERSIONS (the next run with the same inputs then diffs its listing against that one)."""
    fs, path = fsspec.core.url_to_fs(in_sync_marker(folder, basis, versions))
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, b"")
    if key and listing_uri:
        last = f"{path.rsplit('/', 1)[0]}/last-{key}.json"
        aside = f"{last}.{uuid.uuid4().hex}"
        fs.pipe_file(aside, json.dumps({"versions": list(versions), "listing": listing_uri}).encode())
        fs.mv(aside, last)


def last_in_sync(folder: str, key: str, versions: tuple[int | None, int | None]) -> str | None:
    """The listing the tables are in step with at VERSIONS, for a diff with inputs KEY (None: none recorded for
    these versions, or its file is gone)."""
    fs, path = fsspec.core.url_to_fs(f"{folder}/last-{key}.json")
    if not fs.exists(path):
        return None
    record = json.loads(fs.cat_file(path))
    if tuple(record["versions"]) != tuple(versions) or not fsspec.core.url_to_fs(record["listing"])[0].exists(
        record["listing"]
    ):
        return None
    return record["listing"]


# A diff of two listings: the changes, and whether each path was in the earlier listing.
LISTED_BEFORE = "listed_before"
LISTING_CHANGES = CHANGES_SCHEMA.append(pa.field(LISTED_BEFORE, pa.bool_()))


def listing_changes(before: pa.Table, now: pa.Table, retire: bool) -> pa.Table:
    """What the table diff would give when the tables hold exactly what listing BEFORE brings: NOW's entries that BEFORE
    lacks or lists with another size, mtime or stamp, then (with RETIRE) `delete` entries for the paths NOW lost.
    No content hash is known for them: a rewritten file is hashed, and the write leaves out content the table holds."""
    keys = ["path", "size", "mtime", "_stamp"]

    def keyed(listing: pa.Table) -> pa.Table:
        return listing.append_column("_stamp", pc.fill_null(listing["stamp"], ""))

    todo = keyed(now).join(keyed(before).select(keys), keys, join_type="left anti").drop_columns(["_stamp"])
    todo = todo.select(LISTING_SCHEMA.names).append_column("known_sha256", pa.nulls(todo.num_rows, pa.string()))
    todo = todo.append_column(LISTED_BEFORE, pc.is_in(todo["path"], before["path"].combine_chunks()))
    if retire:
        gone = (
            before.select(["path"])
            .join(now.select(["path"]), "path", join_type="left anti")
            .column("path")
            .combine_chunks()
        )
        n = len(gone)
        deleted = pa.table(
            {
                "path": gone,
                "label": pa.array(["-"] * n, pa.string()),
                "date": pa.nulls(n, pa.date32()),
                "size": pa.array([0] * n, pa.int64()),
                "mtime": pa.array([0.0] * n, pa.float64()),
                "stamp": pa.nulls(n, pa.string()),
                "issue": pa.nulls(n, pa.string()),
                "action": pa.array(["delete"] * n, pa.string()),
                "known_sha256": pa.nulls(n, pa.string()),
                LISTED_BEFORE: pa.array([True] * n),
            }
        )
        todo = pa.concat_tables([todo.cast(LISTING_CHANGES), deleted.cast(LISTING_CHANGES)])
    return todo.cast(LISTING_CHANGES)


def with_known_hashes(table: ImageTable, todo: pa.Table, version: int | None) -> pa.Table:
    """A diff of two listings as the table diff gives it: with the table's content hash for each upserted path that
    the earlier listing had (a file rewritten in place, or only touched, whose bytes may be what the table holds),
    from a semi-join on those paths alone (none: no query)."""
    listed = (
        todo.filter(pc.and_(pc.equal(todo["action"], "upsert"), todo[LISTED_BEFORE])).column("path").combine_chunks()
    )
    todo = todo.drop_columns([LISTED_BEFORE])
    if not len(listed) or version is None:
        return todo
    held = table.rows_matching({"path": listed}, ["path", "sha256"], version)
    if not held.num_rows:
        return todo
    where = pc.index_in(todo["path"], held["path"])
    return todo.set_column(
        todo.schema.get_field_index("known_sha256"), "known_sha256", pc.take(held["sha256"], where).cast(pa.string())
    )


class NotInPathOrder(ValueError):
    """A listing whose paths are not in ascending order (a manifest CSV's own order): it is diffed in memory."""


def listing_batches(uri: str, columns: list[str], rows: int) -> Iterator[pa.Table]:
    """A listing file, ROWS entries at a time; raises NotInPathOrder when its paths do not ascend."""
    last = None
    with fsspec.open(uri, "rb") as handle:
        for batch in pq.ParquetFile(handle).iter_batches(batch_size=rows, columns=columns):
            paths = batch.column(0)
            if (
                len(paths) > 1
                and not pc.all(pc.less(paths[:-1], paths[1:])).as_py()
                or (last is not None and len(paths) and not paths[0].as_py() > last)
            ):
                raise NotInPathOrder(uri)
            if len(paths):
                last = paths[-1].as_py()
                yield pa.Table.from_batches([batch])


def merged_listing_changes(before_uri: str, now_uri: str, retire: bool, rows: int = 50_000) -> pa.Table:
    """listing_changes of two listings in path order, by a merge: the driver holds ROWS entries of the new listing
    and the earlier one's entries in the same range of paths, never a whole listing."""
    keys = ["path", "size", "mtime", "stamp"]
    earlier, window, parts = (
        listing_batches(before_uri, keys, rows),
        pa.Table.from_pylist([], schema=LISTING_SCHEMA).select(keys),
        [],
    )
    for batch in listing_batches(now_uri, LISTING_SCHEMA.names, rows):
        last = batch.column("path")[-1].as_py()
        while window.num_rows == 0 or window.column("path")[-1].as_py() <= last:
            more = next(earlier, None)
            if more is None:
                break
            window = pa.concat_tables([window, more])
        inside = pc.less_equal(window["path"], last)
        parts.append(listing_changes(window.filter(inside), batch, retire))
        window = window.filter(pc.invert(inside))
    for rest in itertools.chain(
        [window], earlier
    ):  # past the new listing's last path: gone (read to the end, for the order check)
        if retire and rest.num_rows:
            parts.append(listing_changes(rest, LISTING_SCHEMA.empty_table(), retire))
    return pa.concat_tables(parts) if parts else LISTING_CHANGES.empty_table()


def changes_between(before_uri: str, now_uri: str, retire: bool) -> pa.Table:
    """listing_changes of two listing files: merged when both are in path order (a folder's are), else in memory."""
    try:
        return merged_listing_changes(before_uri, now_uri, retire)
    except NotInPathOrder:
        return listing_changes(read_listing(before_uri), read_listing(now_uri), retire)


def read_listing(uri: str) -> pa.Table:
    with fsspec.open(uri, "rb") as handle:
        return pq.read_table(handle)


def is_in_sync(folder: str, basis: str, versions: tuple[int | None, int | None]) -> bool:
    fs, path = fsspec.core.url_to_fs(in_sync_marker(folder, basis, versions))
    return fs.exists(path)


def _known(frame: DataFrame, columns: list[str], with_sha: bool) -> DataFrame:
    """path and the k_ columns the diff compares (stamp null where the table predates stamps)."""
    stamp = F.col("stamp") if "stamp" in columns else F.lit(None).cast("string")
    sha = F.col("sha256") if with_sha else F.lit(None).cast("string")
    return frame.select(
        "path",
        F.col("size").alias("k_size"),
        F.col("mtime").alias("k_mtime"),
        stamp.alias("k_stamp"),
        sha.alias("k_sha256"),
    )


def known_frame(table: ImageTable, version: int | None) -> DataFrame | None:
    """Each known path's size, mtime, stamp and (for the table's rows) content hash: the table's rows at this size,
    then the quarantine's rows for other paths (but those requeued). None: neither table exists yet."""
    images = (
        _known(table.images.frame(version).where(table.this_size()), table.images.columns(), True)
        if version is not None
        else None
    )
    if table.quarantine is None or not table.quarantine.exists():
        return images
    quarantine, columns = table.quarantine.frame(), table.quarantine.columns()
    if "requeued_at" in columns:  # a requeued file is not known: it is read again
        quarantine = quarantine.where(F.col("requeued_at").isNull())
    quarantined = _known(quarantine, columns, False)
    if images is None:
        return quarantined
    return images.unionByName(quarantined.join(images.select("path"), "path", "left_anti"))


def is_changed(listing: DataFrame) -> Column:
    """tasks/rules/listed_files.py:is_changed as a Spark column: no known row, another size or mtime, or another
    stamp."""
    other_stamp = F.col("k_stamp").isNotNull() & ~F.col("k_stamp").eqNullSafe(listing["stamp"])
    return (
        F.col("k_size").isNull()
        | (F.col("k_size") != listing["size"])
        | (F.col("k_mtime") != listing["mtime"])
        | other_stamp
    )


def changed_entries(
    table: ImageTable, listing: DataFrame, version: int | None, retire_in: Column | None, owner: Owner | None = None
) -> DataFrame:
    """Listed entries that are new or changed (with the table's content hash for their path, if any), then `delete`
    entries for OWNER's table rows whose file is gone (of the rows RETIRE_IN selects; None for either: retire
    nothing)."""
    known = known_frame(table, version)
    if known is None:
        return listing.withColumn("known_sha256", F.lit(None).cast("string"))
    joined = listing.join(known, "path", "left")
    todo = joined.where(is_changed(joined)).select(*LISTING_SCHEMA.names, F.col("k_sha256").alias("known_sha256"))
    if retire_in is None or owner is None or version is None:
        return todo
    present = owner.rows(table.images.frame(version).where(table.this_size() & retire_in).select("path"))
    gone = present.join(listing.select("path"), "path", "left_anti").select(
        "path",
        F.lit("-").alias("label"),
        F.lit(None).cast("date").alias("date"),
        F.lit(0).cast("long").alias("size"),
        F.lit(0.0).alias("mtime"),
        F.lit(None).cast("string").alias("stamp"),
        F.lit(None).cast("string").alias("issue"),
        F.lit("delete").alias("action"),
        F.lit(None).cast("string").alias("known_sha256"),
    )
    return todo.unionByName(gone)


def dates_of(scope: Scope) -> Column:
    """The table rows whose date lies in the run's date range (what a date-limited run replaces)."""
    predicate = F.lit(True)
    if scope.start:
        predicate &= F.col("date") >= F.lit(scope.start)
    if scope.end:
        predicate &= F.col("date") <= F.lit(scope.end)
    return predicate


def changes_to_make(
    table: ImageTable,
    listed: Listed,
    scope: Scope,
    retire_deleted: bool,
    staging_dir: str,
    version: int | None,
    before: str | None,
) -> pa.Table:
    """The listing's changes to the tables, the images table at VERSION: against BEFORE, the listing they were last in
    step with, where there is one; else against the tables' rows, by Spark."""
    dated = scope.start is not None or scope.end is not None
    owner = owner_of(listed, staging_dir)  # every listing of a manifest is recorded, retiring or not
    if before is not None:
        # Nobody wrote since the tables were last in step with a listing: the change is between the two listings,
        # found in the driver from the two files, without a Spark job or a row of the table. That listing is of the
        # same source (the key says so): a path it named and this one lacks is the source's own to retire.
        return with_known_hashes(table, changes_between(before, listed.manifest_uri, dated or retire_deleted), version)
    listing = table.spark.read.schema(from_arrow_schema(LISTING_SCHEMA)).parquet(listed.manifest_uri)
    # A date-limited run replaces exactly its source's rows of its dates: its files gone from those dates are retired.
    retire_in = dates_of(scope) if dated else (F.lit(True) if retire_deleted else None)
    batches = collect_arrow(
        changed_entries(table, listing, version, retire_in, owner)
    )  # only what changed reaches the driver
    return pa.Table.from_batches(batches).cast(CHANGES_SCHEMA) if batches else CHANGES_SCHEMA.empty_table()


def diff_against_table(
    table: ImageTable, listed: Listed, scope: Scope, retire_deleted: bool, staging_dir: str
) -> ListingDiff:
    """Keep what is new or changed in a listing since the tables' current versions (at its image size), and stage that
    list."""
    basis, versions = diff_basis(listed, table, scope, retire_deleted), table_versions(table)
    key = state_key(table, scope, retire_deleted, listed.source_uri)
    fingerprint = hashlib.sha256(f"{basis}|{versions[0]}|{versions[1]}".encode()).hexdigest()
    in_sync_folder = f"{staging_dir.rstrip('/')}/{IN_SYNC}"
    if is_in_sync(in_sync_folder, basis, versions):  # (a manifest's listing was recorded when it was diffed)
        todo = CHANGES_SCHEMA.empty_table()
    else:
        before = last_in_sync(in_sync_folder, key, versions) if versions[0] is not None else None
        todo = changes_to_make(table, listed, scope, retire_deleted, staging_dir, versions[0], before)
    upserts = pc.sum(pc.equal(todo["action"], "upsert")).as_py() or 0
    return ListingDiff(
        manifest_uri=write_manifest(todo, f"{staging_dir.rstrip('/')}/ingest-{fingerprint[:20]}.parquet"),
        source_uri=listed.source_uri,
        listed=listed.listed,
        unchanged=listed.listed - upserts,
        candidates=upserts,
        retired=todo.num_rows - upserts,
        table_version_seen=versions[0],
        quarantine_version_seen=versions[1],
        basis=basis,
        in_sync_folder=in_sync_folder,
        listing_uri=listed.manifest_uri,
        state_key=key,
        content_fingerprint=fingerprint,
    )


def ingest_listing(table: ImageTable, uri: str, scope: Scope, retire_deleted: bool, staging_dir: str) -> ListingDiff:
    """List the source and keep what is new or changed since the table's current version (both steps at once)."""
    return diff_against_table(table, save_listing(uri, scope, staging_dir), scope, retire_deleted, staging_dir)


def date_counts(table: ImageTable, listed: Listed, scope: Scope, staging_dir: str) -> dict[date, dict[str, int]]:
    """Per date of a listing (and of the source's table rows in the scope's date range): files listed, of those new or
    changed since the tables, the source's table rows (this image size) and those whose file is gone; another source's
    rows of a date are not this one's to replace. Counted by Spark: only one row per date and count reaches the
    driver, never the table's paths."""
    listing = table.spark.read.schema(from_arrow_schema(LISTING_SCHEMA)).parquet(listed.manifest_uri)
    version = table.images.version()
    counts: dict[date, dict[str, int]] = {}

    def count(frame: DataFrame, name: str) -> None:
        for row in frame.where(F.col("date").isNotNull()).groupBy("date").count().collect():
            counts.setdefault(row["date"], {"files": 0, "new_or_changed": 0, "rows": 0, "gone": 0})[name] = row["count"]

    count(listing, "files")
    count(changed_entries(table, listing, version, None), "new_or_changed")
    if version is not None:
        present = owner_of(listed, staging_dir).rows(
            table.images.frame(version).where(table.this_size() & dates_of(scope)).select("path", "date")
        )
        count(present, "rows")
        count(present.join(listing.select("path"), "path", "left_anti"), "gone")
    return counts
