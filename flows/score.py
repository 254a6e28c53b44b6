"""Batch scoring: a registered model's answers for a folder, an object-store prefix or a Delta table version, kept in
the Delta table `predictions` (what `imagelake score` and the nightly scoring deployment run)."""

from __future__ import annotations

from typing import Any

from imagelake.flows.flow import imagelake_flow, run_settings
from imagelake.infra.prefect_env import stage_results
from imagelake.tasks.stages.score import score, score_model

RENAMED = {"cached": "result_reused"}  # keys of the result renamed, old -> new


@imagelake_flow("imagelake-score")
def score_flow(
    model: str, source: str, config_file: str | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Answer every image of SOURCE that the model version MODEL (NAME@ALIAS or NAME/VERSION) names has not answered
    yet."""
    settings = run_settings(config_file, overrides)
    with stage_results(settings):
        version = score_model(model, settings)
        scored = score(source, version, settings, return_state=True)
        # Reused: this run answered nothing, the last one did, for the same source and version.
        reused = scored.name == "Cached"
        answers = {"answered": 0, "errors": 0, "predictions_version": None} if reused else {}
        # `cached` is the deprecated name of `result_reused`, still written until a later release.
        return {**scored.result(), **answers, "result_reused": reused, "cached": reused, "deprecated_keys": RENAMED}
