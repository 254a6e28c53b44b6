"""Alias moves of a registered model under its lock, all or nothing, each recorded in the history table: crown a
version, roll back, promote by hand; a move cut short by a crash is finished by the next one."""

from __future__ import annotations

import getpass
import json
import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from imagelake.infra.delta import Table
from imagelake.infra.lease import LeaseLost
from imagelake.infra.prefect_env import fence, one_at_a_time
from imagelake.infra.settings import Settings
from imagelake.infra.spark import on_demand
from imagelake.tasks.registry.aliases import RegistryError, alias_version
from imagelake.tasks.registry.loading import model_files
from imagelake.tasks.rules.promotion import CHALLENGER, CHAMPION, PREVIOUS
from imagelake.tasks.rules.schemas import HISTORY_SCHEMA


@contextmanager
def registry_lock(settings: Settings, name: str) -> Iterator[None]:
    """Serialise alias moves of one model, on this machine and across hosts (infra/prefect_env.py: one_at_a_time):
    a compare-and-set needs the champion not to move under it."""
    with one_at_a_time(settings, lock_of(name)):
        yield


def lock_of(name: str) -> str:
    """What the registry lock of model NAME locks: alias moves and history rows are fenced by it
    (infra/prefect_env.py:fence)."""
    return f"registry-{name}"


def record(settings: Settings, rows: list[dict]) -> None:
    """Append alias moves to the history table (a Delta table beside the images table)."""
    if rows:
        now = datetime.now(UTC)
        full = [{"who": who(settings), "at": now, "flow_run_id": None, "move_id": None, **row} for row in rows]
        table = Table(settings.history_uri)
        if table.exists():
            table.add_columns(HISTORY_SCHEMA)  # a history from before move_id gets it first
        table.append(pa.Table.from_pylist(full, schema=HISTORY_SCHEMA))


def recorded(settings: Settings, move_id: str) -> bool:
    """Whether the history table holds the rows of the alias move MOVE_ID."""
    table = Table(settings.history_uri)
    version = table.version()
    if version is None or "move_id" not in table.columns():
        return False
    rows = table.read_files_arrow(table.files(version), pa.schema([("move_id", pa.string())]))
    if rows is None:
        raise RuntimeError(f"the history table {settings.history_uri} v{version} could not be read here; run again")
    return move_id in set(rows.column("move_id").to_pylist())


def who(settings: Settings) -> str:
    """Who an alias move is recorded as: the `user` setting (IMAGELAKE_USER), else the login name."""
    try:
        return settings.user or getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def history(settings: Settings, name: str) -> list[dict]:
    """Every recorded alias move of a model, oldest first. The table is small and appended to by delta-rs: this
    process's pyarrow reads it, Spark (started then) only where pyarrow cannot open a file of it, so that
    `imagelake history` answers without a JVM."""
    rows = Table(settings.history_uri, on_demand(settings)).read_small(HISTORY_SCHEMA)
    return sorted(rows.filter(pc.equal(rows["model"], name)).to_pylist(), key=lambda row: row["at"])


class MovedMeanwhile(LeaseLost):
    """An alias this move was to set was moved by another run after the move was decided (a holder paused past its
    lease): the move is given up, nothing more changed."""


# A registered model's tag that holds an alias move begun and not yet finished: the next move under the lock finishes
# it.
PENDING_MOVE = "imagelake.pending_move"


def move_aliases(
    client: MlflowClient,
    settings: Settings,
    name: str,
    targets: dict[str, str],
    action: str,
    reasons: dict[str, str],
    flow_run_id: str | None = None,
    drop: str | None = None,
) -> None:
    """Point each alias of TARGETS at its version, drop the alias DROP where it points at a version being moved, and
    record a history row for each alias that moves, all or nothing: the move is written down first (a tag on the
    registered model), then carried out, then crossed off. A crash in between leaves the tag, and the next move
    (or `finish_pending_move`) carries it out before it decides anything. Caller holds the registry lock."""
    move_id = uuid.uuid4().hex
    rows = []
    for alias, version in targets.items():
        before = alias_version(client, name, alias)
        if before != str(version):
            rows.append(
                {
                    "model": name,
                    "alias": alias,
                    "from_version": before,
                    "to_version": str(version),
                    "action": action,
                    "reason": reasons[alias][:1000],
                    "flow_run_id": flow_run_id,
                    "move_id": move_id,
                }
            )
    move = {
        "id": move_id,
        "targets": {alias: str(version) for alias, version in targets.items()},
        # Where each alias pointed when the move was decided: checked again as each alias is set.
        "before": {alias: alias_version(client, name, alias) for alias in targets},
        "drop": drop,
        "rows": rows,
    }
    fence(lock_of(name))  # the lock's lease lapsed: another holder may be deciding; write nothing down
    client.set_registered_model_tag(name, PENDING_MOVE, json.dumps(move))
    carry_out(client, settings, name, move)


def carry_out(client: MlflowClient, settings: Settings, name: str, move: dict) -> None:
    """Carry out a written-down alias move; each step may be done again (the aliases are set, not toggled; the rows are
    appended only if the history lacks them), so a move cut short is finished by doing it again."""
    for alias, version in move["targets"].items():
        fence(lock_of(name))  # before each step: a move cut short here is finished by the next holder
        # At write time, the alias itself: a holder paused past its lease finds another holder's move here.
        now = alias_version(client, name, alias)
        if "before" in move and now not in (move["before"].get(alias), version):
            raise MovedMeanwhile(
                f"{name}@{alias} points at v{now} now, moved by another run after this move (to v{version}, from "
                f"v{move['before'].get(alias)}) was decided: this move is given up and nothing more is changed. "
                "Run again to decide anew."
            )
        client.set_registered_model_alias(name, alias, version)
    if move.get("drop") and alias_version(client, name, move["drop"]) in set(move["targets"].values()):
        fence(lock_of(name))
        client.delete_registered_model_alias(name, move["drop"])
    if move["rows"] and not recorded(settings, move["id"]):
        fence(lock_of(name))
        record(settings, move["rows"])
    client.delete_registered_model_tag(name, PENDING_MOVE)


def finish_pending_move(client: MlflowClient, settings: Settings, name: str) -> bool:
    """Carry out an alias move that a crash cut short, if there is one; whether there was. Caller holds the registry
    lock."""
    try:
        pending = client.get_registered_model(name).tags.get(PENDING_MOVE)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    if pending:
        try:
            carry_out(client, settings, name, json.loads(pending))
        except MovedMeanwhile as stale:  # overtaken by a later move: the written-down one is not carried out
            logging.getLogger(__name__).warning(f"a pending alias move of {name} is dropped: {stale}")
            client.delete_registered_model_tag(name, PENDING_MOVE)
    return bool(pending)


def crown(
    client: MlflowClient,
    settings: Settings,
    name: str,
    version: str,
    action: str,
    reason: str,
    flow_run_id: str | None = None,
) -> None:
    """Make `version` the champion; the one it replaces becomes previous-champion. Caller holds the registry lock."""
    old = alias_version(client, name, CHAMPION)
    targets, reasons = {CHAMPION: str(version)}, {CHAMPION: reason}
    if old is not None and old != str(version):
        targets[PREVIOUS], reasons[PREVIOUS] = old, f"replaced by v{version}"
    move_aliases(client, settings, name, targets, action, reasons, flow_run_id, drop=CHALLENGER)


def rollback(client: MlflowClient, settings: Settings, name: str, reason: str) -> tuple[str, str]:
    """Move `champion` back to `previous-champion`; return (from, to)."""
    with registry_lock(settings, name):
        finish_pending_move(client, settings, name)
        current = alias_version(client, name, CHAMPION)
        previous = alias_version(client, name, PREVIOUS)
        if previous is None:
            raise RegistryError(f"model {name!r} has no {PREVIOUS!r} alias: there is nothing to roll back to")
        targets = {CHAMPION: previous, **({PREVIOUS: current} if current is not None else {})}
        move_aliases(client, settings, name, targets, "rollback", {CHAMPION: reason, PREVIOUS: reason})
    return current or "", previous


def force_promote(client: MlflowClient, settings: Settings, name: str, version: str, reason: str) -> None:
    """An operator's promotion of a chosen version, recorded with its reason."""
    if not reason.strip():
        raise RegistryError("a forced promotion needs a --reason")
    model_files(client, name, version)  # fails clearly for an unknown model or version
    with registry_lock(settings, name):
        finish_pending_move(client, settings, name)
        crown(client, settings, name, str(version), "manual", reason)
