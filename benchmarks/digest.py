"""What the check that searchers hold the weights they were sent costs (`tba.runtime.transfer.
digest`): on the trainer's side, the digest of each version it publishes (read from the bucket
set it has just written); on a searcher's, the digest of its model after it took a version;
each against the publish itself (the copy of the model into the trainer's buckets), medians of
`--repeats`, in one process.

Models: the built-in policy, and a Qwen2.5-0.5B-shaped model with random weights (fp32 on a
CPU, bf16 on a GPU); `--small` uses tiny shapes.

    python -m benchmarks.digest              # on the GPU if there is one
    python -m benchmarks.digest --small
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.shapes import qwen_config, random_qwen
from tba.policy.model import build_tiny_llama
from tba.policy.tokenizer import build_char_tokenizer
from tba.runtime.transfer.buckets import BucketSets
from tba.runtime.transfer.digest import Fingerprint


def models(small: bool, device: torch.device) -> dict[str, torch.nn.Module]:
    tokenizer = build_char_tokenizer()
    sizes = dict(hidden_size=32, num_layers=2, num_heads=2) if small else {}
    builtin = build_tiny_llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, **sizes)  # fmt: skip
    name = "narrow" if small else "qwen2.5-0.5b"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = qwen_config(name, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return {"built-in policy": builtin.to(device),
            f"{name} shape": random_qwen(config, device, dtype)}  # fmt: skip


def median_seconds(work, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model: torch.nn.Module, repeats: int, device: torch.device) -> dict[str, float]:
    sets = BucketSets(model)
    try:
        fingerprint = Fingerprint(model)
        versions = iter(range(1, 10**6))
        publish = median_seconds(lambda: sets.publish(next(versions), 0), repeats, device)
        with sets.newest_set() as (_, _, buckets):
            trainer = median_seconds(lambda: fingerprint.of_buckets(buckets), repeats, device)
        searcher = median_seconds(fingerprint, repeats, device)
        assert fingerprint() == fingerprint.of_buckets(sets.sets[sets.version % 2])
    finally:
        sets.close()
    return {"mib": sets.nbytes / 2**20, "publish_s": publish, "trainer_s": trainer,
            "searcher_s": searcher}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    print(f"{args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"medians of {args.repeats}\n")
    print("| model | MiB published | publish (copy into the buckets) | digest, trainer (from the "
          "buckets) | digest, searcher (from its model) | trainer's share of a publish |")
    print("|---|---|---|---|---|---|")
    for name, model in models(args.small, device).items():
        row = {"model": name, **measure(model, args.repeats, device)}
        rows.append(row)
        print(f"| {name} | {row['mib']:,.1f} | {row['publish_s'] * 1e3:.3f} ms | "
              f"{row['trainer_s'] * 1e3:.3f} ms | {row['searcher_s'] * 1e3:.3f} ms | "
              f"{row['trainer_s'] / row['publish_s']:.1%} |")
    return rows


if __name__ == "__main__":
    main()
