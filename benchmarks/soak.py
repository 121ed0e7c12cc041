"""Soak test: an asynchronous run that loses a searcher every few minutes, and its trainer twice.

Runs `tba train` (asynchronous, `--searchers` searchers, checkpoints every `--checkpoint-every`
steps) for `--minutes` of training. Every `--kill-every` minutes it kills a random searcher process
with SIGKILL (the run replaces it). At two random times (between 20% and 80% of the budget, in a
random order) it stops the trainer: once with SIGKILL to it and everything it started (the
process group), once with SIGTERM to the trainer alone (what `timeout`, Docker and SLURM send: the
run saves itself and exits 143); each time it resumes the run with `tba train --resume`. At the end
it prints where every sample went, from the run's own accounting (searcher ledgers, the trainer's
sequence checks) and from the final checkpoint's buffer, and whether metrics.jsonl holds every
step once:

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
from tba.run_dir import read_metrics


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

    rng = random.Random(args.seed + 1)
    start = time.time() + 60  # start-up: about a minute
    stops = sorted(start + rng.uniform(0.2, 0.8) * args.minutes * 60 for _ in range(2))
    kinds = rng.sample(["SIGKILL", "SIGTERM"], 2)
    process = launch(["train", *settings], log)
    trainer_kills = {"SIGKILL": 0, "SIGTERM": 0}
    for when, kind in zip(stops, kinds):
        if supervise(process, args.out, args, until=when) == "done":
            break
        if kind == "SIGKILL":
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        else:
            process.send_signal(signal.SIGTERM)
            process.wait()
            if process.returncode != 143:
                sys.exit(f"SIGTERM: the run exited {process.returncode}, not 143; see {log}")
        trainer_kills[kind] += 1
        step = latest_checkpoint(args.out).step
        print(f"[{time.strftime('%H:%M:%S')}] {kind} to the trainer; resuming from step {step}",
              flush=True)  # fmt: skip
        process = launch(["train", "--resume", str(args.out)], log)
    supervise(process, args.out, args, until=None)
    if process.returncode != 0:
        sys.exit(f"the run failed (exit {process.returncode}); see {log}")
    report(args.out, trainer_kills)


def report(run_dir: Path, trainer_kills: dict[str, int]) -> None:
    summary = json.loads((run_dir / "eval.json").read_text())
    buffer = latest_checkpoint(run_dir).state["buffer"]
    names = [(s["searcher_id"], s["incarnation"], s["seq"])
             for _, entries in buffer["prompts"] for _, s in entries]  # fmt: skip
    handed_over = summary["samples_merged"] + summary["samples_duplicated"]
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    rows = [
        ("training minutes", f"{summary['train_minutes']:.1f}"),
        ("optimizer steps", summary["steps"]),
        ("searcher processes killed and replaced", summary["searcher_restarts"]),
        ("trainer killed (SIGKILL to its process group) and resumed", trainer_kills["SIGKILL"]),
        ("trainer stopped by SIGTERM (saved, exit 143) and resumed", trainer_kills["SIGTERM"]),
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
        ("steps in metrics.jsonl missing (must be 0)", len(set(range(1, summary["steps"] + 1))
                                                            - set(steps))),
        ("steps in metrics.jsonl recorded twice (must be 0)", len(steps) - len(set(steps))),
        ("held-out greedy pass@1, base -> final",
         f"{summary['base']['eval_pass@1']:.3f} -> {summary['final']['eval_pass@1']:.3f}"),
    ]  # fmt: skip
    print("\n| quantity | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
