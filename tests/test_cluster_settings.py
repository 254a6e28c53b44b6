"""The cluster settings files of infra/clusters (docs/operations.md, "Running on a cluster"): each parses and holds no
secret."""

from __future__ import annotations

import re
from datetime import date
from pathlib import Path

import pytest
import yaml

from imagelake.infra.local.cluster import Ports
from imagelake.infra.settings import Settings, SettingsError, load_settings
from imagelake.infra.spark import on_loopback
from tests.conftest import REPO

CLUSTERS = REPO / "infra" / "clusters"
SETTINGS_FILES = sorted(path for path in CLUSTERS.glob("*.yaml") if not path.name.startswith("prefect-"))
SECRET_WORDS = re.compile(r"(password|passwd|secret|token|api[_-]?key|access[_-]?key)\s*[:=]", re.IGNORECASE)


@pytest.fixture(autouse=True)
def no_imagelake_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files alone: a shell that loaded a cluster.env must not change what these tests read."""
    import os

    for name in list(os.environ):
        if name.startswith("IMAGELAKE_"):
            monkeypatch.delenv(name)


def load(path: Path) -> Settings:
    return load_settings(path)


def test_there_is_a_settings_file_for_each_cluster_the_docs_cover() -> None:
    assert {path.stem for path in SETTINGS_FILES} == {"local", "databricks", "kubernetes"}
    page = (REPO / "docs" / "operations.md").read_text()
    for path in [*SETTINGS_FILES, CLUSTERS / "prefect-kubernetes.yaml"]:
        assert f"infra/clusters/{path.name}" in page, f"docs/operations.md does not point at {path.name}"


@pytest.mark.parametrize("path", SETTINGS_FILES, ids=lambda p: p.name)
def test_each_cluster_settings_file_is_valid_and_names_no_secret(path: Path) -> None:
    settings = load(path)
    text = path.read_text()
    assert not SECRET_WORDS.search(text), (
        f"{path.name} seems to hold a credential: {SECRET_WORDS.search(text).group(0)}"
    )
    # Every key is a real setting (extra keys are refused by the model; this checks the file's own spelling too).
    assert set(yaml.safe_load(text)) <= set(Settings.model_fields)
    # At least as many cache partitions as training workers (Petastorm shards per worker).
    assert settings.partitions_per_worker >= 2


def test_the_local_cluster_file_matches_make_cluster_up() -> None:
    settings, ports = load(CLUSTERS / "local.yaml"), Ports()
    assert settings.spark_master == f"spark://127.0.0.1:{ports.spark}" and on_loopback(settings.spark_master)
    assert settings.ray_address == f"127.0.0.1:{ports.ray}"
    assert settings.mlflow_tracking_uri == f"http://127.0.0.1:{ports.mlflow}"
    assert settings.prefect_api_url == f"http://127.0.0.1:{ports.prefect}/api"
    assert settings.ray_placement_strategy == "STRICT_SPREAD" and settings.num_workers == 2  # one rank per Ray node


@pytest.mark.parametrize("name", ["databricks", "kubernetes"])
def test_the_real_cluster_files_train_on_gpus_packed_with_transfer_learning(name: str) -> None:
    settings = load(CLUSTERS / f"{name}.yaml")
    assert settings.use_gpu and settings.gpus_per_worker >= 1 and settings.num_workers >= 2
    assert settings.ray_placement_strategy == "PACK"  # GPUs of one machine before more machines
    assert settings.pretrained and settings.freeze_backbone and settings.batch_size >= 64
    assert settings.lr_scaling in ("linear", "sqrt")
    for location in (settings.cache_uri, settings.staging_uri, settings.ray_storage_path, settings.results_uri):
        assert not location.startswith(str(REPO)), f"{name}: {location} is not shared storage"


def test_the_databricks_file_uses_databricks_delta_tracking_and_unity_catalog() -> None:
    settings = load(CLUSTERS / "databricks.yaml")
    assert settings.delta_writer == "spark"
    assert settings.mlflow_tracking_uri == "databricks" and settings.mlflow_registry_uri == "databricks-uc"
    assert len(settings.model_name.split(".")) == 3 and settings.mlflow_experiment.startswith("/")
    assert settings.ray_address == "auto"
    assert all(
        path.startswith("/Volumes/") for path in (settings.table_uri, settings.cache_uri, settings.ray_storage_path)
    )


def test_the_kubernetes_file_runs_spark_on_kubernetes_with_object_storage_tables() -> None:
    settings = load(CLUSTERS / "kubernetes.yaml")
    assert settings.spark_master.startswith("k8s://https://") and not on_loopback(settings.spark_master)
    for key in ("spark.kubernetes.container.image", "spark.kubernetes.namespace"):
        assert settings.spark_conf.get(key), key
    # S3A and Delta: the jars `make install` put in the image, never a download at run time.
    assert "spark.jars.packages" not in settings.spark_conf and settings.delta_writer == "spark"
    assert settings.table_uri.startswith("s3://")
    # KubeRay: the flow pod is no Ray node, so it joins through Ray Client (tests/test_cluster.py runs that form).
    assert settings.ray_address.startswith("ray://") and settings.ray_address.endswith(":10001")
    assert settings.mlflow_tracking_uri.startswith("http://") and settings.prefect_api_url.endswith("/api")


def test_the_kubernetes_deployments_point_at_real_flows_with_valid_parameters() -> None:
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((CLUSTERS / "prefect-kubernetes.yaml").read_text())
    assert not SECRET_WORDS.search((CLUSTERS / "prefect-kubernetes.yaml").read_text())
    assert spec["deployments"]
    for deployment in spec["deployments"]:
        flow = load_flow_from_entrypoint(str(REPO / deployment["entrypoint"]))
        parameters = dict(deployment["parameters"])
        assert (REPO / parameters["config_file"]).is_file(), parameters["config_file"]
        load(REPO / parameters["config_file"])
        # Dates of a backfill are given when it is started; any two do for the check.
        if flow.name == "imagelake-backfill":
            parameters.update(start_date=date(2026, 1, 1), end_date=date(2026, 1, 2))
        flow.validate_parameters(parameters)
        # The image holds the repository at /opt/imagelake: entrypoints and config_file are relative to it.
        assert {"prefect.deployments.steps.set_working_directory": {"directory": "/opt/imagelake"}} in deployment.get(
            "pull", spec.get("pull", [])
        )
        pool = deployment["work_pool"]
        assert pool["name"] == "imagelake-kubernetes" and pool["job_variables"]["image"]


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"mlflow_tracking_uri": "https://pipeline:hunter2@mlflow.example.com"}, "mlflow_tracking_uri"),
        ({"prefect_api_url": "http://admin:hunter2@127.0.0.1:4200/api"}, "prefect_api_url"),
        ({"table_root": "s3://AKIA:hunter2@bucket/tables"}, "table_root"),
        ({"spark_conf": {"spark.hadoop.fs.s3a.secret.key": "hunter2"}}, "spark.hadoop.fs.s3a.secret.key"),
        ({"spark_conf": {"spark.hadoop.fs.azure.account.key.lake.dfs.core.windows.net": "hunter2"}}, "account.key"),
        ({"spark_conf": {"spark.kubernetes.authenticate.oauthToken": "hunter2"}}, "oauthToken"),
        (
            {"spark_conf": {"spark.hadoop.fs.s3a.endpoint": "https://minio:hunter2@minio.local"}},
            "spark.hadoop.fs.s3a.endpoint",
        ),
        ({"spark_jars": ["https://user:hunter2@repo.example.com/delta.jar"]}, "spark_jars[0]"),
    ],
)
def test_settings_refuse_credentials_and_do_not_repeat_them(overrides: dict, named: str) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(overrides=overrides)
    assert named in str(refused.value) and "environment" in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_a_user_name_alone_and_where_a_secret_comes_from_are_allowed() -> None:
    assert load_settings(overrides={"mlflow_tracking_uri": "https://pipeline@mlflow.example.com"}).mlflow_tracking_uri
    allowed = {
        "spark.hadoop.fs.s3a.aws.credentials.provider": "com.amazonaws.auth.WebIdentityTokenCredentialsProvider",
        "spark.kubernetes.authenticate.oauthTokenFile": "/var/run/secrets/token",
        "spark.authenticate.enableSaslEncryption": "true",
    }
    assert load_settings(overrides={"spark_conf": allowed}).spark_conf == allowed


def test_spark_masters_on_loopback_are_told_apart_from_remote_ones() -> None:
    assert (
        on_loopback("local[2]")
        and on_loopback("spark://127.0.0.1:7077")
        and on_loopback("spark://localhost:7077,127.0.0.1:7078")
    )
    assert (
        not on_loopback("spark://10.0.0.5:7077")
        and not on_loopback("k8s://https://kubernetes.default.svc:443")
        and not on_loopback("yarn")
    )


def test_a_driver_turns_on_spark_authentication_for_a_standalone_master_with_the_secret_in_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from imagelake.infra.spark import SPARK_AUTH_SECRET, authentication_conf

    monkeypatch.delenv(SPARK_AUTH_SECRET, raising=False)
    assert authentication_conf("spark://127.0.0.1:7077") == {}
    monkeypatch.setenv(SPARK_AUTH_SECRET, "the-cluster-secret")
    conf = authentication_conf("spark://127.0.0.1:7077")
    assert conf["spark.authenticate"] == "true"
    # The configuration (which pyspark puts on spark-submit's command line) never holds the secret itself.
    assert "the-cluster-secret" not in "".join(conf.values())
    assert authentication_conf("local[2]") == {} and authentication_conf("k8s://https://k:443") == {}
