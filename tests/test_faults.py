"""Faults a long run meets: reward functions that raise, hang or return garbage; non-finite losses;
bad input (missing model, existing run directory, full disk while checkpointing); and safety (the
verifier never runs model output, the local Ray instance listens on loopback only)."""

from __future__ import annotations

import builtins
import ipaddress
import json
import math
import os
import pickle
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from test_train_e2e import FAST

import tba.checkpoint
import tba.locks
import tba.run
from benchmarks.faults import FAST as TINY_RUN
from benchmarks.faults import Workspace
from tba import TBAConfig, TBATrainer
from tba.checkpoint import list_checkpoints, load_checkpoint
from tba.cli import main
from tba.config import RunConfig, TrainConfig, load_config
from tba.core import Sample
from tba.errors import ConfigError, RewardError
from tba.evaluation import EvalFaults
from tba.locks import FileLock, Locked
from tba.policy.sampling import Generation
from tba.policy.sources import built_once
from tba.rewards.scorer import RewardScorer
from tba.run_dir import LOCK_FILE, RunBusyError, read_metrics
from tba.runtime.placement import check_devices, searcher_gpus
from tba.runtime.ray_cluster import ray_session
from tba.searcher import Searcher
from tba.tasks.verifiers.last_number import last_number_reward
from tba.trainer import Trainer

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["a", "b", "c", "d"]


def ones(prompts, completions, **_):
    return [1.0] * len(completions)


def score(fn, timeout_s: float = 5.0, max_failures: int = 3):
    scorer = RewardScorer([ones, fn], timeout_s=timeout_s, max_failures=max_failures)
    return scorer.score(PROMPTS, COMPLETIONS, [[1]] * 4, {})


# ------------------------------------------------------------------------- reward functions


@pytest.mark.parametrize(
    ("returned", "reason", "dropped"),
    [
        (None, "returned None", 4),
        ([1.0, 2.0], "returned 2 values for 4 completions", 4),
        ([0.0, math.nan, math.inf, 1.0], "returned nan (not a finite number) for 2 completions", 2),
        (3.0, "returned a float, not a list", 4),
    ],
)
def test_bad_return_values_drop_the_affected_completions(returned, reason, dropped):
    def bad(prompts, completions, **_):
        return returned

    scores = score(bad)
    assert sum(math.isnan(t) for t in scores.totals) == dropped  # dropped, never scored as 0
    assert all(t == 1.0 + v for t, v in zip(scores.totals, scores.parts["bad"])
               if not math.isnan(t))  # fmt: skip
    assert scores.faults == [("bad", reason, dropped)]


def test_none_means_not_scored_as_in_trl():
    """A function that applies to some completions only returns None for the others: their
    reward is what the other functions give; a completion no function scores is dropped."""

    def some(prompts, completions, **_):
        return [None, 2.0, None, 3.0]

    scores = score(some)
    assert scores.totals == [1.0, 3.0, 1.0, 4.0] and scores.faults == [] and scores.unscored == 0
    assert scores.parts["some"] == [None, 2.0, None, 3.0]
    alone = RewardScorer([some]).score(PROMPTS, COMPLETIONS, [[1]] * 4, {})
    assert [t if not math.isnan(t) else None for t in alone.totals] == [None, 2.0, None, 3.0]
    assert alone.unscored == 2 and alone.faults == []


def test_a_raising_or_hanging_function_drops_its_call():
    def raises(prompts, completions, **_):
        raise KeyError("no such column")

    def hangs(prompts, completions, **_):
        time.sleep(30)

    scores = score(raises)
    assert all(math.isnan(t) for t in scores.totals)
    assert scores.faults == [("raises", "raised KeyError: 'no such column'", 4)]
    start = time.time()
    scores = score(hangs, timeout_s=0.2)
    assert time.time() - start < 5
    assert all(math.isnan(t) for t in scores.totals)
    assert scores.faults == [("hangs", "did not return within 0.2 s", 4)]


def test_a_function_failing_call_after_call_stops_the_run():
    calls = []

    def flaky(prompts, completions, **_):
        calls.append(1)
        if len(calls) != 3:
            raise ValueError("boom")
        return [0.5] * len(completions)

    scorer = RewardScorer([flaky], timeout_s=5.0, max_failures=3)
    for _ in range(5):  # fails, fails, works, fails, fails: never 3 in a row
        scorer.score(PROMPTS, COMPLETIONS, [[1]] * 4, {})
    with pytest.raises(RewardError, match="'flaky' failed on its last 3 calls.*ValueError: boom"):
        scorer.score(PROMPTS, COMPLETIONS, [[1]] * 4, {})


def test_reward_functions_can_log_extra_columns_like_trl():
    def logs(prompts, completions, log_extra=None, **_):
        log_extra("length", [len(c) for c in completions])
        log_extra("wrong_length", [0.0])  # not one per completion: ignored
        return [0.5] * len(completions)

    def plain(prompts, completions, answer):  # no **kwargs: gets no log_extra
        return [1.0] * len(completions)

    scorer = RewardScorer([logs, plain], timeout_s=5.0, max_failures=3)
    scores = scorer.score(PROMPTS, COMPLETIONS, [[1]] * 4, {"answer": [1] * 4})
    assert scores.totals == [1.5] * 4 and scores.faults == []
    assert scores.extras == {"length": [1, 1, 1, 1]}


def test_the_searcher_drops_and_counts_faulty_rewards(tiny_model, tokenizer):
    def half_nan(prompts, completions, **_):
        return [math.nan if i % 2 else 1.0 for i in range(len(completions))]

    config = RunConfig(policy={"max_new_tokens": 4},
                       train={"group_size": 4, "truncated": "penalize"})  # fmt: skip
    rows = [{"prompt": "Q1\n"}, {"prompt": "Q2\n"}]
    searcher = Searcher(tiny_model, tokenizer, rows, [half_nan], config)
    truncated = [False, False, False, False, False, True, False, False]
    out = Generation([[1]] * 8, [0.0] * 8, [[0.0]] * 8, truncated)
    _, totals, dropped = searcher._score([0] * 4 + [1] * 4, ["1"] * 8, out)
    # Truncated responses get the penalty whatever the reward says; the others need a reward.
    assert [t if not math.isnan(t) else None for t in totals] == [
        1.0, None, 1.0, None, 1.0, -1.0, 1.0, None
    ]  # fmt: skip
    assert dropped == 3
    [(name, reason, affected)] = searcher.take_reward_faults()
    assert name == "half_nan" and affected == 4 and "returned nan" in reason
    assert searcher.take_reward_faults() == []

    samples, stats = searcher.generate(num_prompts=2)  # a random policy: all truncated, all kept
    assert len(samples) + stats["reward_dropped"] == 8
    assert [s.seq for s in samples] == list(range(len(samples)))  # kept samples numbered densely


def _with_reward(monkeypatch, fn) -> None:
    """The run's task gains reward function `fn` next to its own."""
    original = tba.run.load_task

    def load_task(*args, **kwargs):
        task = original(*args, **kwargs)
        task.reward_fns = [*task.reward_fns, fn]
        return task

    monkeypatch.setattr(tba.run, "load_task", load_task)


def test_a_run_survives_a_flaky_reward_function(tmp_path, monkeypatch):
    calls = []

    def flaky_judge(prompts, completions, **_):
        calls.append(1)
        if len(calls) % 2:
            raise TimeoutError("judge service unavailable")
        return [0.0] * len(completions)

    _with_reward(monkeypatch, flaky_judge)
    run_dir = tmp_path / "run"
    overrides = [*FAST, f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}"]
    assert main(["train", *overrides, "train.max_steps=4"]) == 0
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["steps"] == 4
    assert summary["reward_dropped"] > 0
    [(kind, dropped)] = summary["reward_faults"].items()
    assert kind == "flaky_judge: raised TimeoutError: judge service unavailable" and dropped > 0
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "reward_fault" and e["function"] == "flaky_judge" for e in events)


def test_a_reward_function_that_always_fails_stops_the_run(tmp_path, monkeypatch, capsys):
    def broken(prompts, completions, **_):
        return None

    _with_reward(monkeypatch, broken)
    overrides = [*FAST, f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'r'}"]
    assert main(["train", *overrides, "searchers.max_reward_failures=2"]) == 1
    err = capsys.readouterr().err
    assert "reward function 'broken' failed on its last 2 calls" in err
    assert "returned None" in err


# ---------------------------------------------------------------------------- numerical faults


def test_a_non_finite_loss_skips_the_update(tiny_model, tokenizer):
    prompt = tokenizer("Q\n")["input_ids"]
    group = [
        Sample(0, prompt, tokenizer(t, add_special_tokens=False)["input_ids"], reward=1.0,
               ref_logp=ref, behaviour_logp=-1.0, behaviour_token_logps=[-1.0], version=0)
        for t, ref in [("1", -1.0), ("2", -math.inf)]
    ]  # fmt: skip
    trainer = Trainer(tiny_model, TrainConfig(learning_rate=1e-2, max_grad_norm=1.0),
                      pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip
    before = [p.detach().clone() for p in tiny_model.parameters()]
    metrics = trainer.step([group], beta=0.1)
    assert metrics["skipped"] == 1.0 and not math.isfinite(metrics["loss"])
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters()))
    assert trainer.optimizer.state == {}  # Adam's moments untouched
    assert trainer.skipped_steps == 1 and trainer.step_count == 1


def test_non_finite_steps_in_a_row_stop_the_run_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    def nan_loss(self, flat, beta, context):
        logp = torch.stack([p.sum() for p in self.model.parameters()]).sum()
        return logp * math.nan, {}

    monkeypatch.setattr(Trainer, "_loss", nan_loss)
    run_dir = tmp_path / "run"
    overrides = [*FAST, f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}"]
    assert main(["train", *overrides, "train.max_steps=10", "train.max_nonfinite_steps=3"]) == 1
    err = capsys.readouterr().err
    assert "not finite on 3 steps in a row" in err and "last good state" in err
    [checkpoint] = list_checkpoints(run_dir)
    assert load_checkpoint(checkpoint).step == 3
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["skipped"] for r in steps] == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------------- bad input


def test_a_missing_model_directory_is_named(tmp_path, capsys):
    assert main(["train", f"policy.model={tmp_path / 'nope'}", f"output_dir={tmp_path}/r"]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err


def test_an_existing_run_is_kept_unless_overwritten(tmp_path, capsys):
    run_dir = tmp_path / "run"
    overrides = [*FAST, f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}"]
    assert main(["train", *overrides, "train.max_steps=1"]) == 0
    assert main(["train", *overrides, "train.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert main(["train", *overrides, "train.max_steps=2", "--overwrite"]) == 0
    assert json.loads((run_dir / "eval.json").read_text())["steps"] == 2


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    real_save = tba.checkpoint.save_file
    saved = []

    def save_file(tensors, path):
        if len(saved) >= 2:  # the first checkpoint's two files fit, then the disk is full
            # What safetensors raises on a full disk: its own error, which is not an OSError.
            raise SafetensorError("Error while serializing: I/O error: No space left on device "
                                  "(os error 28)")  # fmt: skip
        saved.append(path)
        real_save(tensors, path)

    monkeypatch.setattr(tba.checkpoint, "save_file", save_file)
    run_dir = tmp_path / "run"
    overrides = [*FAST, f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}"]
    assert main(["train", *overrides, "train.max_steps=3", "checkpoint.every=1"]) == 0
    assert [p.name for p in list_checkpoints(run_dir)] == ["step000001"]
    assert load_checkpoint(list_checkpoints(run_dir)[0]).step == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step000001"]
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["steps"] == 3 and summary["checkpoint_failures"] == 3  # steps 2, 3 and exit
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "checkpoint_failed" and "No space" in e["error"] for e in events)


# -------------------------------------------------------------------------------------- safety


def test_the_verifier_never_evaluates_model_output(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("model output must never be evaluated")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    marker = tmp_path / "pwned"
    hostile = [
        f"__import__('os').system('touch {marker}')",
        "2+2",
        "#### 4; import os",
        "1e309",
        "9" * 5000,
    ]
    results = last_number_reward(["q"] * len(hostile), hostile, ["4"] * len(hostile))
    assert results == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert not marker.exists()


def test_checkpoints_hold_no_pickles(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    overrides = [*FAST, f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}"]
    assert main(["train", *overrides, "train.max_steps=1"]) == 0
    [checkpoint] = list_checkpoints(run_dir)
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        "buffer.json.gz", "model.safetensors", "optimizer.safetensors", "state.json",
    ]  # fmt: skip

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint must load without unpickling")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert load_checkpoint(checkpoint).step == 1


@pytest.mark.slow
def test_the_local_ray_instance_listens_on_loopback_only():
    with ray_session(load_config(None, ["ray.num_cpus=1"])):
        addresses = listening_addresses(descendants(os.getpid()))
    assert addresses, "found no listening socket of the Ray processes"
    for address in map(ipaddress.ip_address, addresses):
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is IPv4 loopback
        assert (mapped or address).is_loopback, address


@pytest.mark.slow
def test_ray_stays_on_loopback_when_the_script_imported_it_first():
    """A user's script that imports Ray before tba: the setting must still reach Ray."""
    script = (
        "import sys, ray\n"
        "from tba.config import load_config\n"
        "from tba.runtime.ray_cluster import ray_session\n"
        "with ray_session(load_config(None, ['ray.num_cpus=1'])):\n"
        "    print('up', flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "up"
        addresses = listening_addresses(descendants(child.pid))
    finally:
        child.communicate("\n", timeout=60)
    assert addresses, "found no listening socket of the Ray processes"
    for address in map(ipaddress.ip_address, addresses):
        mapped = getattr(address, "ipv4_mapped", None)
        assert (mapped or address).is_loopback, address


def descendants(root: int) -> set[int]:
    """`root` and every process below it, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier += children
    return found


def listening_addresses(pids: set[int]) -> set[str]:
    """Local addresses of the TCP sockets in LISTEN state that these processes hold."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addresses.add(_address(fields[1].split(":")[0], family))
    return addresses


def _address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


# ------------------------------------------- a run's directory, devices, paths, value types


LOCKS = Path(tba.locks.__file__)
HOLDER = """
import importlib.util, pathlib, sys, time
spec = importlib.util.spec_from_file_location("locks", sys.argv[1])
locks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(locks)
locks.FileLock(pathlib.Path(sys.argv[2])).acquire()
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    """A tiny policy, rows and reward functions (`benchmarks.faults`)."""
    return Workspace(tmp_path / "ws")


def hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding `path`'s lock (tba.locks alone: no torch to import)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(LOCKS), str(path)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_start_is_refused_while_the_first_runs_and_a_dead_ones_lock_is_not(
    workspace, tmp_path, capsys
):  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = {"config.yaml": "seed: 0\n", "metrics.jsonl": '{"step": 0}\n'}  # no checkpoint yet
    for name, text in first.items():
        (run_dir / name).write_text(text)
    holder = hold_lock(run_dir / LOCK_FILE)
    settings = [*TINY_RUN, *workspace.task(), f"output_dir={run_dir}"]
    try:
        assert main(["train", *settings]) == 2
        err = capsys.readouterr().err
        assert f"run directory {run_dir} is in use by process {holder.pid}" in err
        assert len(err.strip().splitlines()) == 1
        assert main(["train", *settings, "--overwrite"]) == 2
        assert main(["train", "--resume", str(run_dir)]) == 2
        assert "is in use by process" in capsys.readouterr().err
        config = TBAConfig.from_overrides([*TINY_RUN, f"output_dir={run_dir}"])
        with pytest.raises(RunBusyError, match=f"process {holder.pid}"):
            TBATrainer(str(workspace.policy), ones, args=config,
                       train_dataset=[{"prompt": "Q\n"}]).train()  # fmt: skip
        assert {name: (run_dir / name).read_text() for name in first} == first
    finally:
        holder.kill()  # SIGKILL: its lock is left behind, held by no one
        holder.wait()
    assert (run_dir / LOCK_FILE).exists()
    assert main(["train", *settings]) == 0
    assert json.loads((run_dir / "eval.json").read_text())["steps"] == 3
    assert not (run_dir / LOCK_FILE).exists()  # let go at exit


def test_a_lock_file_held_by_no_one_is_taken_and_a_held_one_is_named(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text(json.dumps({"pid": 999999999, "host": "elsewhere"}))  # a dead holder's
    with FileLock(path):
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(Locked, match=f"locked by process {os.getpid()}"):
            FileLock(path).acquire()
    assert not path.exists()


def test_concurrent_builds_into_one_cache_build_once(tmp_path):
    """Seeds started together on a fresh machine: one builds, the others wait and use it."""
    built, waited = [], []

    def waiting() -> int:  # "another process" where the holder's record was read mid-write
        return sum(line.startswith("waiting for ") for line in waited)

    def build(staging: Path) -> None:
        built.append(staging)
        deadline = time.time() + 30  # until the others have found the build under way
        while waiting() < 2 and time.time() < deadline:
            time.sleep(0.01)
        staging.mkdir()
        (staging / "config.json").write_text("{}")

    target = tmp_path / "cache" / "model"
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: built_once(target, "config.json", "a model", build,
                                                   log=waited.append), range(3)))  # fmt: skip
    assert paths == [target] * 3 and len(built) == 1
    assert waiting() == 2
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]  # no .partial, no lock


def test_devices_this_machine_lacks_are_one_line_before_anything_starts(workspace, tmp_path):
    config = TBAConfig.from_overrides([*TINY_RUN, f"output_dir={tmp_path / 'run'}",
                                       "policy.device=cuda:99"])  # fmt: skip
    trainer = TBATrainer(str(workspace.policy), ones, args=config,
                         train_dataset=[{"prompt": "Q\n"}])  # fmt: skip
    with pytest.raises(ConfigError, match="policy.device=cuda:99: this machine has"):
        trainer.train()
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"policy.device: a device is auto .*\(got 'gpu'\)"):
        TBAConfig(policy={"device": "gpu"})
    with pytest.raises(ConfigError, match="task.reward_device=cuda needs searchers.num_gpus > 0"):
        load_config(None, ["task.reward_device=cuda", "searchers.num_gpus=0"])  # they see none
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"searchers.device=cuda needs searchers.num_gpus > "
                           r"0 \(`auto` gave 0: this machine has no CUDA device\)"):
            check_devices(load_config(None, ["searchers.device=cuda"]))
        for settings in (["searchers.count=0", "train.mode=sync", "searchers.device=cuda"],
                         ["searchers.num_gpus=1"], ["policy.device=cuda"]):
            with pytest.raises(ConfigError, match="this machine has no CUDA device"):
                check_devices(load_config(None, settings))


@pytest.mark.parametrize(("settings", "cuda", "expected"), [
    (["searchers.count=2"], True, 1 / 3),  # the trainer's GPU shared three ways
    (["searchers.count=1"], True, 1 / 2),
    (["searchers.count=2"], False, 0.0),
    (["searchers.count=2", "ray.address=auto"], True, 0.0),
    (["searchers.count=2", "searchers.device=cpu"], True, 0.0),
    (["searchers.count=0", "train.mode=sync"], True, 0.0),
    (["searchers.count=2", "searchers.num_gpus=0.5"], False, 0.5),
])  # fmt: skip
def test_searchers_share_the_trainers_gpu_by_default(monkeypatch, settings, cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    config = load_config(None, settings)
    assert config.searchers.num_gpus == (0.5 if "searchers.num_gpus=0.5" in settings else "auto")
    assert searcher_gpus(config)[0] == pytest.approx(expected)


@pytest.mark.parametrize("returned", [
    torch.tensor([1.0, 0.0, 2.0, 3.0]), np.array([1, 0, 2, 3]), (1.0, 0.0, 2.0, 3.0),
    [np.float32(1.0), np.bool_(False), torch.tensor(2.0), np.int64(3)],
])  # fmt: skip
def test_rewards_of_every_type_trl_takes_are_numbers(returned):
    def typed(prompts, completions, **_):
        return returned

    scores = score(typed)
    assert scores.totals == [2.0, 1.0, 3.0, 4.0] and scores.faults == []


def test_boolean_arrays_and_none_entries_are_rewards_too_and_only_non_numbers_drop():
    def bools(prompts, completions, **_):
        return torch.tensor([True, False, True, False])

    def some(prompts, completions, **_):
        return np.array([1.0, None, 2.0, None], dtype=object)

    assert score(bools).totals == [2.0, 1.0, 2.0, 1.0]
    assert score(some).totals == [2.0, 1.0, 3.0, 1.0] and score(some).faults == []
    scores = score(lambda prompts, completions, **_: torch.tensor(1.0))
    assert all(math.isnan(t) for t in scores.totals)
    assert "returned a Tensor, not a list" in scores.faults[0][1]
    # Values that are no number (here tensors of two values) are the function's bug: a stop.
    with pytest.raises(RewardError, match=r"returned tensor\(\[1., 1.\]\), a Tensor, for 4 of 4"):
        score(lambda prompts, completions, **_: [torch.ones(2)] * 4)


def test_a_tba_trainer_trains_on_tensor_rewards(workspace, tmp_path):
    def tensor_reward(completions, **_):
        return torch.tensor([len(c) % 3 for c in completions], dtype=torch.float32)

    config = TBAConfig.from_overrides([*TINY_RUN, f"output_dir={tmp_path / 'run'}"])
    rows = [{"prompt": f"Q{i}\n"} for i in range(8)]
    results = TBATrainer(str(workspace.policy), tensor_reward, args=config,
                         train_dataset=rows).train()  # fmt: skip
    assert results["steps"] == 3 and results["reward_dropped"] == 0
    assert results["reward_faults"] == {} and math.isfinite(results["final"]["eval_reward"])


def test_output_dirs_that_cannot_be_used_are_one_line(workspace, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    for output_dir, message in [
        (notes, "notes.txt is a file, not a directory: choose another output_dir"),
        (notes / "run", "notes.txt is a file, not a directory; choose another output_dir"),
    ]:
        config = TBAConfig.from_overrides([*TINY_RUN, f"output_dir={output_dir}"])
        trainer = TBATrainer(str(workspace.policy), ones, args=config,
                             train_dataset=[{"prompt": "Q\n"}])  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            trainer.train()
    assert notes.read_text() == "mine\n"
    with pytest.raises(ConfigError, match="train_dataset: a datasets.Dataset.*got a int \\(42\\)"):
        TBATrainer(str(workspace.policy), ones, args=config, train_dataset=42)


def test_an_evaluation_failing_on_every_row_stops_the_run_at_once(workspace, tmp_path):
    def needs_answer(completions, answer, **_):  # the held-out rows have no `answer`
        return [float(a in c) for c, a in zip(completions, answer)]

    config = TBAConfig.from_overrides([*TINY_RUN, f"output_dir={tmp_path / 'run'}"])
    trainer = TBATrainer(str(workspace.policy), ones, args=config, eval_func=needs_answer,
                         train_dataset=[{"prompt": f"Q{i}\n"} for i in range(8)])  # fmt: skip
    with pytest.raises(RewardError, match="held-out evaluation: 'needs_answer' failed on all 4 "
                       "completions: raised TypeError"):  # fmt: skip
        trainer.train()


def test_tba_eval_of_a_function_failing_on_every_row_is_an_error_not_nan(workspace, tmp_path,
                                                                         capsys):  # fmt: skip
    run_dir = tmp_path / "run"
    settings = [*TINY_RUN, *workspace.task("works", "works"), f"output_dir={run_dir}"]
    assert main(["train", *settings]) == 0
    capsys.readouterr()
    assert main(["eval", str(run_dir), f"task.eval_func={workspace.rewards}:raises"]) == 1
    err = capsys.readouterr().err
    assert "held-out evaluation: 'raises' failed on all 4 completions: raised ValueError" in err
    assert not (run_dir / "eval_final.json").exists()


def test_a_partial_or_passing_evaluation_fault_is_an_event_not_the_end():
    events = []
    faults = EvalFaults(lambda kind, **fields: events.append(fields))
    faults("judge", "returned nan (not a finite number) for 3 completions", 3, 4)
    faults.evaluation_done()  # a partial failure: counted
    faults("judge", "raised KeyError: 'answer'", 4, 4)
    with pytest.raises(RewardError, match="'judge' failed on all 4 completions: raised KeyError"):
        faults.evaluation_done()
    assert [e["failed"] for e in events] == [3, 4]

    calls = []

    def cold_start(prompts, completions, **_):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("judge warming up")
        return [1.0] * len(completions)

    scorer = RewardScorer([cold_start], call_again=True)
    scores = scorer.score(PROMPTS, COMPLETIONS, [[1]] * 4, {})
    assert scores.totals == [1.0] * 4  # called once more: a whole evaluation is not lost
    assert scores.faults == [("cold_start", "raised ConnectionError: judge warming up (then "
                              "worked, called again)", 0)]  # fmt: skip


def test_a_refused_resume_builds_no_task_world(workspace, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *TINY_RUN, *workspace.task(), f"output_dir={run_dir}"]) == 0

    def load_task(*args, **kwargs):
        raise AssertionError("the task was loaded before the checkpoint was checked")

    monkeypatch.setattr(tba.run, "load_task", load_task)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "task.num_train=3"]) == 2
    assert "task.num_train=5000 (this run: 3); a checkpoint" in capsys.readouterr().err
