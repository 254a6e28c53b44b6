"""How a search stops its trials: at the end of an epoch, never by killing them.

Ray Tune stops a trial by ending its process. A trial's Ray Train run then loses its controller, and the CPUs (or GPUs)
its workers held stay reserved for as long as the search's Ray lives: Ray Train frees them through the cluster's state
API, which needs Ray's dashboard, which imagelake's local Ray does not start (and which finds no cluster where several
Ray instances share a machine). Every later trial would then wait for resources that never come back. So where ASHA or
the time budget would stop a trial, the trial is asked instead, through the stop marker its workers look for at the end
of every epoch (train_loop.py:StopWhenAsked); its run then ends as a finished run ends, freeing what it held.
Past the time budget, no new trial starts.
"""

from __future__ import annotations

import time
from typing import Any

from ray.tune.schedulers import ASHAScheduler, TrialScheduler
from ray.tune.search import BasicVariantGenerator

from imagelake.tasks.worker.train_loop import ask_to_stop
from imagelake.tasks.worker.trial import stop_marker

ASHA_STOP = "stopped early by ASHA"
BUDGET_STOP = "stopped by the time budget"


class EpochEndASHA(ASHAScheduler):
    """ASHA on validation accuracy whose decision to stop a trial is a request to the trial (see above); so is the end
    of the time budget (DEADLINE, in seconds since the epoch) for every trial that reports after it."""

    def __init__(self, ray_storage_path: str, search_name: str, deadline: float | None, **asha: Any) -> None:
        super().__init__(stop_last_trials=False, **asha)
        self.ray_storage_path, self.search_name, self.deadline = ray_storage_path, search_name, deadline
        self.asked: set[str] = set()

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        decision = super().on_trial_result(tune_controller, trial, result)
        late = self.deadline is not None and time.time() >= self.deadline
        if (decision == TrialScheduler.STOP or late) and trial.trial_id not in self.asked:
            self.asked.add(trial.trial_id)
            marker = stop_marker(self.ray_storage_path, self.search_name, trial.trial_id)
            ask_to_stop(marker, BUDGET_STOP if late and decision != TrialScheduler.STOP else ASHA_STOP)
        return TrialScheduler.CONTINUE if decision == TrialScheduler.STOP else decision


class BudgetedVariants(BasicVariantGenerator):
    """Tune's random sampler, which starts no trial after DEADLINE (seconds since the epoch; None: no deadline)."""

    def __init__(self, deadline: float | None, **sampler: Any) -> None:
        super().__init__(**sampler)
        self.deadline = deadline

    def next_trial(self) -> Any:
        if self.deadline is not None and time.time() >= self.deadline:
            self.set_finished()
            return None
        return super().next_trial()
