"""The searchers' two generation engines, `builtin` and `vllm`, on the same models and prompts:
samples/s and tokens/s, the engine's start time, the time to adopt new weights, peak memory.

Models: the built-in math policy (0.8M parameters) and two random-weight Llama-shaped models with
its character tokenizer (~10M: width 320, 6 layers; ~110M: width 768, 12 layers). Random weights
rarely sample EOS, so almost every response runs to the length limit: the rate is that of full
length responses. Each engine and model is measured in a fresh process (peak memory is that
process's `ru_maxrss`, or on a GPU `torch.cuda.max_memory_allocated`):

- start: `load_policy` (builtin) or `vllm.LLM(...)` (vllm), to the first generation;
- generation: B prompts x K samples of up to L tokens, after one warm-up generation, best of R;
- weight update: what a searcher does per published version: the weights into its Hugging Face
  copy of the policy (both engines) and, for vLLM, into the running engine (`reload_weights`).

`--agreement` measures instead the train/inference mismatch on the built-in policy: the trainer's
log-prob of every token vLLM sampled against vLLM's own sampling log-prob, at two temperatures,
then again after new weights went into the running engine.

    python -m benchmarks.engines                       # both engines (vLLM when installed)
    python -m benchmarks.engines --engines builtin --models builtin 10m
    python -m benchmarks.engines --models 110m --lora-rank 16   # a LoRA policy: merged into vLLM
    python -m benchmarks.engines --agreement
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tba.config import LoraConfig, load_config
from tba.policy.engines import BuiltinEngine, VllmEngine, VllmSettings
from tba.policy.logprobs import token_logprobs
from tba.policy.model import build_tiny_llama, get_weights, load_policy, set_weights
from tba.policy.tokenizer import build_char_tokenizer, load_tokenizer
from tba.tasks import resolve_policy
from tba.tasks.math import world

# name: (width, layers, heads); None: the built-in policy.
MODELS = {"builtin": None, "10m": (320, 6, 10), "110m": (768, 12, 12)}


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def batch(model_dir: str, num_prompts: int, group_size: int) -> list[list[int]]:
    """B held-out math prompts, each repeated K times (what a searcher generates per batch)."""
    tokenizer = load_tokenizer(model_dir)
    texts = [world.format_prompt(p.question) for p in world.problems("test", num_prompts, seed=0)]
    return [tokenizer(text)["input_ids"] for text in texts for _ in range(group_size)]


def kv_cache_gb(model, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Room for every sequence of a batch at its full length, twice over."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    tokens = sum(len(p) + max_new_tokens for p in prompts)
    return max(0.25, 2 * tokens * per_token / 2**30)


def measure(args: argparse.Namespace) -> dict:
    """One engine on one model, in this process."""
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.model_dir)
    prompts = batch(args.model_dir, args.num_prompts, args.group_size)
    start = time.time()
    lora = LoraConfig(r=args.lora_rank) if args.lora_rank else None
    model = load_policy(args.model_dir, device, dtype=args.dtype, lora=lora)
    if args.engine == "vllm":
        settings = VllmSettings(kv_cache_gb=kv_cache_gb(model, prompts, args.max_new_tokens),
                                dtype=args.dtype, enforce_eager=args.enforce_eager)  # fmt: skip
        engine = VllmEngine(args.model_dir, tokenizer.eos_token_id, seed=0, settings=settings)
    else:
        engine = BuiltinEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)
    started = time.time() - start

    def generate() -> tuple[float, int]:
        begin = time.time()
        out = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.time() - begin, sum(len(ids) for ids in out.response_ids)

    generate()  # warm-up
    seconds, tokens = min(generate() for _ in range(args.repeats))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(1e-3)
    weights = get_weights(model)  # what a trainer publishes (with LoRA: the adapters)
    begin = time.time()
    set_weights(model, weights)
    engine.load_weights(model)
    update = time.time() - begin
    return {
        "start_s": started, "gen_s": seconds, "samples_per_s": len(prompts) / seconds,
        "tokens_per_s": tokens / seconds, "tokens_per_sample": tokens / len(prompts),
        "update_s": update, "peak_mib": peak_memory_mib(device),
    }  # fmt: skip


def gaps(engine: VllmEngine, model, prompts: list[list[int]], pad_id: int, args) -> dict:
    """|trainer log-prob - vLLM's sampling log-prob| over every token vLLM sampled."""
    out = engine.generate(prompts, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature)  # fmt: skip
    with torch.no_grad():
        ours, _ = token_logprobs(model, prompts, out.response_ids, pad_id=pad_id,
                                 temperature=args.temperature)  # fmt: skip
    rows = [(ours[row, : len(lps)].double(), torch.tensor(lps, dtype=torch.float64))
            for row, lps in enumerate(out.token_logps)]  # fmt: skip
    trainer = torch.cat([t for t, _ in rows])
    gap = torch.cat([(t - v).abs() for t, v in rows])
    position = torch.cat([torch.arange(len(t)) for t, _ in rows])
    worst = int(gap.argmax())
    sequence = torch.stack([(t - v).sum().abs() for t, v in rows])
    return {
        "tokens": gap.numel(), "mean": gap.mean().item(), "median": gap.median().item(),
        "p99": gap.quantile(0.99).item(), "max": gap.max().item(),
        "max_at_position": int(position[worst]), "max_token_logp": trainer[worst].item(),
        "low_prob_mean": gap[trainer < -5].mean().item() if (trainer < -5).any() else None,
        "sequence_mean": sequence.mean().item(),
    }  # fmt: skip


def measure_agreement(args: argparse.Namespace) -> dict:
    """vLLM against the trainer at equal weights, then after an update of the running engine."""
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.model_dir)
    prompts = batch(args.model_dir, args.num_prompts, args.group_size)
    model = load_policy(args.model_dir, device, dtype=args.dtype)
    settings = VllmSettings(kv_cache_gb=kv_cache_gb(model, prompts, args.max_new_tokens),
                            dtype=args.dtype, enforce_eager=args.enforce_eager)  # fmt: skip
    engine = VllmEngine(args.model_dir, tokenizer.eos_token_id, seed=0, settings=settings)
    before = gaps(engine, model, prompts, tokenizer.pad_token_id, args)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * parameter.std() * torch.randn_like(parameter))
    engine.load_weights(model)
    after = gaps(engine, model, prompts, tokenizer.pad_token_id, args)
    # The control: the weights from before the update no longer fit what the engine samples.
    old = gaps(engine, load_policy(args.model_dir, device, dtype=args.dtype), prompts,
               tokenizer.pad_token_id, args)  # fmt: skip
    return {"equal weights": before, "after an update": after,
            "after an update, against the old weights": old}  # fmt: skip


def create_model(name: str, directory: Path) -> str:
    """The model's directory (the built-in policy's own, or a random Llama written there)."""
    if MODELS[name] is None:
        config = load_config(None, [])
        return str(resolve_policy(config.policy.model, config.pretrain, 0, print))
    width, layers, heads = MODELS[name]
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(
        len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, hidden_size=width, num_layers=layers,
        num_heads=heads, max_positions=512, seed=0,
    )  # fmt: skip
    path = directory / name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def run_one(args: argparse.Namespace, engine: str, model_dir: str) -> dict:
    command = [
        sys.executable, "-m", "benchmarks.engines", "--measure", engine, "--model-dir", model_dir,
        "--device", args.device, "--dtype", args.dtype, "--num-prompts", str(args.num_prompts),
        "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
        "--repeats", str(args.repeats), "--temperature", str(args.temperature),
        "--lora-rank", str(args.lora_rank),
        *(["--enforce-eager"] if args.enforce_eager else []),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:120]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def vllm_installed() -> bool:
    done = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["builtin", "vllm"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=8, help="B")
    parser.add_argument("--group-size", type=int, default=16, help="K")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="L")
    parser.add_argument("--repeats", type=int, default=3, help="R timed generations")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters of this rank (0: every weight)")
    parser.add_argument("--agreement", action="store_true",
                        help="vLLM's sampling log-probs against the trainer's (needs vLLM)")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs")
    # Internal: one measurement in this process.
    parser.add_argument("--measure", choices=["builtin", "vllm", "agreement"])
    parser.add_argument("--model-dir")
    args = parser.parse_args()
    if args.measure:
        args.engine = args.measure
        print(json.dumps(measure_agreement(args) if args.measure == "agreement" else measure(args)))
        return
    if args.agreement:
        print_agreement(args)
        return

    engines = [e for e in args.engines if e != "vllm" or vllm_installed()]
    if len(engines) < len(args.engines):
        print("vLLM is not installed: the builtin engine only (pip install 'tba[vllm]')\n")
    print(f"{args.device}, {torch.get_num_threads()} threads, {args.dtype}; "
          f"B={args.num_prompts} prompts x K={args.group_size} samples, "
          f"up to {args.max_new_tokens} tokens, temperature 1"
          + (f"; LoRA r={args.lora_rank} (merged into vLLM's weights)" if args.lora_rank else "")
          + "\n")  # fmt: skip
    print("| model | engine | start | samples/s | tokens/s | tokens/sample | weight update "
          "| peak memory |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = create_model(name, Path(tmp))
            for engine in engines:
                r = run_one(args, engine, model_dir)
                if "error" in r:
                    print(f"| {name} | {engine} | failed: {r['error']} |||||||", flush=True)
                    continue
                print(f"| {name} | {engine} | {r['start_s']:.1f} s | {r['samples_per_s']:.0f} | "
                      f"{r['tokens_per_s']:.0f} | {r['tokens_per_sample']:.0f} | "
                      f"{r['update_s']:.2f} s | {r['peak_mib']:.0f} MiB |", flush=True)  # fmt: skip


def print_agreement(args: argparse.Namespace) -> None:
    model_dir = create_model("builtin", Path())
    print(f"The built-in policy, {args.device}, {args.dtype}; B={args.num_prompts} x "
          f"K={args.group_size} samples of up to {args.max_new_tokens} tokens; per token "
          "|trainer log-prob - vLLM sampling log-prob|\n")
    print("| weights | temperature | tokens | mean | median | p99 | max | max at (position, "
          "log-prob) | mean where log-prob < -5 | mean per sequence (sum) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for temperature in (1.0, 0.7):
        args.temperature = temperature
        results = run_one(args, "agreement", model_dir)
        if "error" in results:
            print(f"| failed: {results['error']} |")
            continue
        for weights, r in results.items():
            low = f"{r['low_prob_mean']:.1e}" if r["low_prob_mean"] is not None else "-"
            print(f"| {weights} | {temperature} | {r['tokens']} | {r['mean']:.1e} | "
                  f"{r['median']:.1e} | {r['p99']:.1e} | {r['max']:.1e} | "
                  f"({r['max_at_position']}, {r['max_token_logp']:.2f}) | {low} | "
                  f"{r['sequence_mean']:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
