"""Settings: defaults, environment, config files, overrides, and errors that name the field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flows.cli import parse_overrides
from infra.settings import SettingsError, load_settings


def test_defaults_run_on_one_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    assert settings.spark_master == "local[*]"
    assert settings.image_size == 224
    assert settings.ray_address is None
    assert settings.table_uri == str(tmp_path / ".imagelake" / "tables" / "images")
    assert settings.tracking_uri == f"sqlite:///{tmp_path / '.imagelake' / 'mlflow.db'}"


def test_endpoints_change_by_settings_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("IMAGELAKE_SPARK_MASTER", "spark://10.0.0.1:7077")
    monkeypatch.setenv("IMAGELAKE_RAY_ADDRESS", "ray://head:10001")
    monkeypatch.setenv("IMAGELAKE_MLFLOW_TRACKING_URI", "http://mlflow:5000")
    monkeypatch.setenv("IMAGELAKE_TABLE_ROOT", "s3://bucket/lake")
    monkeypatch.setenv("IMAGELAKE_PREFECT_API_URL", "http://prefect:4200/api")
    settings = load_settings()
    assert settings.spark_master == "spark://10.0.0.1:7077"
    assert settings.ray_address == "ray://head:10001"
    assert settings.tracking_uri == "http://mlflow:5000"
    assert settings.artifact_location is None
    assert settings.table_uri == "s3://bucket/lake/images"
    assert settings.prefect_api_url == "http://prefect:4200/api"


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_config_file_is_read_and_environment_and_overrides_win(suffix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / f"imagelake{suffix}"
    values = {"image_size": 96, "num_workers": 3, "batch_size": 8}
    if suffix == ".toml":
        path.write_text("\n".join(f"{key} = {value}" for key, value in values.items()))
    else:
        path.write_text(json.dumps(values))  # JSON is valid YAML too
    monkeypatch.setenv("IMAGELAKE_NUM_WORKERS", "4")
    settings = load_settings(path, overrides={"batch_size": 16})
    assert (settings.image_size, settings.num_workers, settings.batch_size) == (96, 4, 16)


def test_bad_values_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMAGELAKE_IMAGE_SIZE", "huge")
    with pytest.raises(SettingsError, match="image_size"):
        load_settings()


def test_unknown_setting_is_refused() -> None:
    with pytest.raises(SettingsError, match="image_sise"):
        load_settings(overrides={"image_sise": 64})


def test_fractions_must_leave_training_data() -> None:
    with pytest.raises(SettingsError, match="val_fraction"):
        load_settings(overrides={"val_fraction": 0.5, "test_fraction": 0.45})


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="nope.yaml"):
        load_settings(tmp_path / "nope.yaml")


def test_cli_overrides_parse_json_values_and_reject_malformed_pairs() -> None:
    assert parse_overrides(["max_epochs=3", "spark_jars=[\"a.jar\"]", "model_name=digits"]) == {
        "max_epochs": 3,
        "spark_jars": ["a.jar"],
        "model_name": "digits",
    }
    with pytest.raises(SettingsError, match="NAME=VALUE"):
        parse_overrides(["max_epochs"])


def test_settings_that_run_code_are_refused_from_runs_unless_the_worker_allows_them(monkeypatch) -> None:
    from infra.settings import SettingsError, refuse_unsafe

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    assert refuse_unsafe({"max_epochs": 2}, "a run") == {"max_epochs": 2}
    with pytest.raises(SettingsError, match=r"allow_pickle_models, spark_jars cannot be set from a run: .*IMAGELAKE_ALLOW_FROM_RUNS=allow_pickle_models,spark_jars"):
        refuse_unsafe({"spark_jars": ["/tmp/x.jar"], "allow_pickle_models": True, "max_epochs": 2}, "a run")
    monkeypatch.setenv("IMAGELAKE_ALLOW_FROM_RUNS", "spark_jars, allow_pickle_models")
    assert refuse_unsafe({"spark_jars": ["/tmp/x.jar"], "allow_pickle_models": True}, "a run")
    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS")
    # Where stage results (read back by unpickling) and checkpoints (resumed with torch.load) are found: a run pointed at
    # a folder of someone else's files would load them.
    for name in ("workspace", "results_root", "ray_storage_root"):
        with pytest.raises(SettingsError, match=f"{name} cannot be set from a run"):
            refuse_unsafe({name: "/tmp/elsewhere"}, "a run")


def test_a_settings_file_named_by_a_run_may_not_set_what_runs_code_unless_it_ships_with_the_code(monkeypatch, tmp_path) -> None:
    from infra.settings import CODE_ROOT, SettingsError, refuse_unsafe_file

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    planted = tmp_path / "mine.yaml"
    planted.write_text("allow_pickle_models: true\nmax_epochs: 2\n")
    with pytest.raises(SettingsError, match=rf"allow_pickle_models cannot be set from the settings file {planted}, named by a run and outside the code folder"):
        refuse_unsafe_file(planted, "a run")
    # A relative path that climbs out of the code folder is outside it too.
    monkeypatch.chdir(CODE_ROOT)
    climbing = Path("infra/clusters") / os.path.relpath(planted, CODE_ROOT / "infra/clusters")
    with pytest.raises(SettingsError, match="allow_pickle_models cannot be set"):
        refuse_unsafe_file(climbing, "a run")
    # The deployments' own settings files set spark_conf and folders: they ship with the code.
    refuse_unsafe_file("infra/clusters/kubernetes.yaml", "a run")
    refuse_unsafe_file(CODE_ROOT / "infra/clusters/local.yaml", "a run")
    # A file that sets nothing unsafe, or what the worker allows, is fine anywhere.
    (tmp_path / "safe.yaml").write_text("max_epochs: 2\n")
    refuse_unsafe_file(tmp_path / "safe.yaml", "a run")
    monkeypatch.setenv("IMAGELAKE_ALLOW_FROM_RUNS", "allow_pickle_models")
    refuse_unsafe_file(planted, "a run")
