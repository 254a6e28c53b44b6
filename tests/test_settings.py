"""Settings: defaults, environment, config files, overrides, and errors that name the field."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from imagelake.flows.cli import parse_overrides
from imagelake.infra.settings import SettingsError, load_settings


def test_defaults_run_on_one_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    assert settings.spark_master == "local[*]"
    assert settings.image_size == 160
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
def test_config_file_is_read_and_environment_and_overrides_win(
    suffix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / f"imagelake{suffix}"
    values = {"image_size": 96, "num_workers": 3, "batch_size": 8}
    if suffix == ".toml":
        path.write_text("\n".join(f"{key} = {value}" for key, value in values.items()))
    else:
        path.write_text(json.dumps(values))  # JSON is valid YAML too
    monkeypatch.setenv("IMAGELAKE_NUM_WORKERS", "4")
    settings = load_settings(path, overrides={"batch_size": 16})
    assert (settings.image_size, settings.num_workers, settings.batch_size) == (96, 4, 16)


def test_the_demo_config_is_valid_settings_and_changes_only_what_the_readme_names() -> None:
    """`make run` reads infra/demo.yaml: a setting misspelt there would stop the demo, and one added there unsaid
    would make the README's account of the demo untrue."""
    from imagelake.infra.run_policy import CODE_ROOT

    demo, defaults = load_settings(CODE_ROOT / "infra" / "demo.yaml"), load_settings()
    changed = {name for name in type(demo).model_fields if getattr(demo, name) != getattr(defaults, name)}
    assert changed == {"image_size", "backbone_lr_factor", "max_epochs", "batch_size"}
    readme = (CODE_ROOT / "README.md").read_text()
    assert all(f"{name}: {getattr(demo, name)}" in (CODE_ROOT / "infra" / "demo.yaml").read_text() for name in changed)
    assert "infra/demo.yaml" in readme and f"{demo.max_epochs} epochs of {demo.batch_size}-image batches" in readme


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
    assert parse_overrides(["max_epochs=3", 'spark_jars=["a.jar"]', "model_name=digits"]) == {
        "max_epochs": 3,
        "spark_jars": ["a.jar"],
        "model_name": "digits",
    }
    with pytest.raises(SettingsError, match="NAME=VALUE"):
        parse_overrides(["max_epochs"])


def test_the_doctor_refuses_a_part_it_does_not_know_before_checking_anything(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from imagelake.flows.cli import app

    command = ["doctor", "--only", "spark", "--only", "sprak", "--set", f"workspace={tmp_path}"]
    refused = CliRunner().invoke(app, command)
    assert refused.exit_code == 2
    assert "--only sprak: no such part; the parts are python, java, spark" in refused.output
    assert not [line for line in refused.output.splitlines() if line.startswith(("ok", "MISSING", "absent"))]


def test_settings_that_run_code_are_refused_from_runs_unless_the_worker_allows_them(monkeypatch) -> None:
    from imagelake.infra.run_policy import refuse_unsafe
    from imagelake.infra.settings import SettingsError

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    assert refuse_unsafe({"max_epochs": 2}, "a run") == {"max_epochs": 2}
    with pytest.raises(
        SettingsError,
        match=(
            r"allow_pickle_models, spark_jars cannot be set from a run: "
            r".*IMAGELAKE_ALLOW_FROM_RUNS=allow_pickle_models,spark_jars"
        ),
    ):
        refuse_unsafe({"spark_jars": ["/tmp/x.jar"], "allow_pickle_models": True, "max_epochs": 2}, "a run")
    monkeypatch.setenv("IMAGELAKE_ALLOW_FROM_RUNS", "spark_jars, allow_pickle_models")
    assert refuse_unsafe({"spark_jars": ["/tmp/x.jar"], "allow_pickle_models": True}, "a run")
    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS")
    # Where stage results (read back by unpickling) and checkpoints (resumed with torch.load) are found: a run pointed
    # at
    # a folder of someone else's files would load them.
    for name in ("workspace", "results_root", "ray_storage_root"):
        with pytest.raises(SettingsError, match=f"{name} cannot be set from a run"):
            refuse_unsafe({name: "/tmp/elsewhere"}, "a run")


def test_a_settings_file_named_by_a_run_may_not_set_what_runs_code_unless_it_ships_with_the_code(
    monkeypatch, tmp_path
) -> None:
    from imagelake.infra.run_policy import CODE_ROOT, refuse_unsafe_file
    from imagelake.infra.settings import SettingsError

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    planted = tmp_path / "mine.yaml"
    planted.write_text("allow_pickle_models: true\nmax_epochs: 2\n")
    with pytest.raises(
        SettingsError,
        match=(
            rf"allow_pickle_models cannot be set from the settings file {planted}, named by a run and not one of "
            r"the settings files shipped in"
        ),
    ):
        refuse_unsafe_file(planted, "a run")
    # A relative path that climbs out of the code folder is outside it too.
    monkeypatch.chdir(CODE_ROOT)
    climbing = Path("infra/clusters") / os.path.relpath(planted, CODE_ROOT / "infra/clusters")
    with pytest.raises(SettingsError, match="allow_pickle_models cannot be set"):
        refuse_unsafe_file(climbing, "a run")
    # Nor is a file under the code folder that did not ship with it: the workspace (.imagelake by default) lies there.
    inside = CODE_ROOT / ".imagelake" / f"planted-{tmp_path.name}.yaml"
    inside.parent.mkdir(exist_ok=True)
    inside.write_text(planted.read_text())
    try:
        with pytest.raises(SettingsError, match="allow_pickle_models cannot be set"):
            refuse_unsafe_file(inside, "a run")
    finally:
        inside.unlink()
    # The deployments' own settings files set spark_conf and folders: they ship with the code.
    refuse_unsafe_file("infra/clusters/kubernetes.yaml", "a run")
    refuse_unsafe_file(CODE_ROOT / "infra/clusters/local.yaml", "a run")
    # A file that sets nothing unsafe, or what the worker allows, is fine anywhere.
    (tmp_path / "safe.yaml").write_text("max_epochs: 2\n")
    refuse_unsafe_file(tmp_path / "safe.yaml", "a run")
    monkeypatch.setenv("IMAGELAKE_ALLOW_FROM_RUNS", "allow_pickle_models")
    refuse_unsafe_file(planted, "a run")


def test_every_setting_declares_whether_runs_may_set_it_and_which_stage_keys_it_enters() -> None:
    # A new field of Settings fails here until its declaration says whether a run from a deployment may set it and
    # which stages' output it changes: two decisions, neither with a default (stages=() says "none" on purpose).
    from imagelake.infra.declare import declaration, undeclared
    from imagelake.infra.run_policy import ALLOWED_FROM_RUNS, REFUSED_FROM_RUNS, RUN_LIMITS
    from imagelake.infra.settings import Settings

    missing = undeclared(Settings)
    assert not missing, (
        f"declare {missing} in infra/settings.py with setting(...) instead of Field(...): runs='allowed' where a run "
        "from a deployment may set it, runs='refused' where only the worker may; stages=(the stages whose output it "
        "changes), or stages=() where it changes none; cap=('at most' or 'at least', limit) where a run may only "
        "make it safer"
    )
    assert not ALLOWED_FROM_RUNS & REFUSED_FROM_RUNS
    assert ALLOWED_FROM_RUNS | REFUSED_FROM_RUNS == set(Settings.model_fields), "names that are not settings"
    assert set(RUN_LIMITS) <= ALLOWED_FROM_RUNS
    # A time limit or a lock wait changes no output: a run that shortens one must reuse every stored result.
    timed = [
        name
        for name in Settings.model_fields
        if ("timeout" in name or "lock_wait" in name) and declaration(Settings, name).stages
    ]
    assert not timed, f"time limits in stage keys: declare {timed} with stages=()"


def test_settings_are_declared_by_section_with_their_reasons_and_the_settings_module_holds_declarations_only() -> None:
    # Each field names its section (docs/settings.md groups by it) and, where runs may not set it or go past a cap,
    # why; the reasons many share are declared once (infra/declare.py), not pasted beside each field.
    import ast
    from collections import Counter

    from imagelake.infra.declare import SECTIONS, declaration, sections
    from imagelake.infra.settings import Settings
    from tests.conftest import REPO

    grouped = sections(Settings)
    assert sorted(name for names in grouped.values() for name in names) == sorted(Settings.model_fields)
    assert list(grouped) == [section for section in SECTIONS if section in grouped]
    unexplained = [
        name
        for name in Settings.model_fields
        if (found := declaration(Settings, name)).runs == "refused" or found.cap
        if not declaration(Settings, name).why
    ]
    assert not unexplained, f"say why= for {unexplained}"
    source = (REPO / "infra" / "settings.py").read_text()
    comments = Counter(line.strip() for line in source.splitlines() if line.strip().startswith("#"))
    pasted = {line: count for line, count in comments.items() if count > 1 and len(line) > 20}
    assert not pasted, f"comments pasted beside several fields: declare the reason once (why=...): {pasted}"
    functions = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    assert functions <= {"read_config_file", "stage_settings", "load_settings"}, (
        f"{functions}: the run policy lives in infra/run_policy.py, secret checks in infra/secret_checks.py"
    )


def test_the_stages_settings_declare_exist_and_take_their_settings_from_the_declarations() -> None:
    import importlib

    from prefect import Task

    from imagelake.infra.declare import keyed_stages
    from imagelake.infra.settings import Settings, stage_settings
    from imagelake.tasks.stage import StageKey
    from tests.conftest import REPO

    modules = [
        importlib.import_module(f"imagelake.tasks.stages.{path.stem}")
        for path in sorted((REPO / "tasks" / "stages").glob("*.py"))
        if path.stem != "__init__"
    ]
    stages = {
        value.name: value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, Task) and value.fn.__module__ == module.__name__
    }
    declared = {stage for names in keyed_stages(Settings).values() for stage in names}
    assert declared <= set(stages), f"settings declare stages=... that no @stage has: {sorted(declared - set(stages))}"
    assert {"ingest", "resize", "write", "split", "cache", "train", "promote", "score"} <= declared
    for name, task in stages.items():
        if isinstance(task.cache_policy, StageKey):
            expected = stage_settings(name) if name in declared else ()
            assert task.cache_policy.settings_fields == expected, (
                f"{name}: give it @stage(settings=stage_settings({name!r})) and declare its settings' stages=..."
            )


DANGEROUS_FROM_RUNS = [
    ("ray_address", "ray://elsewhere:10001"),  # Ray Client's results are unpickled in the flow
    ("spark_master", "spark://elsewhere:7077"),
    ("mlflow_tracking_uri", "http://elsewhere:5000"),  # the worker's MLflow credentials go to that host
    ("mlflow_registry_uri", "http://elsewhere:5000"),
    ("prefect_api_url", "http://elsewhere:4200/api"),
    ("table_root", "/tmp/elsewhere"),
    ("cache_root", "/tmp/elsewhere"),
    ("staging_root", "/tmp/elsewhere"),
    ("manifest_roots", ["/"]),
    ("model_name", "someone-elses-model"),
    ("retire_deleted", True),
]


@pytest.mark.parametrize(("name", "value"), DANGEROUS_FROM_RUNS, ids=[name for name, _ in DANGEROUS_FROM_RUNS])
def test_where_the_worker_connects_and_keeps_its_data_is_refused_from_runs(monkeypatch, name: str, value) -> None:
    from imagelake.infra.run_policy import refuse_unsafe

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    with pytest.raises(SettingsError, match=rf"^{name} cannot be set from a run: ") as refused:
        refuse_unsafe({name: value, "max_epochs": 2}, "a run")
    message = str(refused.value)
    assert (
        "worker's config file or IMAGELAKE_* environment" in message and f"IMAGELAKE_ALLOW_FROM_RUNS={name} " in message
    ), message


def test_a_name_that_is_no_setting_is_refused_by_name_when_the_settings_load(monkeypatch) -> None:
    from imagelake.infra.run_policy import refuse_unsafe

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    assert refuse_unsafe(
        {"tracking_uri": "http://elsewhere:5000"}, "a run"
    )  # a property, not a setting: no run's setting either
    with pytest.raises(SettingsError, match="tracking_uri: Extra inputs are not permitted"):
        load_settings(overrides={"tracking_uri": "http://elsewhere:5000"})


PATHS_AND_URLS = [
    "https://elsewhere/weights.pth",
    "/tmp/weights.pth",
    "weights.pth",
    "s3://bucket/weights.pth",
    "file:///tmp/w.pth",
    "Imagenet",
]


@pytest.mark.parametrize("given", PATHS_AND_URLS)
@pytest.mark.parametrize("name", ["pretrained", "pretrained_weights"])
def test_a_run_may_name_torchvision_weights_but_no_path_or_url(monkeypatch, name: str, given: str) -> None:
    from imagelake.infra.run_policy import refuse_unsafe

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    expected = (
        rf"^{name}='{given}' \(a run may set none, imagenet or a torchvision weights name, not a path or URL\) "
        r"cannot be set from a run"
    )
    with pytest.raises(SettingsError, match=expected):
        refuse_unsafe({name: given}, "a run")


ORDINARY_FROM_RUNS = {
    "image_size": 96,
    "max_epochs": 3,
    "base_lr": 3e-4,
    "model_arch": "resnet18",
    "augment": "standard",
    "augment_flip": True,
    "start_date": "2024-03-01",
    "end_date": "2024-03-31",
    "val_fraction": 0.2,
    "test_fraction": 0.15,
    "seed": 7,
    "batch_size": 64,
    "num_workers": 1,
    "freeze_backbone": True,
    "label_smoothing": 0.0,
    "warm_start": True,
    "promotion_margin": 0.01,
    "requeue_reasons": ["decode_error"],
    "max_retire_fraction": 0.1,
    "vacuum_retention_hours": 336,
    "workspace_retention_hours": 200,
    "max_file_bytes": 1024,
    "max_image_pixels": 1_000_000,
}


@pytest.mark.parametrize(
    "pretrained", [None, "none", "imagenet", "DEFAULT", "IMAGENET1K_V2", "ResNet18_Weights.IMAGENET1K_V1"]
)
def test_what_a_run_ingests_and_how_it_trains_pass(monkeypatch, pretrained) -> None:
    from imagelake.infra.run_policy import refuse_unsafe

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    given = {**ORDINARY_FROM_RUNS, "pretrained": pretrained}
    assert refuse_unsafe(given, "a run") == given
    settings = load_settings(overrides=given)
    assert settings.pretrained == (
        None if pretrained in (None, "none") else pretrained
    )  # none is no weights, not a file named none


def test_the_weights_a_run_may_name_are_what_the_model_reads_as_names_not_files() -> None:
    from imagelake.infra.run_policy import _is_weights_name
    from imagelake.tasks.worker.model import is_weights_name

    for given in (
        "imagenet",
        "DEFAULT",
        "IMAGENET1K_V2",
        "ResNet18_Weights.IMAGENET1K_V1",
        *PATHS_AND_URLS,
        "/tmp/DEFAULT",
        "s3://b/DEFAULT",
    ):
        assert _is_weights_name(given) == is_weights_name(given), given


def test_what_the_shipped_deployments_and_the_form_send_passes(monkeypatch) -> None:
    import yaml

    from imagelake.flows.pipeline import FORM_SETTINGS, RunParameters
    from imagelake.infra.run_policy import ALLOWED_FROM_RUNS, CODE_ROOT, refuse_unsafe
    from imagelake.infra.settings import Settings

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    for path in [CODE_ROOT / "prefect.yaml", *sorted((CODE_ROOT / "infra" / "clusters").glob("prefect-*.yaml"))]:
        for deployment in yaml.safe_load(path.read_text())["deployments"]:
            refuse_unsafe(deployment.get("parameters", {}).get("overrides"), f"{path.name} {deployment['name']}")
    # The form sends every field, its defaults included (flows/pipeline.py:adhoc); every default passes too.
    form = RunParameters(start_date="2024-03-01", end_date="2024-03-31")
    refuse_unsafe(
        form.model_dump(exclude={"source", "config_file", "refresh"}, exclude_none=True, mode="json"), "the form"
    )
    defaults = {name: field.get_default(call_default_factory=True) for name, field in Settings.model_fields.items()}
    assert set(FORM_SETTINGS) <= ALLOWED_FROM_RUNS
    refuse_unsafe({name: defaults[name] for name in ALLOWED_FROM_RUNS}, "a run")


@pytest.mark.parametrize(
    ("name", "value", "limit"),
    [
        ("vacuum_retention_hours", 0, "at least 168"),  # vacuum runs with Delta's retention check off
        (
            "vacuum_retention_hours",
            "167.5",
            "at least 168",
        ),  # as the API may send it; pydantic would read it as a number
        ("vacuum_retention_hours", float("nan"), "at least 168"),
        ("workspace_retention_hours", 1, "at least 168"),
        ("max_retire_fraction", 1, "at most 0.5"),
        ("max_file_bytes", 10**12, "at most 52428800"),
        ("max_image_pixels", 10**12, "at most 64000000"),
        # Sizes that take a shared node down: its memory, shared memory, GPUs and the cluster's slots.
        ("batch_size", 100_000, "at most 1024"),
        ("shuffle_buffer_batches", 10_000, "at most 64"),
        ("num_workers", 1_000, "at most 64"),
        ("gpus_per_worker", 64, "at most 8"),
        ("loader_workers", 512, "at most 16"),
        (
            "flow_timeout_hours",
            48,
            "at most 24",
        ),  # a run may not hold the one-at-a-time queue longer than the worker allows
        ("flow_timeout_hours", None, "at most 24"),
    ],
)
def test_a_run_may_not_go_past_the_limits_that_keep_data(monkeypatch, name: str, value, limit: str) -> None:
    from imagelake.infra.run_policy import refuse_unsafe

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    expected = (
        rf"^{name}={re.escape(repr(value))} \(a run may set {limit}\) cannot be set from a run: "
        rf".*IMAGELAKE_ALLOW_FROM_RUNS={name} "
    )
    with pytest.raises(SettingsError, match=expected):
        refuse_unsafe({name: value}, "a run")


def test_the_worker_may_open_one_setting_to_runs_and_only_that_one(monkeypatch) -> None:
    from imagelake.infra.run_policy import refuse_unsafe

    monkeypatch.setenv("IMAGELAKE_ALLOW_FROM_RUNS", "ray_address, vacuum_retention_hours,pretrained")
    opened = {"ray_address": "ray://head:10001", "vacuum_retention_hours": 0, "pretrained": "/shared/weights.pth"}
    assert refuse_unsafe(opened, "a run") == opened
    assert refuse_unsafe({"pretrained_weights": "/shared/weights.pth"}, "a run"), (
        "the old name of an opened setting is open too"
    )
    expected = (
        r"^mlflow_tracking_uri, spark_master cannot be set from a run: "
        r".*IMAGELAKE_ALLOW_FROM_RUNS=mlflow_tracking_uri,spark_master "
    )
    with pytest.raises(SettingsError, match=expected):
        refuse_unsafe({**opened, "spark_master": "spark://x:7077", "mlflow_tracking_uri": "http://x:5000"}, "a run")


def test_a_settings_file_a_run_names_outside_the_code_follows_the_same_rule(monkeypatch, tmp_path) -> None:
    from imagelake.infra.run_policy import CODE_ROOT, refuse_unsafe_file

    monkeypatch.delenv("IMAGELAKE_ALLOW_FROM_RUNS", raising=False)
    planted = tmp_path / "mine.yaml"
    planted.write_text("ray_address: ray://elsewhere:10001\nvacuum_retention_hours: 0\nmax_epochs: 2\n")
    expected = (
        r"^ray_address, vacuum_retention_hours=0 \(a run may set at least 168\) cannot be set from the settings "
        rf"file {planted}, named by"
    )
    with pytest.raises(SettingsError, match=expected):
        refuse_unsafe_file(planted, "a run")
    # The deployments' own files set addresses, folders and a state dict's path: they ship with the code.
    refuse_unsafe_file(CODE_ROOT / "infra/clusters/kubernetes.yaml", "a run")


def test_a_run_s_job_variables_may_not_set_its_command_working_folder_or_environment() -> None:
    """Job variables are another door for settings: the worker lays a run's `env` over its own (IMAGELAKE_* would pass
    no run policy, PYTHONPATH would change the code) and takes its `command` and `working_dir`. A run may set only the
    heartbeat, its process's name, labels and output streaming."""
    from imagelake.infra.run_policy import refuse_job_variables
    from imagelake.infra.settings import SettingsError

    refuse_job_variables(None, "a run")
    refuse_job_variables({"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}, "labels": {"a": "b"}}, "a run")
    for variables, named in (
        ({"env": {"IMAGELAKE_ALLOW_PICKLE_MODELS": "true"}}, "env IMAGELAKE_ALLOW_PICKLE_MODELS"),
        ({"env": {"IMAGELAKE_ALLOW_FROM_RUNS": "allow_pickle_models"}}, "env IMAGELAKE_ALLOW_FROM_RUNS"),
        ({"env": {"PYTHONPATH": "/tmp/planted"}}, "env PYTHONPATH"),
        ({"command": "sh -c id"}, "command"),
        ({"working_dir": "/tmp/planted"}, "working_dir"),
    ):
        with pytest.raises(SettingsError, match=f"the job variables of a run set {named}: .* come from the worker"):
            refuse_job_variables(variables, "a run")


def test_a_run_naming_another_mlflow_server_sends_it_no_credentials(monkeypatch, tmp_path: Path) -> None:
    # The worker's MLflow credentials are for the server it was configured with; a run that names another (where the
    # operator opened mlflow_tracking_uri to runs) reaches it without them, and its log says so.
    import http.server
    import threading

    from mlflow import MlflowClient

    from imagelake.flows.flow import run_settings

    heard: list[str | None] = []

    class Listener(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            heard.append(self.headers.get("Authorization"))
            body = b'{"experiments": []}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Listener)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    other = f"http://127.0.0.1:{server.server_port}"
    try:
        monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.mlflow/credentials of the machine's
        monkeypatch.setenv("IMAGELAKE_WORKSPACE", str(tmp_path / "ws"))
        monkeypatch.setenv("IMAGELAKE_MLFLOW_TRACKING_URI", "http://127.0.0.1:1")  # the worker's own server
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "worker")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "secret")
        MlflowClient(other).search_experiments()
        assert heard and heard[-1] and heard[-1].startswith("Basic "), "MLflow sends the environment's credentials"
        settings = run_settings(None, {"mlflow_tracking_uri": other})
        assert settings.tracking_uri == other
        MlflowClient(other).search_experiments()
        assert heard[-1] is None, "the run's requests to another server carry no credentials"
        # Its own server keeps them.
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "secret")
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "worker")
        run_settings(None, None)
        assert os.environ.get("MLFLOW_TRACKING_PASSWORD") == "secret"
    finally:
        server.shutdown()
