"""Starting a quiet, loopback-only local Ray instance, or joining an existing cluster."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

from tba.config import RunConfig


@contextmanager
def ray_session(config: RunConfig) -> Iterator[None]:
    """Ray for the duration of a run: started (or joined) on entry, shut down on exit."""
    # Set before Ray is imported: no usage reporting, and on a single machine Ray picks the
    # loopback address, so none of its servers listens on an external interface.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if config.ray.address is None:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        # Ray runs its workers at nice 15: whenever anything else wants the cores (the trainer,
        # another job), the searchers get a few percent of a core, stop producing, and the
        # trainer replays ever older samples. Searchers are half of the work: same priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
    import ray

    if config.ray.address is None:
        # Ray reads that variable once, when it is first imported: a script that imported Ray
        # before calling us would otherwise get servers on its external interface.
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    searchers = config.searchers
    options: dict = {
        "include_dashboard": False,
        "logging_level": logging.ERROR,
        "log_to_driver": True,
        "configure_logging": True,
    }
    if config.ray.address is None:
        wanted = math.ceil(searchers.count * searchers.num_cpus)
        options["num_cpus"] = config.ray.num_cpus or max(os.cpu_count() or 1, wanted)
    else:
        options["address"] = config.ray.address
    ray.init(**options)
    try:
        yield
    finally:
        ray.shutdown()
