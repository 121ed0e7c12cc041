"""Soak test: an asynchronous run that loses a searcher every few minutes and its trainer once.

Runs `tba train` (asynchronous, `--searchers` searchers, checkpoints every `--checkpoint-every`
steps) for `--minutes` of training. Every `--kill-every` minutes it kills a random searcher process
with SIGKILL (the run replaces it); once, halfway, it kills the trainer and everything it started
(SIGKILL to the process group) and resumes the run with `tba train --resume`. At the end it prints
where every sample went, from the run's own accounting (searcher ledgers, the trainer's sequence
checks) and from the final checkpoint's buffer:

    generated = handed over + discarded in flight      (work lost at kills, counted)
    handed over = merged + duplicated                  (duplicated must be 0)
    lost: handed over but never merged                 (must be 0)

    python -m benchmarks.soak                   # 20 minutes
    python -m benchmarks.soak --minutes 6 --kill-every 1.5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tba.checkpoint import latest_checkpoint


def searcher_pids(run_dir: Path) -> dict[int, int]:
    """searcher index -> pid of its newest process, from the run's events."""
    pids: dict[int, int] = {}
    path = run_dir / "events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "searcher_ready":
                pids[event["searcher"]] = event["pid"]
    return pids


def launch(command: list[str], log: Path) -> subprocess.Popen:
    print(f"[{time.strftime('%H:%M:%S')}] tba {' '.join(command[:2])} ...", flush=True)
    with log.open("a") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "tba.cli", *command], stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the trainer kill takes Ray with it
        )  # fmt: skip


def supervise(process: subprocess.Popen, run_dir: Path, args, until: float | None) -> str:
    """Kill a random searcher every `kill_every` minutes until the run ends ('done') or `until`
    (wall-clock) passes ('due')."""
    rng = random.Random(args.seed)
    next_kill = time.time() + args.kill_every * 60
    while process.poll() is None:
        if until is not None and time.time() >= until:
            return "due"
        if time.time() >= next_kill and kill_a_searcher(run_dir, rng):
            next_kill += args.kill_every * 60
        time.sleep(1.0)
    return "done"


def kill_a_searcher(run_dir: Path, rng: random.Random) -> bool:
    """SIGKILL a random searcher; False when none is up (one still starting: try again soon)."""
    pids = searcher_pids(run_dir)
    if not pids:
        return False
    index = rng.choice(sorted(pids))
    try:
        os.kill(pids[index], signal.SIGKILL)
    except ProcessLookupError:  # already dead, its replacement not ready yet
        return False
    print(f"[{time.strftime('%H:%M:%S')}] killed searcher {index} (pid {pids[index]})", flush=True)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="training minutes in all")
    parser.add_argument("--kill-every", type=float, default=3.0, help="minutes between kills")
    parser.add_argument("--searchers", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=25, help="steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/soak"))
    parser.add_argument("overrides", nargs="*", help="extra key=value settings for tba train")
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; choose another --out")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".log")
    settings = [
        "train.mode=async", f"searchers.count={args.searchers}", f"seed={args.seed}",
        f"train.max_minutes={args.minutes}", "train.max_steps=1000000", "eval.every=1000000",
        f"checkpoint.every={args.checkpoint_every}", "searchers.max_restarts=1000",
        "buffer.capacity=5000", f"output_dir={args.out}", *args.overrides,
    ]  # fmt: skip

    process = launch(["train", *settings], log)
    # Kill the trainer halfway through the training budget (plus start-up: about a minute).
    status = supervise(process, args.out, args, until=time.time() + 60 + args.minutes * 30)
    trainer_kills = 0
    if status == "due":
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        trainer_kills = 1
        step = latest_checkpoint(args.out).step
        print(f"[{time.strftime('%H:%M:%S')}] killed the trainer; resuming from step {step}")
        process = launch(["train", "--resume", str(args.out)], log)
        supervise(process, args.out, args, until=None)
    if process.returncode != 0:
        sys.exit(f"the run failed (exit {process.returncode}); see {log}")
    report(args.out, trainer_kills)


def report(run_dir: Path, trainer_kills: int) -> None:
    summary = json.loads((run_dir / "eval.json").read_text())
    buffer = latest_checkpoint(run_dir).state["buffer"]
    names = [(s["searcher_id"], s["incarnation"], s["seq"])
             for _, entries in buffer["prompts"] for _, s in entries]  # fmt: skip
    handed_over = summary["samples_merged"] + summary["samples_duplicated"]
    rows = [
        ("training minutes", f"{summary['train_minutes']:.1f}"),
        ("optimizer steps", summary["steps"]),
        ("searcher processes killed and replaced", summary["searcher_restarts"]),
        ("trainer processes killed and resumed", trainer_kills),
        ("samples generated", summary["samples_generated"]),
        ("handed over to the trainer", handed_over),
        ("merged into the buffer", summary["samples_merged"]),
        ("evicted by capacity", summary["evicted_capacity"]),
        ("evicted as stale", summary["evicted_stale"]),
        ("discarded in flight (work lost at kills)", summary["samples_discarded_in_flight"]),
        ("lost: handed over, never merged (must be 0)", summary["samples_lost"]),
        ("duplicated (must be 0)", summary["samples_duplicated"]),
        ("in the final buffer", len(names)),
        ("duplicates in the final buffer (must be 0)", len(names) - len(set(names))),
        ("generated - handed over - discarded (must be 0)",
         summary["samples_generated"] - handed_over - summary["samples_discarded_in_flight"]),
        ("held-out greedy pass@1, base -> final",
         f"{summary['base']['eval_pass@1']:.3f} -> {summary['final']['eval_pass@1']:.3f}"),
    ]  # fmt: skip
    print("\n| quantity | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
