"""Micro-batches bounded by tokens against padded ones, on a real model's responses of the lengths
it samples: the padded share of a train step and its speed, before and after.

SmolLM2-135M-Instruct (`pypi:smollm2-135m-instruct`) samples K responses of up to L new tokens
to each of B math prompts in chat form, once; then one process times TB train steps on that same
batch, each setting in turn within a round, best of R rounds after a warm-up of each:

- padded (`train.micro_batch_tokens` null, as before): the whole batch in one padded micro-batch,
  each prompt run once for its K responses (their KV cache shared), every response padded to
  the longest;
- each budget of `--budgets` (`train.micro_batch_tokens=N`; default: the batch's own tokens, so
  one micro-batch either way): micro-batches of whole groups within N tokens, their rows packed
  end to end where that runs fewer positions and the model keeps packed rows apart.

Gradient checkpointing is off (`--checkpointing`: on) in every row, so that the rows differ only
in their micro-batches. Per row: micro-batches a step, the padded share of the positions the
step's forward passes ran (`padded_frac`), train tokens/s (the batch's prompt and response tokens
over the step's seconds) and the step's seconds.

    python -m benchmarks.microbatches            # SmolLM2, B x K = 4 x 8, up to 64 new tokens
    python -m benchmarks.microbatches --small    # the built-in policy, 2 x 4, 16 tokens: a try
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.cpu_speed import chat_prompts, sample_batch
from tba.config import PretrainConfig, TrainConfig
from tba.core import Sample
from tba.policy.logprobs import packs_rows
from tba.policy.model import load_policy
from tba.policy.tokenizer import load_tokenizer
from tba.quiet import quiet_libraries
from tba.tasks import resolve_policy
from tba.trainer import Trainer, micro_batch_runs


def sampled_groups(model, tokenizer, args: argparse.Namespace) -> list[list[Sample]]:
    """B groups of K responses the model samples (seeded), with their own log-probs as the
    behaviour's and the reference's, and rewards of both kinds in every group."""
    prompts = chat_prompts(tokenizer, args.num_prompts, args.chat)
    rows = [p for p in prompts for _ in range(args.group_size)]
    out = sample_batch(model.eval(), tokenizer, rows, args)
    model.train()
    return [[Sample(i // args.group_size, rows[i], list(out.response_ids[i]),
                    reward=float(i % 2), ref_logp=float(out.logps[i]),
                    behaviour_logp=float(out.logps[i]), version=0,
                    behaviour_token_logps=list(out.token_logps[i]))
             for i in range(g * args.group_size, (g + 1) * args.group_size)]
            for g in range(len(prompts))]  # fmt: skip


def timed_rows(model, pad_id: int, groups: list[list[Sample]],
               args: argparse.Namespace) -> list[dict]:  # fmt: skip
    """Each setting's step: the fewest seconds of R rounds (the settings in turn within each
    round, after a warm-up step of each), and that step's padded share."""
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g)
    budgets = [None, *(args.budgets or [tokens])]
    trainers = [Trainer(model, TrainConfig(learning_rate=1e-7, micro_batch_tokens=budget,
                                           gradient_checkpointing=args.checkpointing),
                        pad_id=pad_id, temperature=1.0)
                for budget in budgets]  # fmt: skip
    rows = [{"budget": budget, "micro_batches": len(micro_batch_runs(groups, None, budget)),
             "seconds": [], "tokens": tokens} for budget in budgets]  # fmt: skip
    for round_ in range(args.repeats + 1):  # the first: the warm-up
        for trainer, row in zip(trainers, rows):
            start = time.perf_counter()
            stats = trainer.step(groups, beta=0.05)
            if round_:
                row["seconds"].append(time.perf_counter() - start)
                row["padded_frac"] = stats["padded_frac"]
    for row in rows:
        row["step_seconds"] = min(row["seconds"])
        row["tokens_per_s"] = tokens / row["step_seconds"]
    return rows


def print_table(rows: list[dict]) -> None:
    print("| micro-batches | train.micro_batch_tokens | micro-batches a step | padded_frac | "
          "train tokens/s | step seconds |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        name = "padded (before)" if row["budget"] is None else "token budget (after)"
        budget = "null" if row["budget"] is None else f"{row['budget']:,}"
        print(f"| {name} | {budget} | {row['micro_batches']} | {row['padded_frac']:.1%} | "
              f"{row['tokens_per_s']:.0f} | {row['step_seconds']:.2f} |", flush=True)  # fmt: skip
    before = rows[0]
    for row in rows[1:]:
        print(f"\nbudget {row['budget']:,}: padded share {before['padded_frac']:.1%} -> "
              f"{row['padded_frac']:.1%}, train tokens/s x"
              f"{row['tokens_per_s'] / before['tokens_per_s']:.2f}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pypi:smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", help="policy.dtype")
    parser.add_argument("--num-prompts", type=int, default=4, help="B")
    parser.add_argument("--group-size", type=int, default=8, help="K")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="L")
    parser.add_argument("--budgets", type=int, nargs="+",
                        help="train.micro_batch_tokens of the rows after the padded one "
                        "(default: the batch's tokens)")  # fmt: skip
    parser.add_argument("--checkpointing", action="store_true",
                        help="gradient checkpointing on in every row")
    parser.add_argument("--repeats", type=int, default=3, help="R")
    parser.add_argument("--small", action="store_true",
                        help="the built-in policy, B x K = 2 x 4, 16 new tokens, R = 1")
    args = parser.parse_args(argv)
    if args.small:
        args.model, args.num_prompts, args.group_size = "builtin:math", 2, 4
        args.max_new_tokens, args.repeats = 16, 1
    args.chat = args.model.startswith("pypi:")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    quiet_libraries()
    path = str(resolve_policy(args.model, PretrainConfig(), seed=0, log=lambda *_: None))
    tokenizer = load_tokenizer(path, chat_template=args.chat)
    model = load_policy(path, "cpu", dtype=args.dtype)
    groups = sampled_groups(model, tokenizer, args)
    lengths = [len(s.response_ids) for g in groups for s in g]
    prompts = [len(g[0].prompt_ids) for g in groups]
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} CPU threads; B x K = "
          f"{args.num_prompts} x {args.group_size}; prompts of {min(prompts)}-{max(prompts)} "
          f"tokens; responses of {min(lengths)}-{max(lengths)} tokens (mean "
          f"{statistics.mean(lengths):.1f}, up to {args.max_new_tokens}); gradient "
          f"checkpointing {'on' if args.checkpointing else 'off'}; the model keeps packed rows "
          f"apart: {packs_rows(model)}; best of {args.repeats}\n")  # fmt: skip
    rows = timed_rows(model, tokenizer.pad_token_id, groups, args)
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
