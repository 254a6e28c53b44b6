"""Threads that see what the thread starting them sees.

A new `threading.Thread` starts with an empty context: none of the starter's context variables, among them Prefect's
settings (the API URL a command chose: infra/prefect_env.py:prefect_for) and its run contexts. A progress line logged
from such a thread went to Prefect's log worker for "no API", and Prefect then started a temporary server of its own on
the same database as the command's. Every thread imagelake starts in a run goes through `context_thread()`, which runs
its target in a copy of the starter's context (tests/test_layers.py holds it).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any


def context_thread(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon thread (not started) that runs TARGET(*ARGS) in a copy of the current context, taken now."""
    context = contextvars.copy_context()
    return threading.Thread(target=context.run, args=(target, *args), name=name, daemon=True)
