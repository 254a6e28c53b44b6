"""Ray start/connect: a local Ray on this machine by default, a cluster when ray_address is set."""

from __future__ import annotations

import logging
import os
import time
import warnings

from imagelake.infra.compat import RAY_NO_PRESTARTED_WORKERS
from imagelake.infra.console import claim_loggers
from imagelake.infra.lifecycle import exit_on_cancel
from imagelake.infra.settings import Settings

# A Ray client (ray://) connection starts a server process for the driver on the head; on a busy head that start can
# fail once and pass on the next try. Other addresses fail the same way every time and are not retried.
CLIENT_ATTEMPTS = 3


def connect_ray(settings: Settings) -> dict[str, float]:
    """Start or join Ray for these settings; return the cluster's resources."""
    import ray  # loaded by the stage that needs it (start-up)

    # A notice about a future default, on every start: nothing a user of these settings can act on.
    warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
    claim_loggers("ray")  # Ray's start-up messages to the command's log file, where it names one
    if not ray.is_initialized():
        if settings.ray_address:
            join_ray(settings.ray_address, settings.ray_log_to_driver)
        else:
            # Logical CPUs: enough for every training worker even on a 2-core machine.
            cpus = max(os.cpu_count() or 1, int(settings.num_workers * settings.cpus_per_worker) + 1)
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=settings.ray_log_to_driver,
                _system_config=RAY_NO_PRESTARTED_WORKERS,
            )
        claim_loggers("ray")  # a handler that ray.init() may have added
        exit_on_cancel()  # ray.init() took SIGTERM over: a cancelled run must not end as Crashed
    return ray.cluster_resources()


def join_ray(address: str, log_to_driver: bool) -> None:
    """Join a running Ray cluster; a Ray client connection whose server failed to start is tried again."""
    import ray  # loaded by the stage that needs it (start-up)

    attempts = CLIENT_ATTEMPTS if address.startswith("ray://") else 1
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, log_to_driver=log_to_driver)
            return
        except ConnectionError as exc:  # ConnectionAbortedError: "Starting Ray client server failed"
            if attempt == attempts:
                raise ConnectionError(
                    f"could not join the Ray cluster at {address} after {attempts} attempts: {exc}"
                ) from exc
            logging.getLogger("imagelake").warning(
                "joining Ray at %s failed (%s); trying again (%d of %d)", address, exc, attempt + 1, attempts
            )
            time.sleep(2.0 * attempt)
