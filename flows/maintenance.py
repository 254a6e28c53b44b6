"""Table upkeep: compaction and vacuum of the images and quarantine tables."""

from __future__ import annotations

from typing import Any

from flows.flow import imagelake_flow, run_settings
from tasks.maintain import maintain_cache, maintain_images, maintain_quarantine
from tasks.retention import retention


@imagelake_flow("imagelake-maintenance")
def maintenance(config_file: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compact small files and vacuum old ones, keeping the versions registered models were trained on; clean the cache
    likewise; apply the workspace's retention to staging, stage results and checkpoints."""
    settings = run_settings(config_file, overrides)
    images = maintain_images(settings)
    quarantine = maintain_quarantine(settings)
    cache = maintain_cache(settings)
    return {"images": images, "quarantine": quarantine, "cache": cache, "workspace": retention(settings)}
