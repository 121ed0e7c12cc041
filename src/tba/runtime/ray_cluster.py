"""Ray for a run: a quiet, loopback-only local instance, or an existing cluster to join.

- **Local** (`ray.address` unset and no `RAY_ADDRESS`): a new instance for this run, always
  (a stale `/tmp/ray/ray_current_cluster` of an earlier cluster is not joined), on the loopback
  interface only, without dashboard or usage reporting, with its workers at normal priority,
  and with the GPUs the run gives it (`gpus`: all but the one the trainer trains on here).
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
import signal
import subprocess
import sys
import threading
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
def ray_session(
    config: RunConfig, log=print, gpus: tuple[int, str] | None = None
) -> Iterator[None]:
    """Ray for the duration of a run: started (or joined) on entry, shut down on exit; inside
    another `ray_session`, that one's. `gpus`: a local instance's GPUs, as (their number,
    `CUDA_VISIBLE_DEVICES` for Ray's processes) (`placement.local_ray_gpus`; None: every GPU
    Ray sees)."""
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
        if gpus is not None:
            options["num_gpus"] = gpus[0]
    else:
        options["address"] = address
        source = "ray.address" if config.ray.address else "RAY_ADDRESS"
        log(f"joining the Ray cluster at {address} ({source})")
    try:
        visible = gpus[1] if address is None and gpus is not None else None
        with _signal_handlers_kept(ray), _raylet_gpus(visible):
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


@contextmanager
def _raylet_gpus(visible: str | None) -> Iterator[None]:
    """`CUDA_VISIBLE_DEVICES=visible` while Ray starts: its raylet, and through it every
    worker, inherits this process's environment, and a worker maps the GPUs Ray assigns it
    (numbered from 0) through that list, so the GPUs left out of it (the trainer's) never reach
    a searcher. Restored at once: this process has already started CUDA (its trainer is
    loaded before the searchers), and if not, it starts it with its own list."""
    if visible is None:
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


@contextmanager
def _signal_handlers_kept(ray) -> Iterator[None]:
    """`ray.init` replaces the main thread's SIGTERM handler with one that exits at once (a
    `SystemExit` wherever the process is; in Ray's own waits, a C stack dump and status 134):
    a process that handles SIGTERM itself (`tba.interrupts.stop_on_interrupt`) keeps its handlers,
    during `ray.init` too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    utils = getattr(ray, "_private", None) and getattr(ray._private, "utils", None)
    setter = getattr(utils, "set_sigterm_handler", None)
    if callable(saved[signal.SIGTERM]) and setter is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if setter is not None:
            utils.set_sigterm_handler = setter
        for number, handler in saved.items():
            if callable(handler):
                signal.signal(number, handler)


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
