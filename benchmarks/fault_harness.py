"""What every fault case (`benchmarks.faults`) runs on and reads: a workspace (a tiny policy, rows,
a file of reward and evaluation functions that fail in every way), `tba` in a process of its own,
the lines it ends with, what a run directory kept; and tmpfs mounts (a small disk, a read-only
one) for the cases that need them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tba.policy.model import build_tiny_llama
from tba.policy.tokenizer import build_char_tokenizer

REWARDS = textwrap.dedent('''
    import math, os, pathlib, signal, time

    import numpy, torch

    CALLS = []

    def works(completions, **kwargs):
        return [float(len(c) % 3) for c in completions]

    def raises(completions, **kwargs):
        raise ValueError("no such column")

    def nan(completions, **kwargs):
        return [math.nan] * len(completions)

    def inf(completions, **kwargs):
        return [math.inf] * len(completions)

    def strings(completions, **kwargs):
        return ["high"] * len(completions)

    def wrong_count(completions, **kwargs):
        return [1.0]

    def hangs(completions, **kwargs):
        time.sleep(3600)

    def wrong_signature(x):
        return [1.0]

    def fails_first(completions, **kwargs):
        CALLS.append(1)
        if len(CALLS) == 1:
            raise RuntimeError("cold start")
        return [1.0] * len(completions)

    def tensor(completions, **kwargs):
        return torch.tensor([float(len(c) % 3) for c in completions])

    def numpy_bools(completions, **kwargs):
        return numpy.array([len(c) % 2 == 0 for c in completions])

    def fails_at_the_end(completions, trainer_state, **kwargs):
        if trainer_state.global_step >= 3:
            raise KeyError("answer")
        return [1.0] * len(completions)

    def _once(what):
        """Whether the fault of this environment variable is due now: at its step, the first
        time (its marker file, outside the run, made)."""
        marker = pathlib.Path(os.environ[what + "_ONCE"])
        if marker.exists():
            return False
        marker.touch()
        return True

    def signals(completions, trainer_state, **kwargs):
        """The held-out evaluation at step TBA_FAULT_STEP sends this process TBA_FAULT_SIGNAL, once
        (as `timeout`, Docker or a Ctrl-C would, at that moment)."""
        step = int(os.environ.get("TBA_FAULT_STEP", "-1"))
        if trainer_state.global_step == step and _once("TBA_FAULT"):
            os.kill(os.getpid(), signal.Signals[os.environ["TBA_FAULT_SIGNAL"]])
            time.sleep(1.0)  # the signal's handler runs meanwhile
        return [1.0] * len(completions)

    def fills_the_disk(completions, trainer_state, **kwargs):
        """The held-out evaluation at step TBA_FAULT_STEP fills the disk of TBA_FAULT_BALLAST,
        once (another job's files, a log that grew)."""
        if trainer_state.global_step == int(os.environ["TBA_FAULT_STEP"]) and _once("TBA_FAULT"):
            with open(os.environ["TBA_FAULT_BALLAST"], "wb") as ballast:
                try:
                    while True:
                        ballast.write(b"x" * 65536)
                        ballast.flush()
                except OSError:
                    pass
        return [1.0] * len(completions)
''')
# Small and fast: two prompts of four responses a step, a policy of 30k weights.
FAST = ["train.mode=sync", "searchers.count=0", "train.num_prompts=2", "train.group_size=4",
        "policy.max_new_tokens=8", "policy.num_threads=1", "task.num_eval=4", "eval.every=1000",
        "searchers.max_reward_failures=2", "searchers.reward_timeout_s=2",
        "train.max_steps=3"]  # fmt: skip


@dataclass
class Workspace:
    """A tiny policy, a dataset and a file of reward functions, in `root`."""

    root: Path

    def __post_init__(self) -> None:
        self.policy, self.data, self.rewards = (self.root / "policy", self.root / "data.jsonl",
                                                self.root / "rewards.py")  # fmt: skip
        if not (self.policy / "config.json").exists():
            tokenizer = build_char_tokenizer()
            torch.manual_seed(0)
            model = build_tiny_llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                     bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id, hidden_size=32,
                                     num_layers=2, num_heads=2)  # fmt: skip
            model.save_pretrained(self.policy)
            tokenizer.save_pretrained(self.policy)
        self.data.write_text("".join(json.dumps({"prompt": f"Q{i}\n", "answer": str(i)}) + "\n"
                                     for i in range(16)))  # fmt: skip
        self.rewards.write_text(REWARDS)

    def task(self, reward: str = "works", eval_func: str | None = None) -> list[str]:
        rewards = ",".join(f"{self.rewards}:{name}" for name in reward.split(","))
        settings = [f"policy.model={self.policy}", "task.name=custom",
                    f"task.train_path={self.data}", f"task.reward_funcs=[{rewards}]"]
        if eval_func:
            settings.append(f"task.eval_func={self.rewards}:{eval_func}")
        return settings


@dataclass
class Result:
    exit: int
    message: list[str]  # the lines tba printed on stderr after its log lines
    survived: str
    seconds: float


@dataclass
class Case:
    name: str
    what: str  # the fault, in words
    run: Callable[[Workspace, Path], tuple[int, str]]  # (exit status, stderr)
    exit: int  # the status it must end with
    message: str  # what its message must hold
    survived: Callable[[Path], str] = field(default=lambda run: survivors(run))
    # What "what survived" must name (default: after exit 0, 130 or 143, the run's results).
    kept: tuple[str, ...] | None = None
    # A bad-input case gives the same status and message in a process of its own as in the one
    # that checks it: tests/test_faults_cli.py runs its `tba` commands in its own process.
    in_process: bool = False
    # It mounts a tmpfs (a small or a read-only disk): only as root, where one can be mounted.
    mounts: bool = False


def tba(args: list[str], timeout: float = 300, env: dict | None = None) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "tba.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=os.environ | (env or {}))  # fmt: skip
    return done.returncode, done.stderr


def tba_patched(prelude: str, args: list[str], timeout: float = 300) -> tuple[int, str]:
    """`tba ARGS` in a process of its own that first runs `prelude` (Python that replaces a
    function of tba's, e.g. to kill the process in the middle of a save)."""
    script = f"{prelude}\nimport sys\nfrom tba.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    return done.returncode, done.stderr


# The first lines of what a process that crashes in C prints: glog's and Ray's stack dumps (`***
# SIGTERM received`, `*** Aborted at`), Python's fatal errors, a shell's report of a crash.
DUMPS = ("*** ", "Fatal Python error", "Segmentation fault", "Aborted")


def error_lines(stderr: str) -> list[str]:
    """What tba says when it stops: its `tba: error` line(s), or a traceback's lines; and the
    first lines of any C stack dump (never the right ending)."""
    lines = stderr.splitlines()
    if any(line.startswith("Traceback") for line in lines):
        return lines[next(i for i, line in enumerate(lines) if line.startswith("Traceback")):]
    return [line for line in lines if line.startswith(("tba: error", "tba: interrupted", *DUMPS))]


def survivors(run: Path) -> str:
    """What a run directory holds that matters: checkpoints, the final policy, eval.json."""
    if not run.exists():
        return "no run directory"
    if run.is_file():
        return f"the file {run.name}, as it was" if run.read_text() == "notes\n" else "file changed"
    checkpoints = sorted(p.name for p in (run / "checkpoints").glob("step*"))
    kept = [f"checkpoints {', '.join(checkpoints)}" if checkpoints else "no checkpoint"]
    kept += [name for name in ("final", "eval.json") if (run / name).exists()]
    # Leftovers of a run replaced or saved half-way: never there after a process that could clean.
    kept += [f"left over: {name}" for name in (".replaced", ".replacing", "final.partial")
             if (run / name).exists()]  # fmt: skip
    return "; ".join(kept)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. 16m) mounted at `path` for the duration (root only)."""
    path.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def read_only(path: Path) -> None:
    """Make the tmpfs at `path` read-only (`tmpfs`), as a disk mounted read-only is."""
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


def stepped(run: Path) -> bool:
    metrics = run / "metrics.jsonl"
    return metrics.exists() and '"loss"' in metrics.read_text()
