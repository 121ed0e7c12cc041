"""Fault injection, as a user would meet the faults: each case runs `tba train` (or `--resume`) in
a process of its own, on a tiny policy, a custom task and its own files, and reports its exit
status, its message and what it left on disk. tests/test_faults_cli.py runs every case and checks
it; this script prints the table of docs/faults.md.

    python -m benchmarks.faults [--only NAME,...]

Every case must end with exit status 1 (a run that cannot go on), 2 (bad input) or 130/143 (Ctrl-C,
SIGTERM: saved), never 0 after training nothing, with a message of at most two lines that names
the problem, and without losing what the run had saved.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tba.policy.model import build_tiny_llama
from tba.policy.tokenizer import build_char_tokenizer

REWARDS = textwrap.dedent('''
    import math, time

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
        settings = [f"policy.model={self.policy}", "task.name=custom",
                    f"task.train_path={self.data}", f"task.reward_funcs=[{self.rewards}:{reward}]"]
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


def tba(args: list[str], timeout: float = 300, env: dict | None = None) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "tba.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=os.environ | (env or {}))  # fmt: skip
    return done.returncode, done.stderr


def error_lines(stderr: str) -> list[str]:
    """What tba says when it stops: its `tba: error` line(s), or a traceback's lines."""
    lines = stderr.splitlines()
    if any(line.startswith("Traceback") for line in lines):
        return lines[next(i for i, line in enumerate(lines) if line.startswith("Traceback")):]
    return [line for line in lines if line.startswith(("tba: error", "tba: interrupted"))]


def survivors(run: Path) -> str:
    """What a run directory holds that matters: checkpoints, the final policy, eval.json."""
    if not run.exists():
        return "no run directory"
    checkpoints = sorted(p.name for p in (run / "checkpoints").glob("step*"))
    kept = [f"checkpoints {', '.join(checkpoints)}" if checkpoints else "no checkpoint"]
    kept += [name for name in ("final", "eval.json") if (run / name).exists()]
    return "; ".join(kept)


def reward_case(reward: str) -> Callable[[Workspace, Path], tuple[int, str]]:
    return lambda ws, run: tba(["train", *FAST, *ws.task(reward), f"output_dir={run}"])


def eval_case(eval_func: str) -> Callable[[Workspace, Path], tuple[int, str]]:
    return lambda ws, run: tba(["train", *FAST, *ws.task("works", eval_func),
                                f"output_dir={run}"])  # fmt: skip


def with_yaml(text: str) -> Callable[[Workspace, Path], tuple[int, str]]:
    def run(ws: Workspace, run_dir: Path) -> tuple[int, str]:
        path = ws.root / "config.yaml"
        path.write_text(textwrap.dedent(text))
        return tba(["train", str(path), *FAST, *ws.task(), f"output_dir={run_dir}"])

    return run


def full_disk(ws: Workspace, run: Path) -> tuple[int, str]:
    """The run directory on a tmpfs too small for a checkpoint (needs root to mount one)."""
    mount = ws.root / "small"
    mount.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], check=True)
    try:
        code, err = tba(["train", *FAST, *ws.task(), f"output_dir={mount / 'run'}",
                         "checkpoint.every=1"])  # fmt: skip
        subprocess.run(["cp", "-r", str(mount / "run"), str(run)], check=False)
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    return code, err


def torn_metrics(ws: Workspace, run: Path) -> tuple[int, str]:
    """A kill during a write leaves half a line at the end of metrics.jsonl; resume."""
    code, err = tba(["train", *FAST, *ws.task(), f"output_dir={run}", "checkpoint.every=2"])
    with (run / "metrics.jsonl").open("a") as file:
        file.write('{"step": 4, "loss": 0.')
    return tba(["train", "--resume", str(run), "train.max_steps=5"])


def damaged_checkpoint(ws: Workspace, run: Path) -> tuple[int, str]:
    """The newest checkpoint's model file cut short (a kill or a full disk); resume."""
    tba(["train", *FAST, *ws.task(), f"output_dir={run}", "checkpoint.every=1",
         "checkpoint.keep=2"])  # fmt: skip
    newest = sorted((run / "checkpoints").glob("step*"))[-1] / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    return tba(["train", "--resume", str(run), "train.max_steps=5"])


def broken_model(ws: Workspace, run: Path) -> tuple[int, str]:
    """A tokenizer, but a config without weights."""
    broken = ws.root / "broken"
    broken.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ws.policy / name).exists():
            (broken / name).write_bytes((ws.policy / name).read_bytes())
    (broken / "config.json").write_text('{"model_type": "llama"}')
    code, err = tba(["train", *FAST, *ws.task(), f"policy.model={broken}", f"output_dir={run}"])
    return code, err


def empty_model(ws: Workspace, run: Path) -> tuple[int, str]:
    empty = ws.root / "empty"
    empty.mkdir(exist_ok=True)
    return tba(["train", *FAST, *ws.task(), f"policy.model={empty}", f"output_dir={run}"])


def after_a_failed_start(ws: Workspace, run: Path) -> tuple[int, str]:
    """A start that failed (a broken model), then the same command with a good one."""
    broken_model(ws, run)
    return tba(["train", *FAST, *ws.task(), f"output_dir={run}"])


def sigterm(ws: Workspace, run: Path) -> tuple[int, str]:
    """SIGTERM (what `timeout`, Docker and SLURM send) during training."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tba.cli", "train", *FAST, *ws.task(), f"output_dir={run}",
         "train.max_steps=100000", "train.max_minutes=5"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and not _stepped(run) and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    return process.returncode, err


def _stepped(run: Path) -> bool:
    metrics = run / "metrics.jsonl"
    return metrics.exists() and '"loss"' in metrics.read_text()


CASES = [
    Case("reward raises", "every call of the only reward raises", reward_case("raises"), 1,
         "reward function 'raises' failed on its last 2 calls"),
    Case("reward NaN", "the reward is NaN for every completion", reward_case("nan"), 1,
         "reward function 'nan' failed on its last 2 calls"),
    Case("reward inf", "the reward is inf", reward_case("inf"), 1, "'inf' failed on its last"),
    Case("reward strings", "the reward returns strings", reward_case("strings"), 1,
         "'strings' failed on its last 2 calls"),
    Case("reward wrong count", "one value for a batch", reward_case("wrong_count"), 1,
         "returned 1 values for 8 completions"),
    Case("reward hangs", "the reward never returns (reward_timeout_s=2)",
         reward_case("hangs"), 1, "did not return within 2 s"),
    Case("reward signature", "`def f(x)`: not TRL's contract", reward_case("wrong_signature"),
         1, "'wrong_signature' failed on its last 2 calls"),
    Case("reward fails once", "the first call raises, the rest work", reward_case("fails_first"),
         0, ""),
    Case("eval hangs", "task.eval_func never returns", eval_case("hangs"), 1,
         "'hangs' failed on every held-out completion of its last 2 evaluations"),
    Case("eval raises", "task.eval_func raises", eval_case("raises"), 1,
         "'raises' failed on every held-out completion of its last 2 evaluations"),
    Case("yaml section twice", "a second `train:` section",
         with_yaml("train:\n  learning_rate: 1.0e-3\ntrain:\n  beta: 0.1\n"), 2,
         "'train' is given twice (first on line 1)"),
    Case("yaml key twice", "a key repeated in a section",
         with_yaml("train:\n  beta: 0.1\n  beta: 0.2\n"), 2, "'beta' is given twice"),
    Case("infinite learning rate", "train.learning_rate=.inf",
         lambda ws, run: tba(["train", *FAST, *ws.task(), f"output_dir={run}",
                              "train.learning_rate=.inf"]), 2,
         "train.learning_rate: Input should be a finite number"),
    Case("infinite beta", "train.beta=.inf",
         lambda ws, run: tba(["train", *FAST, *ws.task(), f"output_dir={run}",
                              "train.beta=.inf"]), 2, "train.beta: Input should be a finite"),
    Case("full disk", "output_dir on a 96 kB tmpfs", full_disk, 1,
         "cannot write a checkpoint"),
    Case("torn metrics line", "a kill mid-write; --resume", torn_metrics, 0, ""),
    Case("damaged checkpoint", "the newest checkpoint's model file cut short; --resume",
         damaged_checkpoint, 0, ""),
    Case("broken model", "a tokenizer and a config.json, no weights", broken_model, 2,
         "cannot load a causal LM from"),
    Case("empty model", "an empty model directory", empty_model, 2, "no tokenizer in"),
    Case("rerun after a failed start", "the same command after a broken model",
         after_a_failed_start, 0, ""),
    Case("SIGTERM", "SIGTERM during training", sigterm, 143, ""),
]  # fmt: skip


def run(case: Case, root: Path) -> Result:
    workspace = Workspace(root)
    run_dir = root / "run"
    start = time.time()
    code, err = case.run(workspace, run_dir)
    return Result(code, error_lines(err), case.survived(run_dir), time.time() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--out", type=Path, default=Path("runs/faults"))
    args = parser.parse_args()
    chosen = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    print("| case | fault | exit | message | what survived |\n|---|---|---|---|---|")
    failures = 0
    for case in chosen:
        root = args.out / case.name.replace(" ", "-")
        subprocess.run(["rm", "-rf", str(root)], check=True)
        root.mkdir(parents=True)
        result = run(case, root)
        ok = result.exit == case.exit and len(result.message) <= 2 and case.message in (
            " ".join(result.message))  # fmt: skip
        failures += not ok
        message = " / ".join(result.message).replace("|", "\\|") or "(none)"
        print(f"| {case.name} | {case.what} | {result.exit} | {message} | {result.survived} |"
              + ("" if ok else " **unexpected**"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
