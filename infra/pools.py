"""imagelake's work pool job templates (infra/clusters/*-pool.json), and the Kubernetes one rendered for a cluster.

A run's job variables are validated by the Prefect API against the pool's `variables` schema, and the worker lays them
over the deployment's. What a run must not choose (the command, the image, the namespace, the service account, the
environment) is therefore written into `job_configuration` as a literal, never a variable: `python -m
imagelake.infra.pools kubernetes --image ... --namespace ... --service-account ...` writes the template with a
cluster's own values, and `make kubernetes-pool` installs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CLUSTERS = Path(__file__).resolve().parent / "clusters"
PROCESS_POOL = CLUSTERS / "process-pool.json"
KUBERNETES_POOL = CLUSTERS / "kubernetes-pool.json"


def kubernetes_template(image: str, namespace: str, service_account: str) -> dict:
    """The Kubernetes pool's template with this cluster's image, namespace and service account (none of them a
    variable a run could set)."""
    for name, value in (("image", image), ("namespace", namespace), ("service account", service_account)):
        if not value or "{{" in value:
            raise ValueError(f"the Kubernetes pool needs a plain {name}, not {value!r}")
    template = json.loads(KUBERNETES_POOL.read_text())
    job = template["job_configuration"]
    job["namespace"] = job["job_manifest"]["metadata"]["namespace"] = namespace
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    pod["serviceAccountName"] = service_account
    (container,) = pod["containers"]
    container["image"] = image
    return template


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m imagelake.infra.pools", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    kubernetes = commands.add_parser("kubernetes", help="print the Kubernetes pool's template for a cluster")
    kubernetes.add_argument("--image", required=True, help="the image the flow-run jobs run (imagelake installed)")
    kubernetes.add_argument("--namespace", required=True)
    kubernetes.add_argument("--service-account", required=True, help="the jobs' service account")
    args = parser.parse_args(argv)
    try:
        template = kubernetes_template(args.image, args.namespace, args.service_account)
    except ValueError as exc:
        parser.error(str(exc))
    json.dump(template, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
