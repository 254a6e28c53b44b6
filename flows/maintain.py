"""Table upkeep (`imagelake maintain`, the `maintain` deployment): compaction and vacuum of the images and quarantine
tables, clean-up of the Petastorm cache, the workspace's retention."""

from __future__ import annotations

from typing import Any

from imagelake.flows.flow import imagelake_flow, run_settings
from imagelake.infra.settings import Settings
from imagelake.tasks.stages.maintain import maintain_cache, maintain_images, maintain_quarantine
from imagelake.tasks.stages.retention import retention


@imagelake_flow("imagelake-maintain")
def maintain(config_file: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compact small files and vacuum old ones, keeping the versions registered models were trained on; clean the
    Petastorm cache likewise; apply the workspace's retention to staging, stage results and checkpoints."""
    return maintain_all(run_settings(config_file, overrides))


def maintain_all(settings: Settings) -> dict[str, Any]:
    """Every stage of `maintain`, in order, inside the flow that runs it; what each did."""
    images = maintain_images(settings)
    quarantine = maintain_quarantine(settings)
    cache = maintain_cache(settings)
    return {"images": images, "quarantine": quarantine, "cache": cache, "workspace": retention(settings)}
