"""Faults the tests inject into training from their own side: Lightning callbacks that the workers add through
`imagelake.tasks.worker.trainer.WORKER_CALLBACKS` (the documented hook for extra callbacks, empty in a run).

Ray's workers do not import the tests: `inject` registers this module to be pickled by value, so the callback travels
to them inside the workers' config."""

from __future__ import annotations

import os
import sys

import pytest
from pytorch_lightning import Callback


class KillWorkerOnce(Callback):
    """The worker of RANK exits at the start of EPOCH, once: MARKER records it, so the restarted worker trains on."""

    def __init__(self, rank: int, epoch: int, marker: str) -> None:
        self.rank, self.epoch, self.marker = rank, epoch, marker

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank and trainer.current_epoch == self.epoch and not os.path.exists(self.marker):
            with open(self.marker, "w") as out:
                out.write(f"killed at epoch {self.epoch}\n")
            os._exit(1)


def inject(monkeypatch: pytest.MonkeyPatch, *callbacks: Callback) -> None:
    """Every training started in this test (a stage's, a search's trials) adds CALLBACKS on each of its workers."""
    import ray.cloudpickle

    from imagelake.tasks.worker import trainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    monkeypatch.setattr(trainer, "WORKER_CALLBACKS", [*trainer.WORKER_CALLBACKS, *callbacks])
