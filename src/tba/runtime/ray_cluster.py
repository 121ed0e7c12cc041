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
  line naming the address and what to check: an address not in a form Ray joins, before
  anything of the run is made (`check_cluster`); one where nothing answers, within seconds (Ray
  itself would retry for minutes).

A local instance is stopped at exit; if this process is killed before it can stop it, a small
watcher (`ray_reaper.py`) stops what is left.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tba.config import RunConfig
from tba.errors import ConfigError, RunError, first_line

TOKEN_FILE = Path("~/.ray/auth_token").expanduser()
# The signals a run handles (`tba.interrupts.STOP_SIGNALS`), which Ray must leave to it.
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long a cluster's address may take to answer before the run says it cannot join it.
PROBE_SECONDS = 5.0


def cluster_address(config: RunConfig) -> str | None:
    """The Ray cluster the run joins (None: a local instance of its own)."""
    return config.ray.address or os.environ.get("RAY_ADDRESS") or None


def uses_ray(config: RunConfig) -> bool:
    """Whether the run starts or joins Ray: for searcher processes, or trainer ranks
    (`tba.runtime.launch`)."""
    return config.searchers.count > 0 or config.trainer.world_size > 1


def check_cluster(config: RunConfig) -> None:
    """Before anything of the run is made: the cluster it joins (`ray.address`, `RAY_ADDRESS`)
    is in a form Ray joins (`host:port`, `ray://host:port`, `auto`, `local`), else one line
    naming the setting (`ConfigError`), and something answers at it within `PROBE_SECONDS`,
    else one line naming the address (`RunError`)."""
    address = cluster_address(config)
    if not uses_ray(config) or address is None or address in ("auto", "local"):
        return
    source = "ray.address" if config.ray.address else "RAY_ADDRESS"
    scheme, _, rest = address.rpartition("://")
    if scheme not in ("", "ray", "http", "https"):  # a client of Ray's by its module's name
        return
    # An http address (a dashboard's, which Ray refuses to join) has no host:port of its own.
    host, port = _host_and_port(address if scheme.startswith("http") else rest, address, source)
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as error:
        reason = error.strerror or ("no answer" if isinstance(error, TimeoutError) else
                                    first_line(error))  # fmt: skip
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        check = "" if scheme else f" (`ray status --address {address}`)"
        raise RunError(f"cannot join the Ray cluster at {address} ({source}): nothing answers at "
                       f"{where} ({reason}); is it up{check}, and is that its address?") from None


def _host_and_port(where: str, address: str, source: str) -> tuple[str, int]:
    """(host, port) of `where`, `host:port` (`[v6 address]:port` too) in `address`, else one line
    naming `source`."""
    host, _, port = where.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or "/" in host or any(c.isspace() for c in host) or not port.isdigit() or not (
            0 < int(port) < 65536):  # fmt: skip
        what = f"invalid value for {source}" if source == "ray.address" else f"invalid {source}"
        raise ConfigError(f"{what}: a Ray cluster to join is host:port (its GCS server, e.g. "
                          "10.0.0.5:6379), ray://host:port (its client server, e.g. "
                          f"ray://10.0.0.5:10001), auto or local (got {address!r})")
    return host, int(port)


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
        check_cluster(config)  # Ray's own join retries for minutes where nothing answers
        options["address"] = address
        source = "ray.address" if config.ray.address else "RAY_ADDRESS"
        log(f"joining the Ray cluster at {address} ({source})")
    visible = gpus[1] if address is None and gpus is not None else None
    try:
        try:
            with _signals_wait_for(ray) as waiting, _raylet_gpus(visible):
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
        if waiting:  # a signal that came while Ray started: handled now, Ray stopped on the way out
            signal.raise_signal(waiting[0])
        yield
    finally:
        with _signals_wait_for(ray) as waiting:
            ray.shutdown()
        if waiting:
            signal.raise_signal(waiting[0])


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
def _signals_wait_for(ray) -> Iterator[list[int]]:
    """While Ray starts or shuts down (`ray.init`, `ray.shutdown`), a signal the run handles
    waits for it to end, in the list this yields: an exception raised inside `ray.init` left Ray
    half started, and the process then crashed in C as it exited (SIGSEGV, about one Ctrl-C in
    four at an asynchronous start); a second signal ends the process at once. The run's own
    handlers are kept across it, and installed again at its end: `ray.init` replaces the main
    thread's SIGTERM handler with one that exits at once (a `SystemExit` wherever the process is;
    in Ray's own waits, a C stack dump and status 134), and `ray.shutdown` resets SIGTERM's
    action to the default in C, below Python's notice (`signal.getsignal` still names the run's
    handler, which the kernel no longer called: a SIGTERM in the final evaluation or save killed
    the process where it was, its `.lock` left)."""
    waiting: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield waiting
        return
    saved = {number: signal.getsignal(number) for number in HANDLED_SIGNALS}

    def wait(signum, frame) -> None:
        if waiting:  # the user will not wait for Ray
            os.write(2, f"tba: interrupted again by {signal.Signals(signum).name} while Ray "
                        "starts or stops: exiting at once\n".encode())  # fmt: skip
            os._exit(128 + signum)
        waiting.append(signum)

    for number, handler in saved.items():
        if callable(handler):
            signal.signal(number, wait)
    utils = getattr(ray, "_private", None) and getattr(ray._private, "utils", None)
    setter = getattr(utils, "set_sigterm_handler", None)
    if callable(saved[signal.SIGTERM]) and setter is not None:
        utils.set_sigterm_handler = lambda handler: None
    try:
        yield waiting
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
