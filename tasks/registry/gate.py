"""The quality gate: a candidate version against the champion on the candidate's test rows, decided under the
registry lock (tasks/rules/promotion.py holds the rule), the candidate tagged with the decision, the aliases moved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from imagelake.infra.settings import Settings
from imagelake.tasks.registry.aliases import RegistryError, alias_version
from imagelake.tasks.registry.loading import (
    UnsafeModel,
    evaluate,
    load_model_folder,
    load_registered_model,
    model_files,
    model_labels,
)
from imagelake.tasks.registry.moves import crown, finish_pending_move, move_aliases, registry_lock
from imagelake.tasks.rules.promotion import CHALLENGER, CHAMPION, Decision, decide_promotion, held_by_baseline
from imagelake.tasks.rules.warm_start import Champion, labels_change, shape_from_tags


class ChampionUnreachable(RuntimeError):
    """The champion could not be read for a reason that may pass (a store timing out, a server busy): nothing is decided
    and no alias moves; the promote stage retries."""


def is_gone(exc: BaseException) -> bool:
    """Whether an error says a version or its files do not exist (as opposed to a store that did not answer)."""
    return isinstance(exc, (RegistryError, FileNotFoundError)) or (
        isinstance(exc, MlflowException) and exc.error_code == "RESOURCE_DOES_NOT_EXIST"
    )


class ChampionCheck(NamedTuple):
    """What evaluating the champion found: its value of the gate's metric, or why it is proven unusable (then it may be
    replaced uncompared), or why it could not be compared now (then it stays: the gate fails closed)."""

    value: float | None
    unusable: str | None = None
    uncompared: str | None = None


# The candidate's test rows decoded again from their source files at another (image size, resize mode).
TestRowsAt = Callable[[int, str], np.ndarray]


def out_of_memory(exc: BaseException) -> bool:
    """Whether an error is the host's or an accelerator's memory running out (torch raises RuntimeError subclasses)."""
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


@dataclass(frozen=True)
class Candidate:
    """A version the gate decides on, with what it is judged on: its test rows (IMAGES, uint8 NHWC, and LABELS, of
    CLASSES classes), the label NAMES it was trained for (a champion for other labels is proven unusable), the
    accuracy of the baseline it must beat (BASELINE, None: none), and ROWS_AT, which decodes the same rows again at
    another image size and resize mode (for a champion trained at its own)."""

    version: str
    images: np.ndarray
    labels: np.ndarray
    classes: int
    names: list[str] | None = None
    baseline: float | None = None
    rows_at: TestRowsAt | None = None


def champion_metric(
    client: MlflowClient, settings: Settings, name: str, version: str, candidate: Candidate
) -> ChampionCheck:
    """The value of the gate's metric of the champion (VERSION) on the candidate's test rows, decoded at the champion's
    own image size and resize mode. Proven unusable (may be replaced): its version or files are gone, its files are not
    a model, or it is a model for other labels. Anything else that stops the comparison (running out of memory, rows
    that cannot be decoded at its size, a model that refuses the input) keeps the champion. A store that does not
    answer now raises ChampionUnreachable (the stage retries)."""
    where = f"v{version}"
    try:
        folder = model_files(client, name, version)
        tags = client.get_model_version(name, version).tags
    except Exception as exc:
        if is_gone(exc):
            return ChampionCheck(None, unusable=f"{where}: {type(exc).__name__}: {exc}"[:300])
        raise ChampionUnreachable(
            f"the champion {name} v{version} could not be fetched ({type(exc).__name__}: {str(exc)[:300]}); "
            "nothing was promoted "
            "and no alias moved. The stage retries; if the model store stays unreachable, run again once it answers."
        ) from exc
    try:  # the files are here: a failure to load them is the files', and happens again every time
        model = load_model_folder(folder, name, version, settings.allow_pickle_models)
        theirs = model_labels(folder, tags)
    except Exception as exc:  # noqa: BLE001 - sorted below: only a file that is no model is proven unusable
        if isinstance(exc, UnsafeModel) or out_of_memory(exc):
            return ChampionCheck(
                None, uncompared=f"{where} could not be loaded here: {type(exc).__name__}: {exc}"[:400]
            )
        return ChampionCheck(None, unusable=f"{where}: {type(exc).__name__}: {exc}"[:300])
    names = candidate.names
    if names is not None and theirs and list(theirs) != list(names):
        return ChampionCheck(
            None, unusable=f"{where} is a model for other labels ({labels_change(tuple(theirs), tuple(names))})"
        )
    images, rows_at = candidate.images, candidate.rows_at
    inputs, shape = images, shape_from_tags(tags)
    if (
        shape is not None
        and images.ndim == 4
        and (shape.image_size, shape.resize_mode) != (images.shape[1], settings.resize_mode)
    ):
        own = f"{shape.image_size} px ({shape.resize_mode})"
        if rows_at is None:
            return ChampionCheck(
                None, uncompared=f"{where} takes {own} images and the test rows are not at hand at that size"
            )
        try:
            inputs = rows_at(shape.image_size, shape.resize_mode)
        except Exception as exc:  # noqa: BLE001 - a file gone or changed since: no fair comparison, the champion stays
            return ChampionCheck(
                None,
                uncompared=(
                    f"{where} takes {own} images; the test rows could not be decoded at that size: "
                    f"{type(exc).__name__}: {exc}"
                )[:400],
            )
    try:
        return ChampionCheck(evaluate(model, inputs, candidate.labels, candidate.classes)[settings.promotion_metric])
    except Exception as exc:  # noqa: BLE001 - the champion loaded and is for these labels: whatever failed now is no proof against it
        return ChampionCheck(
            None, uncompared=f"{where} could not be evaluated on the test split: {type(exc).__name__}: {exc}"[:400]
        )


def champion_of(client: MlflowClient, name: str) -> Champion | None:
    """The champion of model NAME with the shape it was trained for, or None if there is none (or no such model yet)."""
    try:
        version = alias_version(client, name, CHAMPION)
    except RegistryError:  # nothing registered under this name yet: no champion either
        return None
    if version is None:
        return None
    return Champion(version, shape_from_tags(client.get_model_version(name, version).tags))


def gate(
    client: MlflowClient, settings: Settings, name: str, candidate: Candidate, flow_run_id: str | None = None
) -> tuple[Decision, dict[str, float], str | None]:
    """Evaluate candidate and champion on the same split, decide, tag the candidate and move aliases, all under the
    lock.

    The champion is read inside the lock, just before the aliases move (compare-and-set): two promotions finishing
    together are decided one after the other, each against the champion the other left, so the worse model can never
    end up champion. The champion is evaluated at its own image size (the candidate's rows_at decodes the test rows
    again at it). Only a champion proven unusable (gone, not a model, or one for other labels than the candidate's
    names) is replaced without a comparison; one that cannot be compared stays champion, the candidate becomes
    challenger; one that cannot be fetched now stops the gate.
    """
    version, baseline = candidate.version, candidate.baseline
    metrics = evaluate(
        load_registered_model(client, name, version, settings.allow_pickle_models),
        candidate.images,
        candidate.labels,
        candidate.classes,
    )
    metric = settings.promotion_metric
    with registry_lock(settings, name):
        finish_pending_move(client, settings, name)
        champion_version = alias_version(client, name, CHAMPION)
        if champion_version == str(version):  # a second flow run that got the same training's result: nothing to decide
            reason = f"v{version} is the champion already (its gate ran in an earlier flow run)"
            return (
                Decision(True, reason, metric, metrics[metric], metrics[metric], settings.promotion_margin),
                metrics,
                champion_version,
            )
        check = ChampionCheck(None)
        if champion_version is not None:
            check = champion_metric(client, settings, name, champion_version, candidate)
        held = held_by_baseline(metric, metrics, baseline, settings.min_margin_over_baseline)
        decision = held or decide_promotion(
            metric, metrics[metric], check.value, settings.promotion_margin, check.unusable, check.uncompared
        )
        champion_value = check.value
        tags = {
            "promotion_decision": "promoted" if decision.promote else "not promoted",
            "promotion_reason": decision.reason,
            "promotion_metric": metric,
            "promotion_margin": str(settings.promotion_margin),
            f"candidate_{metric}": f"{decision.candidate:.6f}",
            f"champion_{metric}": "" if champion_value is None else f"{champion_value:.6f}",
            "compared_with_version": champion_version or "",
            "baseline_accuracy": "" if baseline is None else f"{baseline:.6f}",
            **{f"test_{key}": f"{value:.6f}" for key, value in metrics.items()},
        }
        for key, value in tags.items():
            client.set_model_version_tag(name, str(version), key, value)
        if decision.promote:
            crown(client, settings, name, version, "gate", decision.reason, flow_run_id)
        else:
            move_aliases(
                client, settings, name, {CHALLENGER: str(version)}, "gate", {CHALLENGER: decision.reason}, flow_run_id
            )
    return decision, metrics, champion_version
