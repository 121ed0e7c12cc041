"""A real pretrained model on this machine's CPU: SmolLM2-135M-Instruct (`pypi:smollm2-135m-
instruct`, 49,152-token vocabulary), generating and training as a searcher and the trainer do,
under each setting that decides a CPU's speed.

- generation: B math prompts in chat form x K samples of up to L new tokens (the prompt's prefill
  shared by its K samples), per (policy.dtype, policy.sampler, torch threads): tokens/s and
  samples/s, best of R after a warm-up (which compiles, for `compiled`);
- train step: one TB step on those samples, per policy.dtype (fp32 master weights either way):
  train tokens/s (prompt and response), best of R after a warm-up;
- the draw of one decode step's tokens from B x K rows of logits over the whole vocabulary:
  `torch.multinomial` (one random number a vocabulary entry) against `draw_tokens` (one a row,
  what both samplers use), median milliseconds.

bf16 pays on a CPU only where it multiplies bf16 natively (AVX512-BF16 or AMX): the table says
which instructions this CPU has.

    python -m benchmarks.cpu_speed                      # B x K = 4 x 8, 48 new tokens
    python -m benchmarks.cpu_speed --small              # the built-in policy: a quick try
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.engines import measure_decode
from tba.config import PretrainConfig, TrainConfig
from tba.core import Sample
from tba.policy.decoding import draw_tokens, log_probs_at
from tba.policy.model import load_policy
from tba.policy.sampling import LoopSampler
from tba.policy.tokenizer import encode_prompts, load_tokenizer
from tba.quiet import quiet_libraries
from tba.tasks import resolve_policy
from tba.tasks.math.task import math_task
from tba.trainer import Trainer

SETTINGS = [  # (dtype, sampler, threads) of the generation rows
    ("float32", "loop", 1), ("float32", "loop", 2), ("float32", "static", 2),
    ("float32", "compiled", 2), ("bfloat16", "loop", 2), ("bfloat16", "static", 2),
    ("bfloat16", "compiled", 2),
]  # fmt: skip


def cpu_flags() -> str:
    """The bf16 matrix instructions this CPU has (from /proc/cpuinfo)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    found = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in flags]
    return ", ".join(found) or "none of avx2, avx512f, avx512_bf16, amx_bf16"


def chat_prompts(tokenizer, count: int, chat: bool) -> list[list[int]]:
    rows = math_task(num_train=count, num_eval=1, seed=0).train_rows
    return encode_prompts(tokenizer, [row["prompt"] for row in rows], chat_template=chat)


def timings(repeats: int, work) -> list[float]:
    """Seconds of each of `repeats` calls of `work` after a warm-up one."""
    work()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return seconds


def measure_generation(model, tokenizer, rows, sampler: str, args) -> dict:
    """tokens/s and samples/s of `benchmarks.engines`' measurement (a warm-up, best of R)."""
    result = measure_decode(sampler, model, rows, tokenizer.eos_token_id, tokenizer.pad_token_id,
                            args)  # fmt: skip
    return {"tokens_per_s": result["tokens_per_s"],
            "samples_per_s": result["tokens_per_s"] / result["tokens_per_sample"]}  # fmt: skip


def sample_batch(model, tokenizer, rows, args):
    """The responses a train step trains on, sampled once."""
    with torch.no_grad():
        return LoopSampler(model).generate(
            rows, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(0), max_new_tokens=args.max_new_tokens)


def measure_draw(rows: int, vocab_size: int, repeats: int = 20) -> dict:
    """Median ms of one step's draw from `rows` x `vocab_size` logits: `torch.multinomial`
    against `draw_tokens` (the log-softmax before either is left out: both need it)."""
    generator = torch.Generator().manual_seed(0)
    log_probs = log_probs_at(torch.randn(rows, vocab_size, generator=generator), 1.0)
    draws = {
        "torch.multinomial": lambda: torch.multinomial(log_probs.exp(), 1, generator=generator),
        "draw_tokens": lambda: draw_tokens(log_probs, torch.rand(
            (rows, 1), dtype=torch.float64, generator=generator)),
    }  # fmt: skip
    return {name: 1e3 * statistics.median(timings(repeats, draw)) for name, draw in draws.items()}


def measure_train(model, tokenizer, prompts, args) -> dict:
    rows = [p for p in prompts for _ in range(args.group_size)]
    out = sample_batch(model, tokenizer, rows, args)
    groups = [[Sample(i // args.group_size, rows[i], list(out.response_ids[i]),
                      reward=float(i % 2), ref_logp=float(out.logps[i]),
                      behaviour_logp=float(out.logps[i]), version=0,
                      behaviour_token_logps=list(out.token_logps[i]))
               for i in range(g * args.group_size, (g + 1) * args.group_size)]
              for g in range(len(prompts))]  # fmt: skip
    trainer = Trainer(model.train(), TrainConfig(learning_rate=1e-7),
                      pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip
    seconds = min(timings(args.repeats, lambda: trainer.step(groups, beta=0.05)))
    model.eval()
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g)
    return {"train_tokens_per_s": tokens / seconds, "step_seconds": seconds}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pypi:smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=4, help="B")
    parser.add_argument("--group-size", type=int, default=8, help="K")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="L")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="the built-in policy, tiny batch")
    parser.add_argument("--samplers", nargs="+", default=["loop", "static", "compiled"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if args.small:
        args.model, args.num_prompts, args.group_size, args.max_new_tokens = "builtin:math", 2, 2, 8
        args.repeats = 1
    quiet_libraries()
    path = str(resolve_policy(args.model, PretrainConfig(), seed=0, log=lambda *_: None))
    chat = args.model.startswith("pypi:")
    tokenizer = load_tokenizer(path, chat_template=chat)
    prompts = chat_prompts(tokenizer, args.num_prompts, chat)
    print(f"{args.model} on {torch.get_num_threads()} CPU threads available ({cpu_flags()}); "
          f"B x K = {args.num_prompts} x {args.group_size}, up to {args.max_new_tokens} new "
          f"tokens, best of {args.repeats} after a warm-up\n")  # fmt: skip
    print("| what | policy.dtype | policy.sampler | threads | tokens/s | samples/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    results, batch = [], [p for p in prompts for _ in range(args.group_size)]
    threads = torch.get_num_threads()
    for dtype, sampler, count in SETTINGS:
        if sampler not in args.samplers or dtype not in args.dtypes or count > threads:
            continue
        torch.set_num_threads(count)
        model = load_policy(path, "cpu", dtype=dtype).eval()
        result = measure_generation(model, tokenizer, batch, sampler, args)
        results.append({"what": "generation", "dtype": dtype, "sampler": sampler,
                        "threads": count, **result})  # fmt: skip
        print(f"| generation | {dtype} | {sampler} | {count} | {result['tokens_per_s']:.0f} | "
              f"{result['samples_per_s']:.2f} |", flush=True)  # fmt: skip
    torch.set_num_threads(threads)
    for dtype in args.dtypes:
        model = load_policy(path, "cpu", dtype=dtype)
        result = measure_train(model, tokenizer, prompts, args)
        results.append({"what": "train step", "dtype": dtype, "threads": threads, **result})
        print(f"| train step | {dtype} | | {threads} | {result['train_tokens_per_s']:.0f} | "
              f"({result['step_seconds']:.1f} s a step) |", flush=True)  # fmt: skip
    vocab_size = model.get_output_embeddings().out_features  # the last train step's model
    draw = measure_draw(len(batch), vocab_size)
    results.append({"what": "draw", "rows": len(batch), "vocab_size": vocab_size, **draw})
    print(f"\nA decode step's draw from {len(batch)} x {vocab_size:,} logits ({threads} threads, "
          "median ms): " + ", ".join(f"{name} {ms:.2f}" for name, ms in draw.items()))
    return results


if __name__ == "__main__":
    main()
