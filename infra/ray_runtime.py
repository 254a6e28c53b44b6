"""Ray start/connect: a local Ray on this machine by default, a cluster when ray_address is set."""

from __future__ import annotations

import os
import warnings

import ray

from infra.lifecycle import exit_on_cancel
from infra.settings import Settings


def connect_ray(settings: Settings) -> dict[str, float]:
    """Start or join Ray for these settings; return the cluster's resources."""
    # A notice about a future default, on every start: nothing a user of these settings can act on.
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
    if not ray.is_initialized():
        if settings.ray_address:
            ray.init(address=settings.ray_address, log_to_driver=settings.ray_log_to_driver)
        else:
            # Logical CPUs: enough for every training worker even on a 2-core machine.
            cpus = max(os.cpu_count() or 1, int(settings.num_workers * settings.cpus_per_worker) + 1)
            ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=settings.ray_log_to_driver)
        exit_on_cancel()  # ray.init() took SIGTERM over: a cancelled run must not end as Crashed
    return ray.cluster_resources()
