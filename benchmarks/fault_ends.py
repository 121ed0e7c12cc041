"""Faults at a run's edges, for `benchmarks.faults`: a finished run replaced by one that fails, a
kill during the final save, Ctrl-C and SIGTERM outside the training loop (the evaluations, the
start of an asynchronous run), a disk that fills at the end, a read-only run directory for
`tba eval` and a read-only place for `tba plot --out`. A case that goes on after the fault
(`--resume`) checks what it must say and do on the way, and reports the fault's own ending with
what the run kept at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.fault_harness import (
    FAST,
    Case,
    Workspace,
    error_lines,
    read_only,
    stepped,
    tba,
    tba_patched,
    tmpfs,
)
from tba.run_dir import read_metrics

ASYNC = ["train.mode=async", "searchers.count=1"]
WIDE = {"COLUMNS": "400"}  # log lines unwrapped, to read what they say


def failed(what: str) -> tuple[int, str]:
    """A case whose run went wrong on the way to its fault: status 99, never the one expected."""
    return 99, f"tba: error: {what}"


def overwrite_then_fail(ws: Workspace, run: Path) -> tuple[int, str]:
    """A finished run, then `tba train --overwrite` with a reward that always fails (what a
    TRL script run twice does, `TBATrainer.train()` replacing by default): the finished run is
    there after, as it was."""
    code, err = tba(["train", *FAST, *ws.task(), f"output_dir={run}"])
    if code != 0:
        return code, err
    summary = (run / "eval.json").read_bytes()
    code, err = tba(["train", *FAST, *ws.task("raises", "works"), f"output_dir={run}",
                     "--overwrite"], env=WIDE)  # fmt: skip
    if "replacing the finished run in" not in err or "kept the finished run in" not in err:
        return failed("the replacement was not said, or its restoring")
    if (run / "eval.json").read_bytes() != summary:
        return failed("eval.json changed")
    return code, err


# The final policy's weights written, then the process killed, before its tokenizer is.
KILLED_IN_THE_FINAL_SAVE = """
import os, signal
import tba.run
save = tba.run.save_policy
def save_policy(model, path):
    save(model, path)
    os.kill(os.getpid(), signal.SIGKILL)
tba.run.save_policy = save_policy
"""


def killed_in_the_final_save(ws: Workspace, run: Path) -> tuple[int, str]:
    """SIGKILL while final/ is written; `tba eval` must send to `--resume`, which evaluates and
    saves the run without training."""
    code, err = tba_patched(KILLED_IN_THE_FINAL_SAVE, ["train", *FAST, *ws.task(),
                                                       f"output_dir={run}"])  # fmt: skip
    if code != -signal.SIGKILL:
        return failed(f"the run ended with {code}, not killed: {error_lines(err)}")
    code, err = tba(["eval", str(run)])
    if code != 2 or f"finish it with `tba train --resume {run}`" not in err:
        return failed(f"tba eval ended with {code}: {error_lines(err)}")
    code, err = tba(["train", "--resume", str(run)], env=WIDE)
    if "but its end was not saved: evaluating and saving it, without training" not in err:
        return failed("--resume did not say it only evaluates and saves")
    steps = [record["step"] for record in read_metrics(run / "metrics.jsonl")]
    if steps != [0, 1, 2, 3, 3]:  # base, three steps, the final evaluation once
        return failed(f"metrics.jsonl holds steps {steps}")
    return code, err


def signalled(name: str, step: int, *settings: str,
              resume: bool = False) -> Callable[[Workspace, Path], tuple[int, str]]:  # fmt: skip
    """The run is sent `name` (SIGTERM, SIGINT) during its held-out evaluation at `step` (0: the
    base policy's, 3: the final one); `resume`: then `tba train --resume` must finish it."""

    def case(ws: Workspace, run: Path) -> tuple[int, str]:
        env = {"TBA_FAULT_SIGNAL": name, "TBA_FAULT_STEP": str(step),
               "TBA_FAULT_ONCE": str(ws.root / "signalled")}  # fmt: skip
        code, err = tba(["train", *FAST, *settings, *ws.task("works", "signals"),
                         f"output_dir={run}"], env=env)  # fmt: skip
        if resume:
            again, more = tba(["train", "--resume", str(run)], env=env)
            if again != 0:
                return failed(f"--resume ended with {again}: {error_lines(more)}")
        return code, err

    return case


def ctrl_c_async(ws: Workspace, run: Path) -> tuple[int, str]:
    """Ctrl-C in a terminal: SIGINT to the whole process group (the trainer and whatever it
    started) of an asynchronous run, once it has taken a step."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tba.cli", "train", *FAST, *ASYNC, *ws.task(), f"output_dir={run}",
         "train.max_steps=100000", "train.max_minutes=5"],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline and not stepped(run) and process.poll() is None:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=240)
    return process.returncode, err


def full_disk_at_the_end(ws: Workspace, run: Path) -> tuple[int, str]:
    """The run directory's disk (a 16 MB tmpfs) fills during the final evaluation; once space is
    freed, `tba train --resume` must finish the run."""
    env = {"TBA_FAULT_STEP": "3", "TBA_FAULT_ONCE": str(ws.root / "filled")}
    with tmpfs(ws.root / "small", "16m") as disk:
        env["TBA_FAULT_BALLAST"] = str(disk / "ballast")
        code, err = tba(["train", *FAST, *ws.task("works", "fills_the_disk"),
                         f"output_dir={disk / 'run'}"], env=env)  # fmt: skip
        (disk / "ballast").unlink(missing_ok=True)
        again, more = tba(["train", "--resume", str(disk / "run")], env=env)
        subprocess.run(["cp", "-r", str(disk / "run"), str(run)], check=False)
    if again != 0:
        return failed(f"--resume ended with {again}: {error_lines(more)}")
    return code, err


def eval_read_only(ws: Workspace, run: Path) -> tuple[int, str]:
    """`tba eval` of a finished run on a disk mounted read-only: it must say so before scoring,
    not after."""
    with tmpfs(ws.root / "disk", "16m") as disk:
        code, err = tba(["train", *FAST, *ws.task("works", "works"), f"output_dir={disk / 'run'}"])
        if code != 0:
            return code, err
        read_only(disk)
        code, err = tba(["eval", str(disk / "run")], env=WIDE)
        subprocess.run(["cp", "-r", str(disk / "run"), str(run)], check=False)
    if "eval_reward" in err:  # the held-out set was scored
        return failed("tba eval scored the run before finding it cannot write")
    return code, err


METRICS = [{"step": 0, "time": 0.0, "eval_pass@1": 0.1}, {"step": 5, "time": 60.0, "loss": 1.0},
           {"step": 5, "time": 61.0, "eval_pass@1": 0.4}]  # fmt: skip


def plot_read_only(ws: Workspace, run: Path) -> tuple[int, str]:
    """`tba plot RUN --out` into a directory on a disk mounted read-only."""
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    with tmpfs(ws.root / "disk", "1m") as disk:
        read_only(disk)
        return tba(["plot", str(run), "--out", str(disk / "curves.png")])


def metrics_as_written(run: Path) -> str:
    same = read_metrics(run / "metrics.jsonl") == METRICS
    return "metrics.jsonl as it was; no plot" if same else "metrics.jsonl changed"


CASES = [
    Case("overwrite that fails", "`--overwrite` of a finished run by a run whose reward fails",
         overwrite_then_fail, 1, "reward function 'raises' failed on its last 2 calls",
         kept=("checkpoints step000003", "final", "eval.json")),
    Case("killed in the final save", "SIGKILL while final/ is written; `tba eval`, `--resume`",
         killed_in_the_final_save, 0, ""),
    Case("SIGTERM in the first evaluation", "SIGTERM while an asynchronous run evaluates its "
         "base policy", signalled("SIGTERM", 0, *ASYNC), 143,
         "by SIGTERM during the evaluation of the base policy; the run had no checkpoint yet",
         kept=()),
    Case("SIGTERM in the final evaluation", "SIGTERM during the final evaluation; `--resume`",
         signalled("SIGTERM", 3, resume=True), 143, "by SIGTERM during the final evaluation; its "
         "training is complete and checkpointed (step000003): `tba train --resume"),
    Case("Ctrl-C in an asynchronous run", "SIGINT to the process group of an asynchronous run",
         ctrl_c_async, 130, ""),
    Case("full disk at the end", "the disk fills in the final evaluation; freed; `--resume`",
         full_disk_at_the_end, 1, "(No space left on device); its training is complete and "
         "checkpointed (step000003): `tba train --resume", mounts=True),
    Case("eval of a read-only run", "`tba eval` of a run on a read-only disk", eval_read_only, 2,
         "cannot write the scores", kept=("final", "eval.json"), mounts=True),
    Case("plot into a read-only place", "`tba plot --out` on a read-only disk", plot_read_only, 2,
         "cannot write the plot", survived=metrics_as_written, kept=("as it was",), mounts=True),
]  # fmt: skip
