"""Write: land new and changed images in the Delta table, retire what the source lost, quarantine bad files.

One straight path, `write_images`: plan (what lands, retires and goes to the quarantine, refused before any commit),
commit, mark (the in-sync marker, where nobody else wrote meanwhile). A run that only adds rows commits, in one Delta
commit, the data files the resize stage's executors wrote into the table's folder. A run that also replaces or retires
rows merges instead, keyed on (path, image_size), skipping rows whose content hash the table already holds for that
path. Either way a re-run after a crash at any point adds nothing twice: before the commit no reader sees the files,
after it the rows are there and are skipped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
from prefect.cache_policies import NO_CACHE

from imagelake.infra.delta import FileRows, Table, sql_in
from imagelake.infra.errors import PermanentError
from imagelake.infra.settings import Settings, stage_settings
from imagelake.tasks.data.changes import mark_in_sync
from imagelake.tasks.data.table import ImageTable, matching
from imagelake.tasks.results import Resized, Written, left_unread
from imagelake.tasks.rules.bad_files import TooManyBadFiles, TooManyRetired, check_bad_fraction, check_retire_fraction
from imagelake.tasks.rules.schemas import IMAGE_TABLE_SCHEMA, STAGED_ARROW_SCHEMA
from imagelake.tasks.stage import stage

if TYPE_CHECKING:
    import pyarrow.dataset as ds


class StagingIncomplete(PermanentError):
    """The resize stage's staged rows are not all there: something removed them between resize and write."""


def check_staged(resized: Resized) -> None:
    """Every file resize accounted for has its staged row; else fail, and remove the partial folder so that the next
    run's resize reuses no stored result and decodes again (a write from a short count would commit too little and
    then mark the tables in step with the listing, so that no later run would look at the missing files again)."""
    reported = resized.decoded + resized.known + resized.retired + resized.bad + resized.unread_files
    staged = staged_rows(resized).count_rows()
    if staged == reported:
        return
    fs, folder = fsspec.core.url_to_fs(resized.staging_uri)
    if fs.exists(folder):
        fs.rm(folder, recursive=True)
    raise StagingIncomplete(
        f"write: the resize stage's staging folder {resized.staging_uri} holds {staged} row(s) but resize accounted "
        f"for {reported} file(s); something removed part of it (a cleanup of the workspace's staging while the run "
        "went on?). Nothing was written; run again and resize decodes those files anew."
    )


def staged_rows(resized: Resized) -> ds.Dataset:
    """The resize stage's bookkeeping rows (a folder of small Parquet files, possibly none: an object store then has no
    folder)."""
    import pyarrow.dataset as ds  # with pandas: 0.4 s that a run with nothing new to write never needs

    fs, folder = fsspec.core.url_to_fs(resized.staging_uri)
    if not fs.exists(folder):
        return ds.dataset(STAGED_ARROW_SCHEMA.empty_table())
    return ds.dataset(resized.staging_uri, format="parquet", schema=STAGED_ARROW_SCHEMA)


@dataclass
class Changes:
    """What one write does to the images table, worked out from the staged rows and the table's keys."""

    read_version: int | None  # the table version the keys were read at (None: no table yet)
    upserts: pa.Table  # path, sha256, data_file of the new rows to write
    deletes: list[str]  # paths whose rows go
    replaces: bool  # whether any upsert replaces a row already in the table
    whole_files: bool  # whether every row of the run's data files is written
    moved: list[str] = field(
        default_factory=list
    )  # of DELETES, the paths whose content moved to another path: not lost

    @property
    def empty(self) -> bool:
        return self.upserts.num_rows == 0 and not self.deletes

    @property
    def files(self) -> list[str]:
        return sorted(set(self.upserts.column("data_file").to_pylist()))


def plan_changes(table: ImageTable, resized: Resized) -> Changes:
    """Rows to upsert (new content at a path) and to delete (path gone), minus what the table already says.

    Only the table's rows that share a path or a content hash with this run's are read: a semi-join, never the whole
    table.
    """
    staged = staged_rows(resized)
    version = table.images.version()
    upserts = staged.to_table(columns=["path", "sha256", "data_file"], filter=pc.field("status") == "new")
    deletes = staged.to_table(columns=["path"], filter=pc.field("status") == "delete").column("path")
    if not upserts.num_rows and not len(deletes):
        return Changes(version, upserts, [], False, True)
    paths = pa.concat_arrays([upserts["path"].combine_chunks(), deletes.combine_chunks()])
    present = table.rows_matching(
        {"path": paths, "sha256": upserts["sha256"].combine_chunks()}, ["path", "sha256"], version
    )
    whole, moved_from = True, []
    if upserts.num_rows:
        # Content the table holds (at any path) is never added again, unless no path that holds it holds it still: then
        # it moved (a relabel, a renamed folder), and its row moves to the new path. When one run sees the same new
        # content twice, the first path wins.
        moved, moved_from = moved_content(present, upserts, deletes)
        fresh = pc.or_(
            pc.invert(pc.is_in(upserts["sha256"], present.column("sha256"))), pc.is_in(upserts["sha256"], moved)
        )
        first = upserts.select(["sha256", "path"]).group_by("sha256").aggregate([("path", "min")]).column("path_min")
        keep = pc.and_(fresh, pc.is_in(upserts["path"], first))
        if not pc.all(keep).as_py():
            upserts, whole = upserts.filter(keep), False
    replaces = bool(pc.any(pc.is_in(upserts["path"], present.column("path"))).as_py()) if upserts.num_rows else False
    deletes = sorted(set(deletes.filter(pc.is_in(deletes, present.column("path"))).to_pylist()) | set(moved_from))
    return Changes(version, upserts, deletes, replaces, whole, moved_from)


def moved_content(present: pa.Table, upserts: pa.Table, deletes: pa.ChunkedArray) -> tuple[pa.Array, list[str]]:
    """Of the run's new files whose content the table holds at another path: the content that no such path holds any
    more (each is retired by this run, rewritten by it, or gone from the store), and those paths, whose rows go.

    A file moved to another label folder keeps its bytes; its row follows it, with the new label, in the run's one
    commit. A copy (the old path still holds the content) is left out, as before."""
    held = present.filter(pc.is_in(present["sha256"], upserts["sha256"]))
    if not held.num_rows:
        return pa.array([], pa.string()), []
    new_content = dict(zip(upserts["path"].to_pylist(), upserts["sha256"].to_pylist(), strict=True))
    retired = set(deletes.to_pylist())
    holders: dict[str, list[str]] = {}
    for path, sha in zip(held["path"].to_pylist(), held["sha256"].to_pylist(), strict=True):
        holders.setdefault(sha, []).append(path)
    unsure = [path for paths in holders.values() for path in paths if path not in retired and path not in new_content]
    still_there = existing(unsure)

    def holds(path: str, sha: str) -> bool:
        if path in retired:
            return False
        if path in new_content:
            return new_content[path] == sha  # rewritten by this run: it holds what it holds now
        return path in still_there

    moved = [sha for sha, paths in holders.items() if not any(holds(path, sha) for path in paths)]
    return pa.array(moved, pa.string()), sorted(
        path for sha in moved for path in holders[sha] if path not in new_content
    )


def existing(paths: list[str]) -> set[str]:
    """Which of these file URIs the store has now (listings cached by object stores' file systems are dropped first)."""
    found: set[str] = set()
    cleared: set[int] = set()
    for uri in paths:
        fs, path = fsspec.core.url_to_fs(uri)
        if id(fs) not in cleared:
            fs.invalidate_cache()
            cleared.add(id(fs))
        if fs.exists(path):
            found.add(uri)
    return found


def image_changes(resized: Resized, changes: Changes) -> FileRows:
    """The merge's source: the upserted rows, left in the run's data files for the engine to read (Spark's executors
    read them, so their pixels never reach the driver; delta-rs is streamed them), then one delete per retired path."""
    return FileRows(
        IMAGE_TABLE_SCHEMA, changes.upserts.select(["path", "data_file"]), changes.deletes, resized.image_size
    )


QUARANTINE_EXTRA = pa.schema(
    [
        ("stage", pa.string()),
        ("quarantined_at", pa.timestamp("us", tz="UTC")),
        ("requeued_at", pa.timestamp("us", tz="UTC")),
    ]
)


def bad_key(rows: pa.Table) -> pa.ChunkedArray:
    """What makes two quarantine rows one: the path, the content and the reason."""
    return pc.binary_join_element_wise(rows["path"], pc.fill_null(rows["sha256"], ""), rows["reason"], "\x00")


@dataclass
class Quarantine:
    """What one write does to the quarantine table."""

    rows: pa.Table  # the run's bad files that it holds no live row for: appended
    known: int  # the run's bad files it holds already for the same content and reason (requeued or not): no news
    requeued: list[str]  # paths whose requeued rows the appended rows take the place of


def quarantine_rows(table: ImageTable, resized: Resized) -> Quarantine:
    """The run's bad files, minus those already quarantined for the same content and reason (a requeued file that is
    still bad is quarantined again, in place of its requeued row)."""
    bad = staged_rows(resized).to_table(
        columns=["path", "size", "mtime", "stamp", "sha256", "reason", "detail", "issue"],
        filter=pc.field("status") == "quarantined",
    )
    now = datetime.now(UTC)
    # Problems seen in the listing carry an `issue`; the rest were found while reading or decoding.
    bad = bad.append_column("stage", pc.if_else(pc.is_null(bad["issue"]), "resize", "ingest")).drop_columns(["issue"])
    bad = bad.append_column(
        "quarantined_at", pa.array([now] * bad.num_rows, QUARANTINE_EXTRA.field("quarantined_at").type)
    )
    bad = bad.append_column("requeued_at", pa.nulls(bad.num_rows, QUARANTINE_EXTRA.field("requeued_at").type))
    if not bad.num_rows or not table.quarantine.exists():
        return Quarantine(bad, 0, [])
    requeued = "requeued_at" in table.quarantine.columns()
    seen = matching(
        table.quarantine,
        {"path": bad["path"].combine_chunks()},
        ["path", "sha256", "reason", *(["requeued_at"] if requeued else [])],
    )
    waiting = seen.filter(pc.is_valid(seen["requeued_at"])) if requeued and seen.num_rows else seen.slice(0, 0)
    live = seen.filter(pc.is_null(seen["requeued_at"])) if requeued and seen.num_rows else seen
    fresh = bad.filter(pc.invert(pc.is_in(bad_key(bad), bad_key(live))))
    known = pc.sum(pc.is_in(bad_key(bad), bad_key(seen))).as_py() or 0
    replaced = pc.is_in(waiting["path"], fresh["path"]) if waiting.num_rows else pa.array([], pa.bool_())
    return Quarantine(
        fresh, known, sorted(set(waiting.filter(replaced)["path"].to_pylist())) if waiting.num_rows else []
    )


def land_quarantine(table: ImageTable, quarantine: Quarantine) -> int:
    """Append the run's new quarantine rows (and drop the requeued rows they replace); return the commits made."""
    commits = 0
    if quarantine.requeued:
        commits += int(
            table.quarantine.delete_where(f"requeued_at IS NOT NULL AND {sql_in('path', quarantine.requeued)}") > 0
        )
    if quarantine.rows.num_rows:
        table.quarantine.add_columns(quarantine.rows.schema)  # a quarantine from before requeue_at gets it first
        table.quarantine.append(quarantine.rows)
        commits += 1
    return commits


def requeue(table: ImageTable, reasons: list[str] | None = None) -> dict[str, int]:
    """Send quarantined files back through: their quarantine rows (all, or those of REASONS) are marked requeued in one
    commit, so the next run's diff does not count them known and reads them again. A file still bad is quarantined
    again (and not counted against max_bad_fraction: it is no news); a good one lands in the images table. Returns the
    files requeued by reason; {} where none matched, and then nothing is committed."""
    held = table.quarantined_by_reason()
    chosen = {reason: n for reason, n in held.items() if reasons is None or reason in reasons}
    if chosen:
        table.quarantine.add_columns(QUARANTINE_EXTRA)
        table.quarantine.update_where(
            f"requeued_at IS NULL AND {sql_in('reason', sorted(chosen))}", {"requeued_at": datetime.now(UTC)}
        )
    return chosen


# The points a write passes, in order: after its plan (nothing committed), after the quarantine's commit, after the
# images table's commit. A crash in each leaves a different state that the next run must complete exactly once.
WRITE_PHASES = ("planned", "quarantine-committed", "images-committed")
# Called with each phase's name as a write reaches it; None in the pipeline's runs, so nothing is called. The crash
# tests set it in a writer process of their own, to kill the write at a named phase and know where the kill landed.
on_phase: Callable[[str], None] | None = None


def reached(phase: str) -> None:
    """Tell on_phase, if set, that the write reached PHASE."""
    if on_phase is not None:
        on_phase(phase)


@dataclass
class WritePlan:
    """Everything one write does, worked out before it commits anything."""

    quarantine: Quarantine
    changes: Changes
    versions_read: tuple[int | None, int | None]  # (images, quarantine) as the plan read them


@dataclass
class Landed:
    """What the commits of one write left."""

    version: int | None  # the images table's version the write reports
    expected: tuple[int | None, int | None]  # (images, quarantine) if no other writer committed meanwhile


def write_images(
    table: ImageTable, resized: Resized, max_bad_fraction: float, max_retire_fraction: float = 1.0
) -> Written:
    """Plan, commit, mark: land the images and append the quarantine; return the images table's version.

    A run that only adds rows commits the data files its executors wrote, as they are. A run
    that replaces or deletes rows merges them instead (with the table's engine).
    """
    plan = plan_write(table, resized, max_bad_fraction, max_retire_fraction)
    reached("planned")
    landed = commit_write(table, resized, plan)
    mark_if_in_step(table, resized, plan.versions_read, landed.expected)
    return Written(
        table_uri=table.uri,
        version=landed.version,
        engine=table.engine,
        rows=plan.changes.upserts.num_rows,
        retired=len(plan.changes.deletes),
        quarantined=plan.quarantine.rows.num_rows,
        unread=resized.unread_files,
    )


def plan_write(table: ImageTable, resized: Resized, max_bad_fraction: float, max_retire_fraction: float) -> WritePlan:
    """Work out the write from the staged rows and the tables' keys, and refuse it before any commit: staged rows
    missing, too many bad files, too many rows retired (a refused write takes back the run's data files), or nothing
    usable for a table that does not exist yet."""
    if table.uri.rstrip("/") != resized.table_uri.rstrip("/"):
        raise ValueError(
            f"write_images: table {table.uri} is not the table {resized.table_uri} that the resize stage wrote its "
            "files into; run resize with the same table_root and table_name"
        )
    check_staged(resized)
    bad = quarantine_rows(table, resized)
    try:
        check_bad_fraction(resized, max_bad_fraction, bad.known)
        changes = plan_changes(table, resized)
        check_retired_share(table, changes, max_retire_fraction)
    except (TooManyBadFiles, TooManyRetired):
        discard_run_files(resized)
        raise
    if changes.empty and not table.images.exists():
        raise TooManyBadFiles(
            f"no image could be written to {table.uri}: no file of this run is a usable image ({resized.quarantined})"
        )
    return WritePlan(bad, changes, (changes.read_version, table.quarantine.version()))


def commit_write(table: ImageTable, resized: Resized, plan: WritePlan) -> Landed:
    """Commit the plan: the quarantine's rows, then the images in one commit of the run's data files, or one merge
    where rows are replaced or retired; a write with no change takes back the run's data files instead."""
    images_read, quarantine_read = plan.versions_read
    quarantine_now = next_version(quarantine_read, land_quarantine(table, plan.quarantine))
    reached("quarantine-committed")
    changes = plan.changes
    if changes.empty:
        remove_uncommitted(table.uri, run_files(resized))
        return Landed(table.images.version(), (images_read, quarantine_now))
    require_files(table.uri, changes.files)
    table.images.add_columns(IMAGE_TABLE_SCHEMA)  # a table from before a column was added gets it first
    if changes.whole_files and not changes.replaces and not changes.deletes:
        version = table.images.commit_files(IMAGE_TABLE_SCHEMA, changes.files)
        if version != (0 if images_read is None else images_read + 1):
            version = settle_concurrent_append(table, resized, changes, version)
    else:
        version = table.images.merge(image_changes(resized, changes))
        remove_uncommitted(table.uri, changes.files)
    reached("images-committed")
    return Landed(version, (next_version(images_read, 1), quarantine_now))


def check_retired_share(table: ImageTable, changes: Changes, max_retire_fraction: float) -> None:
    """Refuse a write that would retire more than MAX_RETIRE_FRACTION of any date's rows (a folder that could not be
    seen looks like files deleted); only the dates that lose rows are counted, by Spark. A row that moves with its file
    (a relabel, a renamed folder) is not lost."""
    lost = sorted(set(changes.deletes) - set(changes.moved))
    if not lost or max_retire_fraction >= 1:
        return
    gone = table.rows_matching({"path": pa.array(lost, pa.string())}, ["path", "date"], changes.read_version)
    retired = Counter(gone.column("date").to_pylist())
    check_retire_fraction(retired, table.rows_by_date(changes.read_version, list(retired)), max_retire_fraction)


def next_version(version: int | None, commits: int) -> int | None:
    """The version a table has after COMMITS commits of ours."""
    return (-1 if version is None else version) + commits if commits else version


def mark_if_in_step(
    table: ImageTable, resized: Resized, before: tuple[int | None, int | None], expected: tuple[int | None, int | None]
) -> None:
    """Say the tables now hold everything the run's listing brings, if nobody else wrote between the diff and now:
    the tables were at the versions the diff read, and are now exactly our commits further on. A run that could not
    read some files is not in step: the next run must find them again."""
    if (
        not resized.basis
        or not resized.in_sync_folder
        or before != tuple(resized.versions_seen)
        or resized.unread_files
    ):
        return
    if (table.images.version(), table.quarantine.version()) == expected:
        mark_in_sync(resized.in_sync_folder, resized.basis, expected, resized.state_key, resized.listing_uri)


def settle_concurrent_append(table: ImageTable, resized: Resized, changes: Changes, version: int) -> int:
    """After an append that other commits raced: if one of them landed the same paths, take our files back and merge.

    Appends never conflict in Delta, so two runs adding the same path at once would both land.
    The later commit checks its paths at its own version; on a duplicate it removes its files
    again and merges its rows instead, which updates or skips what the other run wrote.
    """
    paths = changes.upserts.column("path")
    seen = table.rows_matching({"path": paths.combine_chunks()}, ["path"], version).column("path")
    if len(seen) == len(paths):
        return version
    table.images.uncommit_files(changes.files)
    planned = plan_changes(table, resized)
    return table.images.version() if planned.empty else table.images.merge(image_changes(resized, planned))


def require_files(table_uri: str, files: list[str]) -> None:
    """The resize stage's data files must still be there to be committed or merged."""
    fs, folder = fsspec.core.url_to_fs(table_uri)
    missing = [name for name in files if not fs.exists(f"{folder}/{name}")]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} data file(s) that the resize stage wrote into {table_uri} are gone (e.g. {missing[0]}); "
            "a vacuum with a short retention may have removed them. Re-run with refresh (imagelake run --refresh, or "
            "refresh: true) so resize decodes again."
        )


def remove_uncommitted(table_uri: str, files: list[str]) -> None:
    """Delete data files the resize stage wrote that no table version references (no reader ever saw them)."""
    fs, folder = fsspec.core.url_to_fs(table_uri)
    present = [name for name in files if fs.exists(f"{folder}/{name}")]
    # A file that any version references stays (for time travel) until vacuum: a re-run must not delete what a commit
    # made.
    for name in set(present) - Table(table_uri).ever_committed(present):
        fs.rm(f"{folder}/{name}")


def run_files(resized: Resized) -> list[str]:
    """Every data file the resize stage wrote for this run."""
    names = (
        staged_rows(resized)
        .to_table(columns=["data_file"], filter=pc.is_valid(pc.field("data_file")))
        .column("data_file")
    )
    return sorted(set(names.to_pylist()))


def discard_run_files(resized: Resized) -> None:
    """A run that writes nothing takes back the data files its resize stage wrote (and the table folder, if that is all
    it held)."""
    remove_uncommitted(resized.table_uri, run_files(resized))
    fs, folder = fsspec.core.url_to_fs(resized.table_uri)
    if fs.exists(folder) and not fs.ls(folder):
        fs.rmdir(folder)


@stage("requeue", settings=stage_settings("requeue"), cache_policy=NO_CACHE)
def requeue_by_setting(settings: Settings) -> dict[str, int]:
    """Prefect stage (its result never reused): send the files quarantined for a reason in the setting
    requeue_reasons back through."""
    return requeue(ImageTable.of(settings), settings.requeue_reasons)


@stage(
    "write",
    settings=stage_settings("write"),
    unfinished=left_unread,
)
def write(resized: Resized, settings: Settings) -> Written:
    """Prefect stage: merge into the Delta table with the engine that can run here."""
    return write_images(ImageTable.of(settings), resized, settings.max_bad_fraction, settings.max_retire_fraction)
