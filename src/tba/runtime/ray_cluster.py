"""Ray for a run: a quiet, loopback-only local instance, or an existing cluster to join.

- **Local** (`ray.address` unset and no `RAY_ADDRESS`): a new instance for this run, always
  (a stale `/tmp/ray/ray_current_cluster` of an earlier cluster is not joined), on the loopback
  interface only, without dashboard or usage reporting, with its workers at normal priority.
- **A cluster** (`ray.address`, else the `RAY_ADDRESS` that Ray's own tools read): joined. On a
  loopback address the driver also stays on loopback. A cluster started where an auth token
  exists (`~/.ray/auth_token`, `RAY_AUTH_TOKEN`) checks tokens, and a driver sends its token only
  with `RAY_AUTH_MODE=token`: set here when a token exists and the mode is not chosen (a cluster
  without token checks accepts such a driver as well). A cluster that cannot be joined is one
  line naming the address and what to check.

A local instance is stopped at exit; if this process is killed before it can stop it, a small
watcher (`ray_reaper.py`) stops what is left.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tba.config import RunConfig
from tba.errors import RunError, first_line

TOKEN_FILE = Path("~/.ray/auth_token").expanduser()


def cluster_address(config: RunConfig) -> str | None:
    """The Ray cluster the run joins (None: a local instance of its own)."""
    return config.ray.address or os.environ.get("RAY_ADDRESS") or None


def is_loopback(address: str) -> bool:
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    return host in ("localhost", "::1") or host.startswith("127.")


@contextmanager
def ray_session(config: RunConfig, log=print) -> Iterator[None]:
    """Ray for the duration of a run: started (or joined) on entry, shut down on exit; inside
    another `ray_session`, that one's."""
    address = cluster_address(config)
    # Set before Ray is imported, which reads some of them once.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address is None or is_loopback(address):
        # Ray binds its servers to every interface unless told this is not a cluster.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if address is None:
        # Ray runs its workers at nice 15: whenever anything else wants the cores (the trainer,
        # another job), the searchers get a few percent of a core, stop producing, and the
        # trainer replays ever older samples. Searchers are half of the work: same priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
    elif "RAY_AUTH_MODE" not in os.environ and (TOKEN_FILE.exists() or "RAY_AUTH_TOKEN" in
                                               os.environ):  # fmt: skip
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray  # only a run with searcher processes needs Ray, and only after the lines above

    if ray.is_initialized():  # started for this run's trainer ranks already, or by the caller
        yield
        return

    if address is None or is_loopback(address):
        # Ray reads that variable once, when it is first imported: a script that imported Ray
        # before calling us would otherwise get servers on its external interface.
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    options: dict = {
        "include_dashboard": False,
        "logging_level": logging.ERROR,
        "log_to_driver": True,
        "configure_logging": True,
    }
    if address is None:
        searchers, trainer = config.searchers, config.trainer
        ranks = trainer.world_size if trainer.world_size > 1 else 0
        wanted = math.ceil(searchers.count * searchers.num_cpus + ranks * trainer.num_cpus)
        options["num_cpus"] = config.ray.num_cpus or max(os.cpu_count() or 1, wanted)
        options["address"] = "local"
    else:
        options["address"] = address
        source = "ray.address" if config.ray.address else "RAY_ADDRESS"
        log(f"joining the Ray cluster at {address} ({source})")
    try:
        ray.init(**options)
    except ConnectionError as error:
        reason = first_line(error)
        raise RunError(
            f"cannot join the Ray cluster at {address}: {reason}; is it up (`ray status "
            f"--address {address}`), and if it checks auth tokens, does this machine have its "
            "token (~/.ray/auth_token or RAY_AUTH_TOKEN)?"
        ) from None
    if address is None:
        _reap_when_gone(ray)
    try:
        yield
    finally:
        ray.shutdown()


def _reap_when_gone(ray) -> None:
    """A watcher that stops what is left of the local instance once this process is gone, kill
    -9 included (`ray_reaper.py`; Linux only)."""
    node = ray._private.worker._global_node
    if node is None or not Path("/proc").is_dir():
        return
    subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("ray_reaper.py")), str(os.getpid()),
         node.get_session_dir_path()],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the process group that a Ctrl-C or a kill reaches
    )  # fmt: skip
