"""The promotion rule: whether a candidate replaces the champion, and the decision as markdown. Pure: stdlib only."""

from __future__ import annotations

import math
from dataclasses import dataclass

CHAMPION, CHALLENGER, PREVIOUS = "champion", "challenger", "previous-champion"

# What every run fits beside its model, on the same split (registry/baseline.py): the floor its margin is measured from.
BASELINE = "logistic regression on 32 px thumbnails"

# Each gate metric, and whether a higher value is better.
METRICS: dict[str, bool] = {"accuracy": True, "macro_f1": True, "loss": False}


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    metric: str
    candidate: float
    champion: float | None
    margin: float


def decide_promotion(
    metric: str,
    candidate: float,
    champion: float | None,
    margin: float = 0.0,
    champion_unusable: str | None = None,
    champion_uncompared: str | None = None,
) -> Decision:
    """Promote when there is no usable champion, or when the candidate beats it by more than `margin` on `metric`.

    Ties never promote. A champion proven unusable (`champion_unusable`: gone, not a model, a model
    for other labels) is replaced, and the reason says why. A champion that could not be compared for
    any other reason (`champion_uncompared`) stays: the gate fails closed and the candidate is challenger.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown promotion metric {metric!r}: choose one of {', '.join(METRICS)}")
    for name, value in (("candidate", candidate), ("champion", champion), ("margin", margin)):
        if value is not None and (math.isnan(value) or value < 0 or (metric != "loss" and value > 1)):
            raise ValueError(f"{name} {metric} must be a number in [0, 1] (loss: >= 0), got {value!r}")
    if champion_unusable:
        return Decision(
            True,
            f"the champion could not be evaluated ({champion_unusable}); candidate {metric} {candidate:.4f}",
            metric,
            candidate,
            None,
            margin,
        )
    if champion_uncompared:
        return Decision(
            False,
            f"the champion was not compared ({champion_uncompared}): it stays champion and the candidate "
            f"({metric} {candidate:.4f}) is "
            "kept as challenger. Compare them by hand and use `imagelake promote` to crown it anyway",
            metric,
            candidate,
            None,
            margin,
        )
    if champion is None:
        return Decision(True, f"no champion yet; candidate {metric} {candidate:.4f}", metric, candidate, None, margin)
    higher = METRICS[metric]
    better = candidate > champion + margin if higher else candidate < champion - margin
    verb = "beats" if better else "does not beat"
    direction = "higher" if higher else "lower"
    return Decision(
        better,
        f"candidate {metric} {candidate:.4f} {verb} champion {champion:.4f} by more than {margin:.4f} "
        f"({direction} is better)",
        metric,
        candidate,
        champion,
        margin,
    )


def held_by_baseline(
    metric: str, candidate: dict[str, float], baseline: float | None, min_margin: float | None
) -> Decision | None:
    """The gate's decision for a candidate whose test accuracy is not `min_margin` above its run's plain baseline
    (it stays challenger, whatever the champion), or None when it is, or when no baseline or margin is set."""
    if baseline is None or min_margin is None:
        return None
    accuracy = candidate["accuracy"]
    if accuracy - baseline >= min_margin:
        return None
    return Decision(
        False,
        f"candidate accuracy {accuracy:.4f} is {accuracy - baseline:+.4f} over its baseline's {baseline:.4f} "
        f"({BASELINE}, "
        f"same split), less than min_margin_over_baseline {min_margin:.4f}: kept as challenger",
        metric,
        candidate[metric],
        None,
        min_margin,
    )


def decision_markdown(name: str, version: str, decision: Decision, champion_version: str | None, run_link: str) -> str:
    champion = "none" if decision.champion is None else f"{decision.champion:.4f}"
    return (
        f"## Promotion of {name} v{version}\n\n"
        f"| item | value |\n|---|---|\n"
        f"| outcome | {'champion' if decision.promote else 'challenger'} |\n"
        f"| metric | {decision.metric} |\n| candidate | {decision.candidate:.4f} |\n"
        f"| champion (v{champion_version or '-'}) | {champion} |\n| margin | {decision.margin} |\n"
        f"| reason | {decision.reason} |\n\n[MLflow run]({run_link})\n"
    )
