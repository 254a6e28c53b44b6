"""prefect.yaml: every deployment's entrypoint loads and its parameters validate against the flow."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from prefect.exceptions import ParameterTypeError
from prefect.flows import load_flow_from_entrypoint

from tests.conftest import REPO


def test_every_deployment_points_at_a_flow_and_its_parameters_validate(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    names = {deployment["name"] for deployment in config["deployments"]}
    assert {"adhoc", "nightly", "backfill"} <= names
    for deployment in config["deployments"]:
        flow = load_flow_from_entrypoint(deployment["entrypoint"])
        flow.validate_parameters(deployment.get("parameters", {}))
    adhoc = next(d for d in config["deployments"] if d["name"] == "adhoc")
    schema = load_flow_from_entrypoint(adhoc["entrypoint"]).parameters.model_dump()
    fields = schema["definitions"]["RunParameters"]["properties"]
    assert fields["image_size"]["default"] == 160 and fields["image_size"]["minimum"] == 8, (
        "the UI form shows defaults and limits"
    )
    with pytest.raises(ParameterTypeError, match="image_size"):
        load_flow_from_entrypoint(adhoc["entrypoint"]).validate_parameters({"params": {"source": "x", "image_size": 0}})
    backfill = next(d for d in config["deployments"] if d["name"] == "backfill")
    assert {"start_date", "end_date", "max_concurrency", "dry_run"} <= set(backfill["parameters"])
    # A bad value is refused before any work starts, naming the parameter.
    with pytest.raises(ParameterTypeError, match="start_date"):
        load_flow_from_entrypoint(backfill["entrypoint"]).validate_parameters(
            {**backfill["parameters"], "start_date": "03/01/2024"}
        )
    nightly = next(d for d in config["deployments"] if d["name"] == "nightly")
    assert nightly["schedules"][0]["cron"] == "0 2 * * *"


def test_the_flow_maintenance_is_maintain_under_its_old_name_with_a_warning(monkeypatch, caplog, tmp_path) -> None:
    import imagelake.flows.maintenance
    from imagelake.flows.maintain import maintain

    monkeypatch.setattr(
        imagelake.flows.maintenance, "maintain_all", lambda settings: {"workspace": str(settings.workspace)}
    )
    with pytest.warns(DeprecationWarning, match="now imagelake-maintain, deployed as maintain"):
        report = imagelake.flows.maintenance.maintenance.fn(overrides={"workspace": str(tmp_path)})
    assert report == {"workspace": str(tmp_path)}
    assert "deprecated" in caplog.text and "imagelake maintain" in caplog.text
    assert (maintain.name, imagelake.flows.maintenance.maintenance.name) == (
        "imagelake-maintain",
        "imagelake-maintenance",
    )
    assert maintain.parameters.model_dump() == imagelake.flows.maintenance.maintenance.parameters.model_dump()


def test_the_ad_hoc_form_declares_each_setting_as_settings_does() -> None:
    # The form's fields are Settings' own: a limit, default or choice changed in Settings changes the form too.
    from imagelake.flows.pipeline import FORM_SETTINGS, RunParameters
    from imagelake.infra.settings import Settings

    form = RunParameters.model_json_schema()["properties"]
    settings = Settings.model_json_schema()["properties"]
    for name in FORM_SETTINGS:
        assert form[name] == settings[name], name
    assert form["image_size"]["maximum"] == Settings.model_fields["image_size"].metadata[-1].le == 2048
    assert list(form)[:2] == ["source", "image_size"] and list(form)[-2:] == ["config_file", "refresh"]


def deployment_files() -> list[Path]:
    """Every YAML file of the repository that declares Prefect deployments (a top-level `deployments` list)."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.yaml", "*.yml"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    found = [REPO / name for name in tracked if "deployments" in (yaml.safe_load((REPO / name).read_text()) or {})]
    assert REPO / "prefect.yaml" in found, found
    return found


DEPLOYMENT_FILES = deployment_files()


def shared_pools(text: str) -> set[int]:
    """The node ids of the `work_pool` mappings of TEXT's deployments: one id when they all alias one anchored
    mapping."""
    document = yaml.compose(text)
    top = {key.value: value for key, value in document.value}
    pools = set()
    for deployment in top["deployments"].value:
        fields = {key.value: value for key, value in deployment.value}
        pools.add(id(fields["work_pool"]))
    return pools


@pytest.mark.parametrize("path", DEPLOYMENT_FILES, ids=lambda p: p.name)
def test_every_deployment_arms_crash_detection_says_where_it_runs_and_never_overlaps_itself(path, monkeypatch) -> None:
    import inspect

    monkeypatch.chdir(REPO)
    text = path.read_text()
    config = yaml.safe_load(text)
    # One environment block, shared by every deployment through a YAML anchor, not repeated by hand.
    assert text.count("PREFECT_FLOWS_HEARTBEAT_FREQUENCY") == 1 and len(shared_pools(text)) == 1, (
        f"{path.name}: work pools written out per deployment"
    )
    # Where a run's code is: a pull step on the project, never the folder of the machine that deployed it.
    steps = [
        step
        for entry in config.get("pull") or []
        for name, step in entry.items()
        if name.endswith("set_working_directory")
    ]
    assert steps and all(step["directory"].startswith(("{{ $", "/opt/")) for step in steps), (
        f"{path.name}: no pull step"
    )
    deployments = {d["name"]: d for d in config["deployments"]}
    for name, deployment in deployments.items():
        env = deployment["work_pool"]["job_variables"]["env"]
        assert int(env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) <= 60, f"{name}: a lost run would stay Running"
        flow = load_flow_from_entrypoint(deployment["entrypoint"])
        given = deployment.get("parameters", {})
        assert set(given) <= set(inspect.signature(flow.fn).parameters), f"{name}: parameters the flow does not take"
        if deployment.get("schedules"):  # a scheduled run has nobody to fill in a parameter
            flow.validate_parameters(given)
            assert (
                deployment["concurrency_limit"]["limit"] == 1
                and deployment["concurrency_limit"]["collision_strategy"] == "ENQUEUE"
            ), f"{name}: a slow run would overlap the next scheduled one"
    maintain = [d for d in deployments.values() if d["entrypoint"] == "flows/maintain.py:maintain"]
    assert maintain and all(d.get("schedules") for d in maintain), f"{path.name}: maintain has no scheduled deployment"
    # The name before the rename stays for whoever starts it, paused: deploying it stops the schedule it had.
    deprecated = [d for d in deployments.values() if d["entrypoint"] == "flows/maintenance.py:maintenance"]
    assert deprecated and all(
        d["paused"] is True and not d.get("schedules") and d["description"].startswith("Deprecated: renamed maintain")
        for d in deprecated
    ), f"{path.name}: the deprecated maintenance deployment is missing, scheduled or not paused"
    assert any(d["entrypoint"] == "flows/pipeline.py:pipeline" and d.get("schedules") for d in deployments.values())
