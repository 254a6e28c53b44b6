"""prefect.yaml: every deployment's entrypoint loads and its parameters validate against the flow."""

from __future__ import annotations

import yaml
from prefect.flows import load_flow_from_entrypoint

from tests.conftest import REPO


def test_every_deployment_points_at_a_flow_and_its_parameters_validate(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    config = yaml.safe_load((REPO / "prefect.yaml").read_text())
    names = {deployment["name"] for deployment in config["deployments"]}
    assert {"adhoc", "nightly"} <= names
    for deployment in config["deployments"]:
        flow = load_flow_from_entrypoint(deployment["entrypoint"])
        flow.validate_parameters(deployment.get("parameters", {}))
    nightly = next(d for d in config["deployments"] if d["name"] == "nightly")
    assert nightly["schedules"][0]["cron"] == "0 2 * * *"
