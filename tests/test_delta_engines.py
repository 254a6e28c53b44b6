"""Both Delta engines on one table: what delta-rs writes, Spark's Delta reads, merges, compacts and vacuums, and back.

Runs on the jars `make install` fetches; without them (no mvn) it fails, saying so, rather than skip.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from imagelake.infra.delta import Table, choose_engine
from imagelake.infra.jars import runtime_jars
from imagelake.infra.settings import Settings
from imagelake.infra.spark import delta_jars_loaded


def rows(paths: list[str], salt: str = "", action: str = "upsert") -> pa.Table:
    return pa.table(
        {
            "path": paths,
            "image_size": pa.array([8] * len(paths), pa.int32()),
            "sha256": [hashlib.sha256((p + salt).encode()).hexdigest() for p in paths],
            "image": pa.array([(p + salt).encode() * 16 for p in paths], pa.binary()),
            "_action": [action] * len(paths),
        }
    )


def state(table: Table, version: int | None = None) -> dict[str, str]:
    data = table.read(["path", "sha256"], version=version)
    return dict(zip(data.column("path").to_pylist(), data.column("sha256").to_pylist(), strict=True))


def test_the_jars_are_installed_and_spark_loads_them(spark) -> None:
    assert runtime_jars(), "`make install` fetches Delta's and S3A's jars with mvn into the environment's jars/ folder"
    assert delta_jars_loaded(spark)


@pytest.mark.parametrize("writer,other", [("delta-rs", "spark"), ("spark", "delta-rs")])
def test_a_table_written_by_one_engine_is_read_merged_compacted_and_vacuumed_by_the_other(
    spark, tmp_path: Path, writer: str, other: str
) -> None:
    uri = str(tmp_path / "images")
    first, second = Table(uri, spark, writer), Table(uri, spark, other)
    # The writer: a first write, a merge that replaces and deletes, and a compaction.
    for start in (0, 4, 8):
        first.merge(rows([f"a/{i:02d}.png" for i in range(start, start + 4)]))
    first.merge(
        pa.concat_tables([rows([f"a/{i:02d}.png" for i in range(3)], salt="v2"), rows(["a/11.png"], action="delete")])
    )
    compacted = first.compact()
    assert compacted["files_added"] >= 1
    written = {v: state(first, v) for v in range(first.version() + 1)}
    assert [len(written[v]) for v in range(5)] == [4, 8, 12, 11, 11] and written[3] == written[4]
    # The other engine sees every version the writer made, row for row (time travel included).
    assert {v: state(second, v) for v in written} == written
    assert second.frame(2).count() == 12
    # ... and merges, compacts and vacuums the writer's table.
    second.merge(
        pa.concat_tables(
            [rows(["b/00.png", "b/01.png"]), rows(["a/05.png"], salt="v3"), rows(["a/00.png"], action="delete")]
        )
    )
    second.merge(rows(["b/02.png"]))
    assert second.compact()["files_removed"] >= 2
    vacuumed = second.vacuum(0, [])
    assert vacuumed, "retention 0 removes the files that compaction replaced"
    now = state(second)
    assert (
        len(now) == 13
        and now["a/05.png"] == rows(["a/05.png"], salt="v3")["sha256"][0].as_py()
        and "a/00.png" not in now
    )
    # The writer reads the other's versions back the same way, and each engine's history lists every commit.
    assert state(first) == now
    assert (
        [c["version"] for c in first.history()]
        == [c["version"] for c in second.history()]
        == list(range(second.version(), -1, -1))
    )
    # Every data file either engine left is one the pinned pyarrow can open (Petastorm reads with it).
    for uri_ in DeltaTable(uri).file_uris():
        pq.read_table(uri_.removeprefix("file://"), columns=["path"])


def test_auto_is_delta_rs_on_an_embedded_spark_and_spark_forced_or_on_a_cluster(spark, tmp_path: Path) -> None:
    assert choose_engine(Settings(workspace=tmp_path), spark) == "delta-rs"
    assert choose_engine(Settings(workspace=tmp_path, delta_writer="spark"), spark) == "spark"
    assert choose_engine(Settings(workspace=tmp_path, spark_master="spark://127.0.0.1:7077"), spark) == "spark"


def test_the_engine_is_chosen_without_spark_where_its_jars_do_not_matter(tmp_path: Path) -> None:
    """Opening a table starts no Spark where the engine does not depend on Spark's jars (auto on an embedded Spark, or
    delta-rs named): a run that then needs no Spark job starts none. Spark is asked where the answer is its jars'."""
    asked: list[str] = []

    def never(master: str):
        return lambda: asked.append(master) or pytest.fail("Spark asked for, where the engine needs no Spark")

    for given in (
        {},
        {"delta_writer": "delta-rs"},
        {"delta_writer": "delta-rs", "spark_master": "spark://127.0.0.1:7077"},
    ):
        settings = Settings(workspace=tmp_path, **given)
        assert choose_engine(settings, never(settings.spark_master)) == "delta-rs"
        table = Table.open(f"{tmp_path}/t", settings)
        # auto's delta-rs leaves merges of more new rows than spark_merge_min_rows to Spark's Delta; a named one none.
        assert (table.engine, table.spark_merge_above) == ("delta-rs", None if given else 2000)
    assert asked == []
    assert (
        Table.open(f"{tmp_path}/t", Settings(workspace=tmp_path, spark_merge_min_rows="none")).spark_merge_above is None
    )


def test_commit_versions_are_exact_while_another_writer_commits(tmp_path: Path) -> None:
    """delta-rs' history() numbers commits from a latest version it reads apart from them: under a concurrent
    writer it was out by one in about a quarter of calls, so a write could report (and then read) the wrong version."""
    import subprocess
    import sys

    from imagelake.infra.delta import append_arrow

    uri = str(tmp_path / "table")
    write_deltalake(uri, pa.table({"x": [0]}))
    stop = tmp_path / "stop"
    other = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, sys, pyarrow as pa; from deltalake import write_deltalake\n"
         "while not pathlib.Path(sys.argv[2]).exists(): "
         "write_deltalake(sys.argv[1], pa.table({'x': [1]}), mode='append')",
         uri, str(stop)]
    )  # fmt: skip
    try:
        wrong = []
        for mark in range(100, 130):
            version = append_arrow(uri, pa.table({"x": [mark]}))
            at = lambda v: pa.table(DeltaTable(uri, version=v).to_pyarrow_table()).column("x").to_pylist()  # noqa: E731
            if mark not in at(version) or mark in at(version - 1):
                wrong.append((mark, version))
            history = Table(uri).history()
            if [c["version"] for c in history] != list(range(history[0]["version"], -1, -1)):
                wrong.append(("history", [c["version"] for c in history][-3:]))
        assert other.poll() is None, "the other writer was committing throughout"
    finally:
        stop.touch()
        other.wait(timeout=60)
    assert not wrong, f"versions reported for these commits were not theirs: {wrong}"


@pytest.mark.both_engines
def test_a_column_another_writer_added_stays_and_the_runs_go_on(spark, lake, digits_dir: Path, tmp_path: Path) -> None:
    import shutil

    from tests.lake import copy_digits

    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=5)
    lake.run(source)
    spark.sql(f"ALTER TABLE delta.`{lake.table}` ADD COLUMNS (reviewer STRING)")  # another team's column
    spark.sql(f"UPDATE delta.`{lake.table}` SET reviewer = 'ann' WHERE label = '0'")
    copy_digits(digits_dir, source, labels=("2",), per_label=5)
    _, _, added = lake.run(source)  # an append of the run's own data files
    changed = sorted((source / "1").glob("*.png"))[0]
    shutil.copy(sorted((digits_dir / "3").glob("*.png"))[0], changed)  # a file rewritten in place (new bytes): a merge
    _, _, merged = lake.run(source)
    assert (added.rows, merged.rows) == (5, 1)
    assert "reviewer" in Table(lake.table).columns(), "the other writer's column is still there"
    table = lake.read(lake.table, ["path", "label", "reviewer"])
    assert len(table["path"]) == 15 and table["reviewer"].count("ann") == 5 and table["label"].count("2") == 5


@pytest.mark.both_engines
def test_a_table_another_writer_gave_column_mapping_is_refused_saying_what_to_do(
    spark, lake, digits_dir: Path, tmp_path: Path
) -> None:
    from imagelake.infra.delta import UnsupportedTable
    from tests.lake import copy_digits

    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=5)
    lake.run(source)
    spark.sql(
        f"ALTER TABLE delta.`{lake.table}` SET TBLPROPERTIES "
        "('delta.columnMapping.mode' = 'name', 'delta.minReaderVersion' = '2', 'delta.minWriterVersion' = '5')"
    )
    version = Table(lake.table).version()
    copy_digits(digits_dir, source, labels=("2",), per_label=2)
    with pytest.raises(
        UnsupportedTable, match=rf"Delta table {lake.table} v{version}: it uses column mapping .* CREATE TABLE"
    ):
        lake.run(source)
    assert Table(lake.table).version() == version, "nothing was written"


def test_deletion_vectors_are_seen_and_named_with_what_to_do_and_their_version_is_never_read_through_its_files(
    spark, tmp_path: Path
) -> None:
    from imagelake.infra.delta import UnsupportedTable, plain_files_problem, read_version

    table = str(tmp_path / "dv")
    spark.range(0, 100, 1, 1).selectExpr("id", "cast(id as string) as name").write.format("delta").save(table)
    spark.sql(f"ALTER TABLE delta.`{table}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    assert plain_files_problem(table) is None, "the feature alone deletes nothing"
    spark.sql(f"DELETE FROM delta.`{table}` WHERE id = 7")  # one row of the one file: a deletion vector
    assert "1 of its data files carry deletion vectors" in plain_files_problem(
        table
    ) and "REORG TABLE" in plain_files_problem(table)
    marked = DeltaTable(table).version()
    with pytest.raises(
        UnsupportedTable, match=rf"Delta table {table} v{marked}: 1 of its data files carry deletion vectors"
    ):
        read_version(spark, table, marked, "delta-rs")  # a plain read of its files would give the deleted row back
    spark.sql(f"REORG TABLE delta.`{table}` APPLY (PURGE)")  # what the message says to do
    assert plain_files_problem(table) is None
    assert read_version(spark, table, DeltaTable(table).version(), "delta-rs").count() == 99
    # The version with the deletion vector is still in the log: a read of it through its files (a retrain pinned to
    # it) is refused the same way, and Spark's Delta reader, which applies the vector, reads it right.
    for read in (lambda: read_version(spark, table, marked, "delta-rs"), lambda: Table(table).files(marked)):
        with pytest.raises(
            UnsupportedTable, match=rf"Delta table {table} v{marked}: 1 of its data files carry deletion vectors"
        ):
            read()
    assert read_version(spark, table, marked, "spark").count() == 99


def test_a_history_table_another_writer_gave_deletion_vectors_is_refused_where_it_is_read(
    spark, tmp_path: Path
) -> None:
    from imagelake.infra.delta import UnsupportedTable
    from imagelake.infra.settings import load_settings
    from imagelake.tasks.registry.moves import record, recorded

    settings = load_settings(overrides={"workspace": str(tmp_path / "ws")})
    record(
        settings,
        [
            {
                "model": "m",
                "alias": "champion",
                "from_version": None,
                "to_version": "1",
                "action": "promote",
                "reason": "first",
                "move_id": "a",
            }
        ],
    )
    record(
        settings,
        [  # one move, two rows in one data file
            {
                "model": "m",
                "alias": "champion",
                "from_version": "1",
                "to_version": "2",
                "action": "promote",
                "reason": "better",
                "move_id": "b",
            },
            {
                "model": "m",
                "alias": "previous-champion",
                "from_version": None,
                "to_version": "1",
                "action": "promote",
                "reason": "better",
                "move_id": "b",
            },
        ],
    )
    assert recorded(settings, "b")
    history = settings.history_uri
    spark.sql(f"ALTER TABLE delta.`{history}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    spark.sql(
        f"DELETE FROM delta.`{history}` WHERE move_id = 'b' AND alias = 'champion'"
    )  # a deletion vector: the file stays
    with pytest.raises(
        UnsupportedTable, match=rf"Delta table {history} v\d+: 1 of its data files carry deletion vectors"
    ):
        recorded(settings, "b")


@pytest.mark.both_engines
def test_quarantine_with_column_mapping_stops_a_run_naming_it(spark, lake, digits_dir: Path, tmp_path: Path) -> None:
    from imagelake.infra.delta import UnsupportedTable
    from tests.lake import copy_digits

    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=5)
    (source / "1" / "junk.png").write_text("not an image")  # a row of the quarantine table
    lake.run(source)
    spark.sql(
        f"ALTER TABLE delta.`{lake.quarantine}` SET TBLPROPERTIES "
        "('delta.columnMapping.mode' = 'name', 'delta.minReaderVersion' = '2', 'delta.minWriterVersion' = '5')"
    )
    version, quarantined = Table(lake.table).version(), Table(lake.quarantine).version()
    copy_digits(digits_dir, source, labels=("2",), per_label=2)
    (source / "2" / "junk.png").write_text("not an image either")
    with pytest.raises(
        UnsupportedTable, match=rf"Delta table {lake.quarantine} v{quarantined}: it uses column mapping .* CREATE TABLE"
    ):
        lake.run(source)
    assert (Table(lake.table).version(), Table(lake.quarantine).version()) == (version, quarantined), (
        "nothing was written"
    )


@pytest.mark.both_engines
def test_a_table_from_before_a_column_was_added_gets_it_and_keeps_its_rows(
    spark, lake, digits_dir: Path, tmp_path: Path
) -> None:
    import shutil

    from imagelake.infra.delta import read_version
    from tests.lake import copy_digits

    source = tmp_path / "src"
    copy_digits(digits_dir, source, labels=("0", "1"), per_label=5)
    lake.run(source)
    # The table as an older imagelake wrote it: no `stamp` column.
    older = pa.Table.from_pandas(
        read_version(spark, lake.table, Table(lake.table).version(), lake.engine).drop("stamp").toPandas(),
        preserve_index=False,
    )
    write_deltalake(lake.table, older, mode="overwrite", schema_mode="overwrite")
    assert "stamp" not in Table(lake.table).columns()
    copy_digits(digits_dir, source, labels=("2",), per_label=3)
    shutil.copy(
        sorted((digits_dir / "3").glob("*.png"))[0], sorted((source / "1").glob("*.png"))[0]
    )  # new bytes: a merge too
    _, resized, written = lake.run(source, retire=True)
    assert (resized.decoded, written.rows) == (4, 4) and "stamp" in Table(lake.table).columns()
    stamps = lake.read(lake.table, ["path", "stamp"])
    assert len(stamps["path"]) == 13 and sum(stamp is not None for stamp in stamps["stamp"]) == 4, (
        "old rows read it as null"
    )
    _, resized, written = lake.run(source, retire=True)
    assert (resized.decoded, written.rows, written.retired) == (0, 0, 0), (
        "rows without a stamp are not taken for changed files"
    )


def test_a_table_merged_by_delta_rs_is_read_by_column_values_where_this_pyarrow_cannot_open_its_files(
    tmp_path: Path,
) -> None:
    from imagelake.infra.delta import column_values, merge_arrow

    uri = str(tmp_path / "table")
    merge_arrow(uri, rows(["a", "b"]))  # the first write: plain Parquet
    assert column_values(uri, "path") == ["a", "b"]
    merge_arrow(uri, rows(["b", "c"], salt="2"))  # a merge: delta-rs rewrites b's file with Arrow view types
    with pytest.raises(pa.ArrowInvalid):  # what tests and benches read tables with before, and what it pins
        DeltaTable(uri).to_pyarrow_table(columns=["path"])
    assert sorted(column_values(uri, "path")) == ["a", "b", "c"]
    assert sorted(column_values(uri, "sha256", version=0)) == sorted(rows(["a", "b"]).column("sha256").to_pylist())
