"""Compaction and vacuum keep the table versions that registered models were trained on."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable
from mlflow import MlflowClient
from PIL import Image

from imagelake.infra.delta import Table, read_version
from imagelake.tasks.stages.maintain import maintain_table, protected_versions
from tests.lake import Lake, copy_digits


def grow_table(lake: Lake, digits_dir: Path, source: Path) -> None:
    """v0 with 40 images, then three runs that each replace a file (so v0's files stop being current)."""
    copy_digits(digits_dir, source)
    lake.run(source)
    for i in range(3):
        changed = sorted((source / "1").glob("*.png"))[i]
        Image.open(changed).rotate(90).save(changed)
        lake.run(source)


@pytest.mark.both_engines
@pytest.mark.parametrize("registered", [True, False])
def test_vacuum_never_removes_a_registered_models_version(
    lake: Lake, digits_dir: Path, tmp_path: Path, registered: bool
) -> None:
    grow_table(lake, digits_dir, tmp_path / "src")
    assert DeltaTable(lake.table).version() == 3
    client = MlflowClient(
        f"sqlite:///{tmp_path / 'mlflow.db'}", f"sqlite:///{tmp_path / 'mlflow.db'}"
    )  # the registry URI is process-global otherwise
    client.create_registered_model("digits")
    if registered:
        client.create_model_version(
            "digits", source=str(tmp_path), tags={"delta_table": lake.table, "delta_version": "0"}
        )
    keep = protected_versions(client, "digits", lake.table)
    assert keep == ([0] if registered else [])
    # A data file that a killed run wrote but never committed.
    orphan = Path(lake.table) / "part-00000-left-by-a-killed-run-c000.imagelake.parquet"
    orphan.write_bytes(Path(DeltaTable(lake.table).file_uris()[0].removeprefix("file://")).read_bytes())
    os.utime(orphan, (time.time() - 7200, time.time() - 7200))

    report = maintain_table(Table(lake.table, lake.spark, lake.engine), retention_hours=0, keep_versions=keep)
    assert report["engine"] == lake.engine
    assert report["version"] > 3 and report["files_vacuumed"] > 0
    assert not orphan.exists(), "vacuum removes files that no commit added"
    assert read_version(lake.spark, lake.table, report["version"], lake.engine).count() == 40
    if registered:
        assert read_version(lake.spark, lake.table, 0, lake.engine).count() == 40, "the registered version is intact"
    else:
        missing = [
            uri
            for uri in DeltaTable(lake.table, version=0).file_uris()
            if not Path(uri.removeprefix("file://")).exists()
        ]
        assert missing, "without a registered model, retention 0 removes version 0's files"


def test_a_model_name_with_a_quote_still_protects_its_versions(tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}", f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_registered_model("it's digits")
    client.create_model_version(
        "it's digits", source=str(tmp_path), tags={"delta_table": "/lake/images", "delta_version": "4"}
    )
    client.create_registered_model("other")
    client.create_model_version(
        "other", source=str(tmp_path), tags={"delta_table": "/lake/images", "delta_version": "7"}
    )
    assert protected_versions(client, "it's digits", "/lake/images") == [4]


def test_no_answer_from_the_registry_means_nothing_is_vacuumed(
    lake: Lake, digits_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    grow_table(lake, digits_dir, tmp_path / "src")
    files = sorted(p.name for p in Path(lake.table).glob("*.parquet"))
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    client = MlflowClient(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}")
    with pytest.raises(RuntimeError, match=r"nothing was compacted, vacuumed or removed"):  # RegistryUnavailable
        protected_versions(client, "digits", lake.table)
    # The stages themselves, as `imagelake maintain` runs them, with nothing kept by retention: they fail closed too.
    from imagelake.infra.settings import load_settings
    from imagelake.tasks.stages.maintain import maintain_cache, maintain_images

    settings = load_settings(
        overrides={
            "workspace": str(tmp_path / "ws"),
            "table_root": str(Path(lake.table).parent),
            "table_name": Path(lake.table).name,
            "mlflow_tracking_uri": f"http://127.0.0.1:{port}",
            "vacuum_retention_hours": 0,
        }
    )
    assert settings.table_uri.removeprefix("file://") == lake.table.removeprefix("file://")
    for maintain in (maintain_images, maintain_cache):
        with pytest.raises(RuntimeError, match=r"nothing was compacted, vacuumed or removed"):
            maintain.fn(settings)
    assert sorted(p.name for p in Path(lake.table).glob("*.parquet")) == files
    assert read_version(lake.spark, lake.table, 0, lake.engine).count() == 40
