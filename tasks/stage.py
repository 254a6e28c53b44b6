"""What every stage's Prefect task shares: retries with backoff, a time limit, and a key that says what its stored
result is made of.

A stage's key is built from named parts: the code it runs (each file of imagelake its module reaches), each upstream
result (which carries the Delta table version it read or wrote), the settings that change the
stage's output (and no others: the Spark log level or the MLflow UI's address never make a stage run again),
and facts read when the key is computed (the source listing, the table's current version). The
parts of the last key computed for each stage are kept beside the stored results, so a run can
say why a stage did not reuse its result. A stage's time limit (`timeout_setting`) is a setting too, but in
no key: it changes no output.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec
from PIL import Image, UnidentifiedImageError
from prefect import Task, get_run_logger
from prefect.cache_policies import CachePolicy
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE
from prefect.tasks import exponential_backoff
from prefect.utilities.hashing import hash_objects

from imagelake.infra.deadline import Overdue, StageTimedOut, deadline, overdue_raised
from imagelake.infra.errors import PermanentError
from imagelake.infra.holders import LockBusy
from imagelake.infra.settings import Settings
from imagelake.tasks.code_graph import code_parts

F = TypeVar("F", bound=Callable[..., Any])

# Per flow run and stage: why its stored result may be reused, its final state ("Cached": reused) and its wall time.
_reasons: dict[str, dict[str, str]] = {}
_outcomes: dict[str, dict[str, str]] = {}
_seconds: dict[str, dict[str, float]] = {}
_lock = threading.Lock()


def key_parts(fn: Callable[..., Any], inputs: dict[str, Any], settings_fields: tuple[str, ...]) -> dict[str, str]:
    """The named parts of a stage's key (values are short digests or the settings' own values): one part for each file
    of imagelake the stage's module reaches through its imports (tasks/code_graph.py), so that a change to any of them
    is a miss that names the file."""
    parts = {f"code {path}": digest for path, digest in code_parts(fn.__module__).items()}
    settings = inputs.get("settings")
    for name, value in inputs.items():
        if name != "settings":
            parts[f"input {name}"] = hash_objects(value, raise_on_failure=True)
    for name in settings_fields:
        value = json.dumps(getattr(settings, name), default=str)
        # Store and database URIs may hold credentials: the key records, and the report shows, only a digest.
        parts[f"setting {name}"] = f"digest {hash_objects(value)[:12]}" if name.endswith("uri") else value
    return parts


def explain(previous: dict[str, Any] | None, key: str, parts: dict[str, str], refresh: bool) -> str:
    """Why a stage with these key parts will reuse its stored result or compute it, compared with the last key computed
    for it."""
    if refresh:
        return "refresh requested: recomputed whatever results are stored"
    if previous is None:
        return "no earlier run of this stage in these results"
    if previous["key"] == key:
        return "same code, inputs and settings as the last run"
    old = previous["parts"]
    differ = [name for name in sorted(set(parts) | set(old)) if parts.get(name) != old.get(name)]
    code = [name.removeprefix("code ") for name in differ if name.startswith("code ")]
    changed = [code_change(code, legacy="code" in differ)] if code or "code" in differ else []
    for name in differ:
        if name == "code" or name.startswith("code "):
            continue
        detail = (
            f" {old.get(name)} -> {parts.get(name)}"
            if name.startswith(("setting", "table", "warm start", "stored result"))
            else ""
        )
        changed.append(f"{name} changed{detail}")
    return "; ".join(changed)


def code_change(files: list[str], legacy: bool = False, shown: int = 3) -> str:
    """The files whose code changed, the first few by name: `code tasks/worker/train_loop.py changed`."""
    if legacy:  # the last key was made by an imagelake that keyed a stage's code as one digest
        return "code changed (the last key was made by an earlier imagelake)"
    if len(files) <= shown:
        return f"code {', '.join(files)} changed"
    return f"code of {len(files)} files changed ({', '.join(files[:shown])}, ...)"


MAX_LINKS = 50  # results passed over before a stage stops looking for a usable one and computes anew


@dataclass
class StageKey(CachePolicy):
    """The key of one stage's stored result: code + upstream results + the settings that change its output + facts
    read now."""

    stage: str = ""
    settings_fields: tuple[str, ...] = ()
    facts: Callable[[dict[str, Any]], dict[str, str]] | None = field(default=None, repr=False)
    needs: Callable[[Any], list[str]] | None = field(default=None, repr=False)  # files a result of the stage names
    unfinished: Callable[[Any], str | None] | None = field(
        default=None, repr=False
    )  # why a result of the stage is not to be reused

    def compute_key(
        self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        if not task_ctx:
            return None
        parts = key_parts(task_ctx.task.fn, inputs, self.settings_fields)
        if self.facts is not None:
            parts.update(self.facts(inputs))
        key = f"{self.stage}-{hash_objects(parts, raise_on_failure=True)}"
        store = getattr(task_ctx, "result_store", None)
        why, links = not_reusable(store, key, self.needs, self.unfinished), 0
        while why is not None:
            # A stored result whose files are gone, or that left work for the next run, is no result: the next key of
            # a chain is computed anew, and the report says why. A run that finds the same trouble again adds a link;
            # the first usable result along the chain is reused.
            parts["stored result"], links = why, links + 1
            hashed = [parts, links] if links < MAX_LINKS else [parts, uuid.uuid4().hex]
            key = f"{self.stage}-{hash_objects(hashed, raise_on_failure=True)}"
            why = not_reusable(store, key, self.needs, self.unfinished) if links < MAX_LINKS else None
        settings = inputs.get("settings")
        if settings is not None:
            note_key(
                settings.results_uri,
                self.stage,
                key,
                parts,
                str(task_ctx.task_run.flow_run_id),
                bool(PREFECT_TASKS_REFRESH_CACHE.value()),
            )
        return key


def not_reusable(
    store: Any,
    key: str,
    needs: Callable[[Any], list[str]] | None,
    unfinished: Callable[[Any], str | None] | None = None,
) -> str | None:
    """Why the result stored under KEY may not be reused, or None (no such result, or nothing against it): the first
    file or folder it names (NEEDS says which) that is gone (a cleaned disk, a moved workspace, a vacuum), or what
    UNFINISHED says the run that made it left for the next one."""
    if (needs is None and unfinished is None) or store is None or not store.exists(key):
        return None
    try:
        result = store.read(key).result
    except Exception:  # noqa: BLE001 - a record that cannot be read: Prefect's own lookup decides what it is
        return None
    for uri in needs(result) if needs is not None else []:
        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.exists(path):
            return f"needs {uri}, which is gone"
    return unfinished(result) if unfinished is not None else None


def note_key(results_uri: str, stage: str, key: str, parts: dict[str, str], flow_run_id: str, refresh: bool) -> None:
    """Record why this key's result may be reused or not, and keep its parts as the stage's latest for the next run to
    compare with."""
    with _lock:
        if stage in _reasons.get(flow_run_id, {}):
            return  # a retry: the first attempt's reason stands, and the record is already this key's
        try:
            record_key(results_uri, stage, key, parts, flow_run_id, refresh)
        except Exception as exc:  # the report is best effort: it must never cost the stage its result
            _reasons.setdefault(flow_run_id, {})[stage] = f"(why unknown: {type(exc).__name__}: {exc})"


def record_key(results_uri: str, stage: str, key: str, parts: dict[str, str], flow_run_id: str, refresh: bool) -> None:
    """Explain this key against the stage's last recorded one, then make it the last."""
    fs, folder = fsspec.core.url_to_fs(f"{results_uri}/cache-keys")
    path = f"{folder}/{stage}.json"
    previous = json.loads(fs.cat_file(path)) if fs.exists(path) else None
    _reasons.setdefault(flow_run_id, {})[stage] = explain(previous, key, parts, refresh)
    fs.makedirs(folder, exist_ok=True)
    # Written aside and moved into place, so a run in another process never reads half a record.
    aside = f"{path}.{uuid.uuid4().hex}"
    fs.pipe_file(aside, json.dumps({"key": key, "parts": parts}, indent=1).encode())
    fs.mv(aside, path)


def note_outcome(flow_run_id: str, stage: str, state_name: str, seconds: float) -> None:
    """Remember how a stage ended in its flow run and how long it took (the API hears of it later, through events)."""
    with _lock:
        _outcomes.setdefault(flow_run_id, {})[stage] = state_name
        _seconds.setdefault(flow_run_id, {})[stage] = round(seconds, 3)


def stage_outcomes(flow_run_id: str) -> tuple[dict[str, str], dict[str, str]]:
    """Each stage's final state name in this flow run, and why its key did or did not match the last run's."""
    with _lock:
        return dict(_outcomes.get(flow_run_id, {})), dict(_reasons.get(flow_run_id, {}))


def stage_seconds(flow_run_id: str) -> dict[str, float]:
    """Each stage's wall time in this flow run, reused results included (the key's facts are read even then)."""
    with _lock:
        return dict(_seconds.get(flow_run_id, {}))


def timeout_setting(stage: str) -> str:
    """The setting that limits STAGE: `<stage>_timeout_minutes` where Settings has one, else stage_timeout_minutes."""
    own = f"{stage.replace('-', '_')}_timeout_minutes"
    return own if own in Settings.model_fields else "stage_timeout_minutes"


def interruptible(fn: F) -> F:
    """FN as a stage's Prefect task runs it: past the stage's or its flow's deadline, what the interrupt leaves comes
    out as that deadline's error (infra/deadline.py), which Prefect records as TimedOut rather than as a crash or a
    result."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with overdue_raised():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


class Stage(Task):
    """A Prefect task that says when it starts and ends, with its duration, in the CLI and in the flow run's logs, and
    that stops, failing TimedOut, once it runs past its time limit (`timeout_setting`)."""

    def __call__(self, *args: Any, return_state: bool = False, **kwargs: Any) -> Any:
        # The limit covers the whole call: the key's facts (a listing of the source) may hang on a mount too.
        with deadline(*self.time_limit(args, kwargs)):
            return self.reported(*args, return_state=return_state, **kwargs)

    def time_limit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float | None, StageTimedOut | None]:
        """This call's limit in seconds, and the error past it, from the settings it is given (none without
        settings)."""
        try:
            settings = inspect.signature(self.fn).bind_partial(*args, **kwargs).arguments.get("settings")
        except TypeError:  # a call that does not fit the stage: Prefect says so
            return None, None
        name = timeout_setting(self.name)
        minutes = getattr(settings, name) if isinstance(settings, Settings) else None
        if minutes is None:
            return None, None
        return minutes * 60, StageTimedOut(
            f"stage {self.name} ran past {name}={minutes:g} (minutes) and was stopped; its run fails and releases its "
            "Spark and Ray. If it was working rather than stuck (on a hung mount, a Spark or Ray job that no longer "
            f"moves), raise {name}"
        )

    def reported(self, *args: Any, return_state: bool = False, **kwargs: Any) -> Any:
        """Run the task, saying when it starts and how it ended."""
        context = FlowRunContext.get()
        if context is None:  # called outside a flow (a test): no run to report to
            return super().__call__(*args, return_state=return_state, **kwargs)
        logger = get_run_logger()
        logger.info(f"{self.name}: started")
        start = time.perf_counter()
        state = super().__call__(*args, return_state=True, **kwargs)
        seconds = time.perf_counter() - start
        note_outcome(str(context.flow_run.id), self.name, state.name, seconds)
        ended = {"Cached": "result reused", "Completed": "done", "TimedOut": "timed out"}.get(
            state.name, state.name.lower()
        )
        logger.info(f"{self.name}: {ended} in {seconds:.1f} s")
        return state if return_state else state.result()


# Bad input, bad settings and programming errors fail the same way every time: retrying only delays the message.
# Pillow's errors about an image's bytes are an OSError and a bare Exception, but the same bytes fail the same way.
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    PermanentError,
    ValueError,
    TypeError,
    KeyError,
    FileNotFoundError,
    UnidentifiedImageError,
    Image.DecompressionBombError,
)
# Arrow's own S3 client reports a key that is not there as a plain OSError, where a local file or s3fs raise
# FileNotFoundError.
NOT_FOUND_ON_S3 = ("AWS Error NO_SUCH_KEY", "AWS Error RESOURCE_NOT_FOUND")


def permanent_itself(error: BaseException) -> bool:
    """Whether ERROR, not counting what it wraps, is one no retry can mend."""
    return isinstance(error, PERMANENT_ERRORS) or (
        isinstance(error, OSError) and any(mark in str(error) for mark in NOT_FOUND_ON_S3)
    )


def is_permanent(error: BaseException | None) -> bool:
    """Whether an error, or one it wraps (a cause, a Ray Train worker's failure), is one no retry can mend."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if permanent_itself(current):
            return True
        pending += [current.__cause__, current.__context__, *getattr(current, "worker_failures", {}).values()]
    return False


def retry_transient_only(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: retry unless the stage failed with a permanent error, or ran past a time limit."""
    try:
        state.result()
    except (Overdue, LockBusy):  # the retry would block as long again, and every run queued behind this one with it
        return False
    except Exception as exc:  # I/O, a lost worker, a busy server may pass on the next attempt; bad input never will
        return not is_permanent(exc)
    return True


def stage(
    name: str,
    *,
    settings: tuple[str, ...] = (),
    facts: Callable[[dict[str, Any]], dict[str, str]] | None = None,
    needs: Callable[[Any], list[str]] | None = None,
    unfinished: Callable[[Any], str | None] | None = None,
    retries: int = 2,
    backoff: float = 2.0,
    cache_policy: CachePolicy | None = None,
) -> Callable[[F], F]:
    """Declare a pipeline stage: a Prefect task that retries with jittered exponential backoff, stores its result
    (reused while its key holds), and fails TimedOut past the time limit its settings give it (`timeout_setting`: never
    retried).

    `settings` names the settings fields that change the stage's output; `facts` adds key parts read at call time; the
    code in the key is read from the imports of the module that defines the stage (tasks/code_graph.py); `needs`
    gives the files and folders a result of the stage names, so that a stored result whose files are gone is computed
    anew; `unfinished` says why a result is not to be reused (work it left for the next run), or None.
    """

    def declare(fn: F) -> F:
        return Stage(  # type: ignore[return-value]
            fn=interruptible(fn),
            name=name,
            retries=retries,
            retry_delay_seconds=exponential_backoff(backoff_factor=backoff),
            retry_jitter_factor=0.5,
            retry_condition_fn=retry_transient_only,
            cache_policy=cache_policy
            or StageKey(stage=name, settings_fields=settings, facts=facts, needs=needs, unfinished=unfinished),
            persist_result=True,
            log_prints=True,
        )

    return declare
