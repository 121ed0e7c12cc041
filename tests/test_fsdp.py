"""The sharded trainer (`tba.runtime.fsdp`) against the one-process `Trainer`: N gloo ranks in
processes of their own, started here with `torch.multiprocessing` (the run starts them as Ray
actors, `tests/test_sharded_cli.py`). Same batches, same settings: the losses and the weights
after several steps must agree up to the order of floating-point sums, and a checkpoint must
continue exactly on the same number of ranks and closely on another."""

from __future__ import annotations

import math
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tba.config import TrainConfig
from tba.core import Sample
from tba.policy import logprobs
from tba.policy.model import build_tiny_llama, get_weights
from tba.runtime.fsdp import ShardedTrainer, held_bytes, split_batch
from tba.trainer import Trainer

STEPS = 5
VOCAB = 40


def make_model() -> torch.nn.Module:
    return build_tiny_llama(VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            hidden_size=32, num_layers=2, num_heads=2, seed=0)  # fmt: skip


def make_batch(step: int, num_groups: int = 5, group_size: int = 3) -> list[list[Sample]]:
    """Groups of different prompts and response lengths, rewards and behaviour log-probs drawn
    from `step`'s own seed."""
    rng = np.random.default_rng(step)
    groups = []
    for prompt_id in range(num_groups):
        prompt = [1, *rng.integers(3, VOCAB, size=2 + prompt_id % 3).tolist()]
        group = []
        for _ in range(group_size):
            response = rng.integers(3, VOCAB, size=int(rng.integers(1, 6))).tolist()
            logp = float(-rng.uniform(5, 15))
            behaviour = logp + float(rng.normal(0, 0.1))
            per_token = [behaviour / len(response)] * len(response)
            group.append(Sample(prompt_id, prompt, response, reward=float(rng.random()),
                                ref_logp=logp, behaviour_logp=behaviour, version=0,
                                behaviour_token_logps=per_token))  # fmt: skip
        groups.append(group)
    return groups


def settings(case: str) -> dict:
    common = dict(learning_rate=1e-2, max_grad_norm=0.5, warmup_steps=2)
    if case == "micro_batches":  # uneven shares: one rank runs a padding pass
        common |= dict(micro_batch_groups=1)
    if case.startswith("learned_log_z"):
        common |= dict(tb={"log_z": "learned", "log_z_lr": 0.1})
    return dict(settings=TrainConfig(**common), pad_id=0, temperature=1.0)


def start_log_z(trainer, case: str) -> None:
    """The learned log Z from a fixed bias, not from the first batch's mean: right after that
    start its bias's gradient is zero in exact arithmetic, and Adam turns the rounding of a mean
    summed in another order (all-reduced over ranks) into a step of +-log_z_lr of either sign."""
    if case == "learned_log_z":
        log_z = trainer.providers["learned_log_z"]
        with torch.no_grad():
            log_z.head.bias.fill_(-8.0)
        log_z.ready = True


def train_steps(trainer, steps: range, rank: int | None = None, world: int = 1) -> list[dict]:
    stats = []
    for step in steps:
        groups = make_batch(step)
        if rank is None:
            stats.append(trainer.step(groups, beta=0.5))
            continue
        shares, micro_batches = split_batch(groups, world, trainer.micro_batch_groups)
        total = sum(len(group) for group in groups)
        stats.append(trainer.step_share(shares[rank], 0.5, total=total,
                                        num_micro_batches=micro_batches))  # fmt: skip
    return stats


def rank_main(rank: int, world: int, work: str, case: str, plan: list) -> None:
    """One rank: join the group, then for each (action, steps, directory) of `plan` train,
    save or load; rank 0 writes what it saw after each action to `work`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous-{world}",
                            rank=rank, world_size=world)  # fmt: skip
    param_dtype = torch.bfloat16 if case == "bf16_compute" else None
    trainer = ShardedTrainer(make_model(), param_dtype=param_dtype, **settings(case))
    start_log_z(trainer, case)
    out = []
    for action, first, last, directory in plan:
        if action == "train":
            stats = train_steps(trainer, range(first, last), rank, world)
            out.append({"stats": stats, "weights": trainer.weights(),
                        "bytes": held_bytes(trainer)})  # fmt: skip
        elif action == "save":
            rest = trainer.save_shards(directory)
            torch.save(rest, Path(directory) / f"rest-{rank}.pt")
        else:
            rest = torch.load(Path(directory) / "rest-0.pt", weights_only=False)
            trainer.load_shards(directory, rest)
    if rank == 0:
        torch.save(out, Path(work) / f"out-{world}.pt")
    # Every rank leaves together, and skips the interpreter's teardown: gloo's threads can abort
    # a process there ("terminate called without an active exception"), after its work is done
    # and its results are written.
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run_ranks(world: int, work: Path, case: str, plan: list) -> list[dict]:
    work.mkdir(exist_ok=True)
    mp.spawn(rank_main, args=(world, str(work), case, plan), nprocs=world, join=True)
    return torch.load(work / f"out-{world}.pt", weights_only=False)


def one_process(case: str, steps: range) -> tuple[list[dict], dict[str, np.ndarray]]:
    """The same steps in one process, with the log-probs computed as the ranks compute them:
    from the full logits (a sharded output layer takes that path). The chunked computation
    rounds differently, and Adam turns rounding differences in gradients that are zero in exact
    arithmetic (the learned log Z's bias, right after it is set to the batch's mean) into steps
    of the full learning rate."""
    torch.manual_seed(0)
    trainer = Trainer(make_model(), **settings(case))
    start_log_z(trainer, case)
    with mock.patch.object(logprobs, "output_layer", lambda model: None):
        return train_steps(trainer, steps), get_weights(trainer.model)


def max_relative_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in a)


def assert_same_training(sharded: list[dict], single: list[dict], tolerance: float) -> None:
    for mine, theirs in zip(sharded, single, strict=True):
        for key in ("loss", "grad_norm", "clip_factor", "log_z_mean", "ratio_out_frac"):
            if key in theirs:
                assert math.isclose(mine[key], theirs[key], rel_tol=tolerance, abs_tol=1e-6), key


@pytest.mark.parametrize("case", ["whole_shares", "micro_batches", "learned_log_z"])
def test_two_ranks_train_as_one_process_does(tmp_path, case):
    sharded = run_ranks(2, tmp_path, case, [("train", 0, STEPS, None)])[0]
    single_stats, single_weights = one_process(case, range(STEPS))
    assert all(s["clip_factor"] < 1 for s in single_stats[:1])  # the global-norm clip is tested
    assert_same_training(sharded["stats"], single_stats, 1e-5)
    difference = max_relative_difference(sharded["weights"], single_weights)
    print(f"{case}: weights after {STEPS} steps, max relative difference {difference:.1e}")
    assert difference < 1e-5
    # Each rank holds about half of the parameters and of Adam's two moments.
    held = sharded["bytes"]
    total = sum(w.nbytes for w in single_weights.values())
    assert 0.4 * total < held["parameters"] < 0.6 * total
    assert 0.8 * total < held["optimizer"] < 1.2 * total


def test_a_learned_log_z_starts_at_the_mean_over_every_rank(tmp_path):
    """Its bias starts at the whole batch's mean however the batch is split: the first step is one
    process's (after it, see `start_log_z`)."""
    case = "learned_log_z_from_mean"
    sharded = run_ranks(2, tmp_path, case, [("train", 0, 1, None)])[0]
    single_stats, _ = one_process(case, range(1))
    assert_same_training(sharded["stats"], single_stats, 1e-5)


def test_bf16_compute_keeps_fp32_masters_and_publishes_bf16(tmp_path):
    sharded = run_ranks(2, tmp_path, "bf16_compute", [("train", 0, STEPS, None)])[0]
    single_stats, single_weights = one_process("whole_shares", range(STEPS))
    assert math.isclose(sharded["stats"][0]["loss"], single_stats[0]["loss"], rel_tol=5e-2)
    assert all(math.isfinite(s["loss"]) and not s["skipped"] for s in sharded["stats"])
    # Published in bf16 (as int16 bits); the shards stay fp32: 4 bytes a parameter per rank.
    assert {w.dtype for w in sharded["weights"].values()} == {np.dtype("int16")}
    total = sum(w.nbytes for w in single_weights.values())
    assert 0.4 * total < sharded["bytes"]["parameters"] < 0.6 * total


def test_sharded_checkpoint_continues_exactly_and_on_another_number_of_ranks(tmp_path):
    case, saved = "whole_shares", str(tmp_path / "checkpoint")
    straight = run_ranks(2, tmp_path, case, [("train", 0, 2, None), ("save", 0, 0, saved),
                                            ("train", 2, STEPS, None)])[-1]  # fmt: skip
    resumed = run_ranks(2, tmp_path / "again", case, [("load", 0, 0, saved),
                                                     ("train", 2, STEPS, None)])[0]  # fmt: skip
    assert max_relative_difference(resumed["weights"], straight["weights"]) == 0.0
    assert resumed["stats"] == [{**s, **{k: r[k] for k in r if k.endswith(("_seconds", "_per_s"))}}
                                for s, r in zip(straight["stats"], resumed["stats"])]  # fmt: skip
    resharded = run_ranks(3, tmp_path / "three", case, [("load", 0, 0, saved),
                                                       ("train", 2, STEPS, None)])[0]  # fmt: skip
    assert max_relative_difference(resharded["weights"], straight["weights"]) < 1e-5


def test_split_batch_keeps_groups_whole_and_every_rank_in_step():
    groups = make_batch(0, num_groups=5)
    shares, micro_batches = split_batch(groups, 2, 1)
    assert [len(share) for share in shares] == [3, 2] and micro_batches == 3
    assert [g for share in shares for g in share] == groups
    assert split_batch(groups, 2, None)[1] == 1
