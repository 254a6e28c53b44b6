"""Train and promote one cached split in its own process (settings from IMAGELAKE_* variables), started when a file
appears: two of these at once are a nightly run and an ad-hoc run of the same data."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from imagelake.infra.settings import load_settings
from imagelake.tasks.results import CachedSplits
from imagelake.tasks.stages.promote import promote_model
from imagelake.tasks.stages.train import train_model


def main(cached_json: str, go: str, out: str) -> None:
    settings = load_settings()
    cached = CachedSplits.model_validate({**json.loads(Path(cached_json).read_text()), "reused": False})
    Path(f"{out}.ready").touch()
    while not Path(go).exists():
        time.sleep(0.01)
    started = time.time()
    trained = train_model(cached, settings)
    promoted, *_ = promote_model(trained, cached, settings, None)
    Path(out).write_text(
        json.dumps(
            {
                "started": started,
                "ended": time.time(),
                "run": trained.mlflow_run_id,
                "checkpoint": trained.checkpoint_path,
                "epochs": trained.epochs_run,
                "version": promoted.model_version,
                "alias": promoted.alias,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
