"""One promotion through the gate in its own process (settings from IMAGELAKE_* variables), started when a file appears:
two of these on two workspaces share no file lock, as two hosts would not."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from imagelake.infra.settings import load_settings
from imagelake.infra.tracking import mlflow_client
from imagelake.tasks.registry.gate import Candidate, gate


def main(name: str, version: str, split: str, go: str, out: str) -> None:
    settings = load_settings()
    client = mlflow_client(settings)
    data = np.load(split)
    Path(f"{out}.ready").touch()
    while not Path(go).exists():
        time.sleep(0.01)
    started = time.time()
    decision, _, compared = gate(client, settings, name, Candidate(version, data["images"], data["labels"], 4))
    result = {"promoted": decision.promote, "compared_with": compared, "started": started, "ended": time.time()}
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:6])
