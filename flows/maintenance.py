"""Deprecated: the flow `imagelake-maintenance` is now `imagelake-maintain` (flows/maintain.py), one word with the
command `imagelake maintain`. This module keeps the deployments made before the rename (`maintenance`,
`maintenance-k8s`) working, with a warning in each run's log; it goes in a later release."""

from __future__ import annotations

import warnings
from typing import Any

from imagelake.flows.flow import imagelake_flow, run_settings
from imagelake.flows.maintain import maintain_all
from imagelake.tasks.progress import stage_logger

DEPRECATED = (
    "the flow imagelake-maintenance and its deployments maintenance and maintenance-k8s are deprecated, and go in a "
    "later release: the same flow is now imagelake-maintain, deployed as maintain and maintain-k8s (run "
    "`prefect deploy --all` or `make worker` to deploy it); start that one, or `imagelake maintain`, instead"
)


@imagelake_flow("imagelake-maintenance")
def maintenance(config_file: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Deprecated name of flows/maintain.py:maintain: the same work, with a warning."""
    warnings.warn(DEPRECATED, DeprecationWarning, stacklevel=2)
    stage_logger().warning(DEPRECATED)
    return maintain_all(run_settings(config_file, overrides))
