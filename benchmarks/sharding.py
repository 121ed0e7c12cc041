"""The sharded trainer's memory and time per rank, against the one-process trainer, on a random
Llama-shaped model: bytes of parameters, gradients and Adam's state each rank holds, its peak
RSS, the step time, and the time to gather the full weights for a publish.

Each configuration runs in fresh processes: `--ranks N` starts N gloo ranks on this machine
(`torch.multiprocessing`, the same `ShardedTrainer` the run's Ray actors hold), each with
`--threads / N` torch threads; "1 (unsharded)" is today's one-process `Trainer`.

    python -m benchmarks.sharding                          # ~110M parameters, N = 1, 2, 4
    python -m benchmarks.sharding --ranks 1 2 --publish-sizes 30m 110m 250m

Publish: the full state dict gathered onto rank 0 (`ShardedTrainer.weights`), against reading
the weights of one unsharded model (`get_weights`), for each of `--publish-sizes` on 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.memory import create_model, fake_groups, peak_rss_mib
from tba.config import TrainConfig
from tba.policy.model import get_weights, load_policy
from tba.policy.tokenizer import load_tokenizer
from tba.runtime.fsdp import ShardedTrainer, held_bytes, split_batch
from tba.trainer import Trainer

SIZES = {  # name: (width, layers)
    "30m": (384, 6),
    "110m": (768, 12),
    "250m": (1024, 16),
}
MIB = 2**20


def settings(tokenizer) -> dict:
    return dict(settings=TrainConfig(learning_rate=1e-5, max_grad_norm=1.0),
                pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip


def timed_steps(step, steps: int) -> float:
    """Median seconds of `steps` calls of `step`, the first (warm-up) left out."""
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def unsharded(model_dir: str, args: argparse.Namespace, out: Path) -> None:
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(model_dir)
    trainer = Trainer(load_policy(model_dir, "cpu", dtype="float32"), **settings(tokenizer))
    groups = fake_groups(tokenizer, args.num_prompts, args.group_size, args.length)
    step_s = timed_steps(lambda: trainer.step(groups, beta=0.05), args.steps)
    start = time.perf_counter()
    get_weights(trainer.model)
    publish_s = time.perf_counter() - start
    result = {"held": held_bytes(trainer), "peak_mib": peak_rss_mib(), "step_s": step_s,
              "publish_s": publish_s}  # fmt: skip
    out.write_text(json.dumps([result]))


def sharded_rank(rank: int, world: int, model_dir: str, args: argparse.Namespace,
                 out: Path) -> None:  # fmt: skip
    torch.set_num_threads(max(1, args.threads // world))
    dist.init_process_group("gloo", init_method=f"file://{out}.rendezvous", rank=rank,
                            world_size=world)  # fmt: skip
    tokenizer = load_tokenizer(model_dir)
    trainer = ShardedTrainer(load_policy(model_dir, "cpu", dtype="float32"), **settings(tokenizer))
    groups = fake_groups(tokenizer, args.num_prompts, args.group_size, args.length)
    shares, micro_batches = split_batch(groups, world, None)
    total = sum(len(group) for group in groups)

    def step() -> None:
        trainer.step_share(shares[rank], 0.05, total=total, num_micro_batches=micro_batches)
        dist.barrier()

    step_s = timed_steps(step, args.steps)
    start = time.perf_counter()
    trainer.weights()
    dist.barrier()
    publish_s = time.perf_counter() - start
    result = {"held": held_bytes(trainer), "peak_mib": peak_rss_mib(), "step_s": step_s,
              "publish_s": publish_s}  # fmt: skip
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(model_dir: str, ranks: int, args: argparse.Namespace, work: Path) -> list[dict]:
    """One result per rank (`ranks` 0: the unsharded trainer), each from a fresh process."""
    out = work / f"result-{Path(model_dir).name}-{ranks}"
    if ranks == 0:
        context = mp.get_context("spawn")
        process = context.Process(target=unsharded, args=(model_dir, args, out))
        process.start()
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"the unsharded measurement failed (exit {process.exitcode})")
        return json.loads(out.read_text())
    mp.spawn(sharded_rank, args=(ranks, model_dir, args, out), nprocs=ranks, join=True)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="110m")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--publish-sizes", nargs="*", choices=SIZES, default=["30m", "110m"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads, split over ranks")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--num-prompts", type=int, default=4, help="B")
    parser.add_argument("--group-size", type=int, default=4, help="K")
    parser.add_argument("--length", type=int, default=24, help="response tokens")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        done: dict[tuple[str, int], list[dict]] = {}

        def measured(name: str, ranks: int) -> list[dict]:
            if (name, ranks) not in done:
                done[name, ranks] = measure(model_dirs[name], ranks, args, work)
            return done[name, ranks]

        model_dirs = {}
        for name in {args.size, *args.publish_sizes}:
            width, layers = SIZES[name]
            model_dirs[name] = str(work / name)
            count = create_model(Path(model_dirs[name]), hidden_size=width, num_layers=layers)
            print(f"{name}: Llama-shaped, width {width}, {layers} layers, {count / 1e6:.0f}M "
                  "parameters (fp32 weights, Adam)")  # fmt: skip
        print(f"\nper rank, {args.size}; B={args.num_prompts}, K={args.group_size}, "
              f"{args.length} response tokens, {args.threads} torch threads in all\n")
        print("| ranks | parameters | gradients | Adam state | peak RSS, rank 0 | peak RSS, other "
              "ranks | step | publish |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for ranks in [0, *args.ranks]:
            results = measured(args.size, ranks)
            first = results[0]
            held = {key: max(r["held"][key] for r in results) / MIB for key in first["held"]}
            label = "1 (unsharded)" if ranks == 0 else str(ranks)
            others = f"{max(r['peak_mib'] for r in results[1:]):.0f} MiB" if ranks > 1 else ""
            print(f"| {label} | {held['parameters']:.0f} MiB | {held['gradients']:.0f} MiB | "
                  f"{held['optimizer']:.0f} MiB | {first['peak_mib']:.0f} MiB | {others} | "
                  f"{max(r['step_s'] for r in results):.2f} s | {first['publish_s']:.2f} s |",
                  flush=True)  # fmt: skip
        if args.publish_sizes:
            print("\npublish: full weights gathered onto rank 0 (2 ranks) against reading them "
                  "from one unsharded model\n")  # fmt: skip
            print("| model | weights | unsharded read | 2 ranks, gathered |")
            print("| --- | --- | --- | --- |")
            for name in args.publish_sizes:
                one = measured(name, 0)[0]
                two = measured(name, 2)[0]
                print(f"| {name} | {one['held']['parameters'] / MIB:.0f} MiB | "
                      f"{one['publish_s']:.3f} s | {two['publish_s']:.3f} s |", flush=True)


if __name__ == "__main__":
    main()
