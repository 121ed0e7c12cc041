"""Fault injection, as a user would meet the faults: each case runs `tba train` (or `--resume`) in
a process of its own, on a tiny policy, a custom task and its own files, and reports its exit
status, its message and what it left on disk. tests/test_faults_cli.py runs every case and checks
it; this script prints the table of docs/faults.md.

    python -m benchmarks.faults [--only NAME,...]

Every case must end with exit status 1 (a run that cannot go on), 2 (bad input) or 130/143 (Ctrl-C,
SIGTERM: saved), never 0 after training nothing, with a message of at most two lines that names
the problem, and without losing what the run had saved.

The cases are `CASES`: this module's, then those of `benchmarks.fault_ends` (a run's edges:
replacing a run, its end, signals outside training, writes that fail); what they all run on is
`benchmarks.fault_harness`. A new case goes at the end of a module's `CASES`, or in a module of
its own added to `CASES` below.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import fault_ends
from benchmarks.fault_harness import (  # noqa: F401 - FAST, Result: for the tests too
    FAST,
    Case,
    Result,
    Workspace,
    error_lines,
    stepped,
    survivors,
    tba,
)


def reward_case(reward: str) -> Callable[[Workspace, Path], tuple[int, str]]:
    """The reward in training only: held-out pass@1 is `works`' (a reward that fails in the
    held-out evaluation too stops the run there, at its start: `eval_case`)."""
    return lambda ws, run: tba(["train", *FAST, *ws.task(reward, "works"), f"output_dir={run}"])


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
    while time.time() < deadline and not stepped(run) and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    return process.returncode, err


def second_start(ws: Workspace, run: Path) -> tuple[int, str]:
    """The same `tba train` again while the first runs (a command re-run from the shell's
    history, a scheduler's retry); then the first is stopped and must have lost nothing."""
    first = subprocess.Popen(
        [sys.executable, "-m", "tba.cli", "train", *FAST, *ws.task(), f"output_dir={run}",
         "train.max_steps=100000", "train.max_minutes=5"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not stepped(run) and first.poll() is None:
            time.sleep(0.2)
        config = (run / "config.yaml").read_bytes()
        metrics = (run / "metrics.jsonl").read_bytes()
        code, err = tba(["train", *FAST, *ws.task(), f"output_dir={run}"])
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    kept = (run / "config.yaml").read_bytes() == config and (
        run / "metrics.jsonl").read_bytes().startswith(metrics)  # fmt: skip
    if first.returncode != 143 or not kept:
        return 99, f"tba: error: the first run ended with {first.returncode}, files kept: {kept}"
    return code, err


def two_builds(ws: Workspace, run: Path) -> tuple[int, str]:
    """Two `tba pretrain` at once into one empty cache (seeds started together on a new
    machine): one builds, the other waits for it and uses it."""
    args = [sys.executable, "-m", "tba.cli", "pretrain", "pretrain.num_examples=32",
            "pretrain.steps=4", "pretrain.batch_size=8", f"pretrain.cache_dir={run}"]
    processes = [subprocess.Popen(args, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [process.communicate(timeout=300)[1] for process in processes]
    codes = [process.returncode for process in processes]
    worst = max(range(2), key=lambda i: codes[i] != 0)
    built = sum("(once) into" in err for err in errors)
    waited = sum("waiting for process" in err for err in errors)
    if built != 1:
        return 99, f"tba: error: built {built} times, waited {waited} times"
    return codes[worst], errors[worst]


def cache_contents(cache: Path) -> str:
    entries = sorted(path.name for path in cache.iterdir()) if cache.exists() else []
    partial = [name for name in entries if name.endswith(".partial")]
    models = [name for name in entries if not name.endswith((".partial", ".lock"))]
    return f"cache {', '.join(models) or 'empty'} (built once); " + (
        f"left over: {', '.join(partial)}" if partial else "no .partial left")  # fmt: skip


def read_only_output_dir(ws: Workspace, run: Path) -> tuple[int, str]:
    """output_dir in a read-only directory: a read-only tmpfs (as root, whom permissions do not
    stop), else a directory without write permission."""
    parent = ws.root / "read-only"
    parent.mkdir(exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(parent)], capture_output=True
    ).returncode == 0  # fmt: skip
    if not mounted:
        parent.chmod(0o555)
    try:
        return tba(["train", *FAST, *ws.task(), f"output_dir={parent / 'run'}"])
    finally:
        if mounted:
            subprocess.run(["umount", str(parent)], check=False)
        parent.chmod(0o755)


def output_dir_file(ws: Workspace, run: Path) -> tuple[int, str]:
    run.write_text("notes\n")
    return tba(["train", *FAST, *ws.task(), f"output_dir={run}"])


def output_dir_under_a_file(ws: Workspace, run: Path) -> tuple[int, str]:
    (ws.root / "notes").write_text("notes\n")
    return tba(["train", *FAST, *ws.task(), f"output_dir={ws.root / 'notes' / 'run'}"])


def resume_finished(ws: Workspace, run: Path) -> tuple[int, str]:
    """`--resume` of a run that ended at its step limit, with that same limit."""
    code, err = tba(["train", *FAST, *ws.task(), f"output_dir={run}"])
    if code != 0:
        return code, err
    metrics = (run / "metrics.jsonl").read_bytes()
    code, err = tba(["train", "--resume", str(run)])
    if (run / "metrics.jsonl").read_bytes() != metrics:
        return 99, "tba: error: metrics.jsonl changed"
    return code, err


def resume_changed_task(ws: Workspace, run: Path) -> tuple[int, str]:
    """`--resume` with a task setting changed (task.num_train) and one that may change
    (task.num_eval)."""
    code, err = tba(["train", *FAST, *ws.task(), f"output_dir={run}"])
    if code != 0:
        return code, err
    return tba(["train", "--resume", str(run), "train.max_steps=6", "task.num_train=8",
                "task.num_eval=2"])  # fmt: skip


def eval_without_final(ws: Workspace, run: Path) -> tuple[int, str]:
    """`tba eval` of a run that failed at its final evaluation: checkpointed, no final/."""
    tba(["train", *FAST, *ws.task("works", "fails_at_the_end"), f"output_dir={run}"])
    return tba(["eval", str(run)])


def with_data(text: str) -> Callable[[Workspace, Path], tuple[int, str]]:
    def run(ws: Workspace, run_dir: Path) -> tuple[int, str]:
        path = ws.root / "rows.jsonl"
        path.write_text(text)
        return tba(["train", *FAST, *ws.task(), f"task.train_path={path}",
                    f"output_dir={run_dir}"])  # fmt: skip

    return run


def with_settings(*settings: str) -> Callable[[Workspace, Path], tuple[int, str]]:
    return lambda ws, run: tba(["train", *FAST, *ws.task(), f"output_dir={run}", *settings])


CASES = [
    Case("reward raises", "every call of the only reward raises", reward_case("raises"), 1,
         "reward function 'raises' failed on its last 2 calls"),
    Case("reward NaN", "the reward is NaN for every completion", reward_case("nan"), 1,
         "reward function 'nan' failed on its last 2 calls"),
    Case("reward inf", "the reward is inf", reward_case("inf"), 1, "'inf' failed on its last"),
    Case("reward strings", "the reward returns strings", reward_case("strings"), 1,
         "reward function 'strings' returned 'high', a str, for 8 of 8"),
    Case("reward wrong count", "one value for a batch", reward_case("wrong_count"), 1,
         "returned 1 values for 8 completions"),
    Case("reward hangs", "the reward never returns (reward_timeout_s=2)",
         reward_case("hangs"), 1, "did not return within 2 s"),
    Case("reward signature", "`def f(x)`: not TRL's contract", reward_case("wrong_signature"),
         1, "'wrong_signature' failed on its last 2 calls"),
    Case("reward fails once", "the first call raises, the rest work", reward_case("fails_first"),
         0, ""),
    Case("eval hangs", "task.eval_func never returns", eval_case("hangs"), 1,
         "held-out evaluation: 'hangs' failed on all 4 completions: did not return within 2 s"),
    Case("eval raises", "task.eval_func raises", eval_case("raises"), 1,
         "held-out evaluation: 'raises' failed on all 4 completions: raised ValueError"),
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
    # Runs, paths and devices that cannot be used, and messages (2026-11-26).
    Case("second start", "the same `tba train` while the first runs; then SIGTERM the first",
         second_start, 2, "is in use by process", in_process=True),
    Case("unknown device", "policy.device=gpu", with_settings("policy.device=gpu"), 2,
         "policy.device: a device is auto (CUDA when present), cpu, cuda, cuda:N",
         in_process=True),
    Case("missing device", "policy.device=cuda:99, a GPU this machine does not have",
         with_settings("policy.device=cuda:99"), 2, "policy.device=cuda:99: this machine has",
         in_process=True),
    Case("searcher device", "searchers.device=cuda with searcher processes given no GPU",
         with_settings("train.mode=async", "searchers.count=1", "searchers.device=cuda"), 2,
         "searchers.device=cuda needs searchers.num_gpus > 0", in_process=True),
    Case("reward tensor", "the reward returns a torch tensor, another a numpy array of bools",
         lambda ws, run: tba(["train", *FAST, *ws.task("tensor,numpy_bools"),
                              f"output_dir={run}"]), 0, "", in_process=True),
    Case("output_dir is a file", "output_dir names a regular file", output_dir_file, 2,
         "is a file, not a directory: choose another output_dir", kept=("as it was",),
         in_process=True),
    Case("output_dir under a file", "output_dir inside a regular file", output_dir_under_a_file,
         2, "notes is a file, not a directory", in_process=True),
    Case("output_dir read-only", "output_dir in a read-only directory", read_only_output_dir, 2,
         "cannot be created or written", in_process=True),
    Case("two builds", "two `tba pretrain` into one empty cache at once", two_builds, 0, "",
         survived=cache_contents, kept=("built once", "no .partial left")),
    Case("reward_weights length", "task.reward_weights=[1,2] for one reward function",
         with_settings("task.reward_weights=[1,2]"), 2,
         "task.reward_weights has 2 weights for 1 reward functions", in_process=True),
    Case("resume a finished run", "`--resume` of a run that reached train.max_steps",
         resume_finished, 2, "already reached its limit, train.max_steps=3 (step 3)",
         kept=("final", "eval.json"), in_process=True),
    Case("eval fails at the end", "task.eval_func fails on every row of the final evaluation",
         eval_case("fails_at_the_end"), 1,
         "'fails_at_the_end' failed on all 4 completions: raised KeyError: 'answer'",
         kept=("checkpoints step000003",), in_process=True),
    Case("train=5", "a section given a value", with_settings("train=5"), 2,
         "train is a section of settings, not a value (got 5)", in_process=True),
    Case("empty section", "a YAML `train:` section with its keys commented out",
         with_yaml("train:\n  # learning_rate: 1.0e-3\n"), 2, "train is empty",
         in_process=True),
    Case("resume with a task change", "`--resume` with task.num_train and task.num_eval changed",
         resume_changed_task, 2, "was written with task.num_train=5000 (this run: 8); a",
         kept=("final", "eval.json"), in_process=True),
    Case("eval without final", "`tba eval` of a run that failed at its final evaluation",
         eval_without_final, 2, "no final policy (final/ not found: the run has not ended); "
         "finish it with `tba train --resume", kept=("checkpoints step000003",),
         in_process=True),
    Case("empty data file", "task.train_path an empty file", with_data(""), 2,
         "rows.jsonl is empty: it has no rows", in_process=True),
    Case("non-string prompt", "a row whose prompt is a number", with_data('{"prompt": 42}\n'),
         2, "row 1's `prompt` is a int (42), not text or a conversation", in_process=True),
    Case("config without extension", "`tba train myconfig`, a file that does not exist",
         lambda ws, run: tba(["train", str(ws.root / "myconfig"), f"output_dir={run}"]), 2,
         "config file not found", in_process=True),
    *fault_ends.CASES,
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
