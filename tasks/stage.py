"""What every stage's Prefect task shares: retries with backoff and a cache policy of inputs + code."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy
from prefect.tasks import exponential_backoff
from prefect.utilities.hashing import hash_objects

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class StageModuleSource(CachePolicy):
    """Hash the source of the module a task lives in, so a change to the plain stage function is a cache miss.

    TASK_SOURCE alone sees only the thin wrapper, not the function that does the work.
    """

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any):
        if not task_ctx:
            return None
        module = sys.modules.get(task_ctx.task.fn.__module__)
        return hash_objects(inspect.getsource(module), raise_on_failure=True) if module else None


STAGE_CACHE = INPUTS + TASK_SOURCE + StageModuleSource()

# Bad input, bad settings and programming errors fail the same way every time: retrying only delays the message.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, FileNotFoundError)


def retry_transient_only(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: retry unless the stage failed with a permanent error."""
    try:
        state.result()
    except PERMANENT_ERRORS:
        return False
    except Exception:  # anything else (I/O, a lost worker, a busy server) may pass on the next attempt
        return True
    return True


def stage(name: str, *, retries: int = 2, backoff: float = 2.0, cache_policy: CachePolicy = STAGE_CACHE) -> Callable[[F], F]:
    """Declare a pipeline stage: a Prefect task that retries with jittered exponential backoff and caches its result."""
    return task(
        name=name,
        retries=retries,
        retry_delay_seconds=exponential_backoff(backoff_factor=backoff),
        retry_jitter_factor=0.5,
        retry_condition_fn=retry_transient_only,
        cache_policy=cache_policy,
        persist_result=True,
        log_prints=True,
    )
