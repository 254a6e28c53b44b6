"""A Delta writer in its own process, for the crash and concurrency tests: python tests/writer.py '<json>'."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import imagelake.tasks.stages.write
from imagelake.infra.settings import Settings
from imagelake.infra.spark import on_demand
from imagelake.tasks.data.table import ImageTable
from imagelake.tasks.results import Resized
from imagelake.tasks.stages.write import write_images


def stop_at(phase: str) -> Callable[[str], None]:
    """A phase hook that prints each phase the write reaches and, at PHASE, waits there for the test to kill it."""

    def hook(reached: str) -> None:
        print(f"PHASE {reached}", flush=True)
        if reached == phase:
            threading.Event().wait()

    return hook


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    # Started only if the write asks for it, as the write stage's own process does: a delta-rs write needs no JVM.
    spark = on_demand(Settings(workspace=Path(args["workspace"]), spark_master="local[1]"))
    resized = Resized.model_validate(args["resized"])
    if args.get("stop_at"):
        imagelake.tasks.stages.write.on_phase = stop_at(args["stop_at"])
    print("READY", flush=True)
    while args.get("barrier") and not Path(args["barrier"]).exists():
        time.sleep(0.01)
    print("WRITING", flush=True)
    written = write_images(
        ImageTable.at(spark, args["table"], resized.image_size, args["engine"], args["quarantine"]), resized, 1.0
    )
    print(json.dumps({"version": written.version, "rows": written.rows}), flush=True)
    # The write is done and reported. Leave without the interpreter's teardown: Arrow's thread pool can abort it
    # ("terminate called without an active exception", status -6) while a worker thread is still winding down,
    # which says nothing about the write these tests check.
    sys.stderr.flush()
    os._exit(0)
