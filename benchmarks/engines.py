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

`--decode` measures instead the built-in engine's generators in one process, each after a warm-up
generation (which compiles, and records CUDA graphs), best of R: its loop (`policy.sampler=loop`),
its static path eager (`static`) and compiled (`compiled`), Hugging Face's `generate` with its
dynamic cache and with its static cache compiled, and the decode roofline: B x K rows divided by
the time to read the weights once and each row's KV cache at its average length, at the measured
copy bandwidth of the device (`--bandwidth-gbs` to give it). Models: the built-in policy and a
random-weight model of Qwen2.5-0.5B's shape (896 wide, 24 layers, 14 heads, 2 KV heads, 151,936
tokens, tied embeddings) on 72-token random prompts, B x K = 8 x 16, 256 new tokens.

    python -m benchmarks.engines                       # both engines (vLLM when installed)
    python -m benchmarks.engines --engines builtin --models builtin 10m
    python -m benchmarks.engines --models 110m --lora-rank 16   # a LoRA policy: merged into vLLM
    python -m benchmarks.engines --agreement
    python -m benchmarks.engines --decode              # on a GPU: bf16
    python -m benchmarks.engines --decode --small      # the tiny model: a try on a CPU
    python -m benchmarks.engines --decode --methods loop static roofline   # nothing compiled
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig, Qwen2Config, Qwen2ForCausalLM

from tba.config import LoraConfig, PolicyConfig, VllmEngineSettings, load_config
from tba.config.engines import engine_settings
from tba.errors import first_line
from tba.policy.batching import left_pad
from tba.policy.engines import ENGINES, VllmEngine
from tba.policy.logprobs import token_logprobs
from tba.policy.model import build_tiny_llama, get_weights, load_policy, set_weights
from tba.policy.sampling import LoopSampler, StaticSampler
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


def vllm_settings(model, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """vLLM's own settings here: a KV cache sized for the batch, the benchmark's dtype."""
    return {"kv_cache_gb": kv_cache_gb(model, prompts, args.max_new_tokens), "dtype": args.dtype,
            "enforce_eager": args.enforce_eager}  # fmt: skip


def measure(args: argparse.Namespace) -> dict:
    """One engine on one model, in this process, started as a searcher starts it."""
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.model_dir)
    prompts = batch(args.model_dir, args.num_prompts, args.group_size)
    start = time.time()
    lora = LoraConfig(r=args.lora_rank) if args.lora_rank else None
    model = load_policy(args.model_dir, device, dtype=args.dtype, lora=lora)
    own = {"vllm": vllm_settings(model, prompts, args)}.get(args.measure, {})
    engine = ENGINES[args.measure].start(
        model, tokenizer, seed=0, model_dir=args.model_dir, policy=PolicyConfig(dtype=args.dtype),
        settings=engine_settings({"type": args.measure, **own}),
    )  # fmt: skip
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
    settings = VllmEngineSettings(**vllm_settings(model, prompts, args))
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


def apply_defaults(args: argparse.Namespace) -> None:
    """The defaults of the chosen mode, for every option left unset."""
    decode = args.decode or args.small
    small = dict(models=["tiny"], num_prompts=4, group_size=4, max_new_tokens=16, repeats=1)
    defaults = dict(
        models=["builtin", "qwen0.5b"] if decode else list(MODELS),
        dtype="bfloat16" if decode and args.device.startswith("cuda") else "float32",
        num_prompts=8, group_size=16, max_new_tokens=256 if decode else 40, repeats=3,
    )  # fmt: skip
    for key, value in (defaults | small if args.small else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.decode = decode
    unknown = set(args.models) - set(DECODE_MODELS if decode else MODELS)
    if unknown:
        raise SystemExit(f"--models: {', '.join(sorted(unknown))} is not a model of this mode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["builtin", "vllm"])
    parser.add_argument("--models", nargs="+", choices=list(MODELS) + list(DECODE_MODELS),
                        help="default: builtin 10m 110m; with --decode builtin qwen0.5b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="default: float32; with --decode bfloat16 on CUDA")
    parser.add_argument("--num-prompts", type=int, help="B (default 8)")
    parser.add_argument("--group-size", type=int, help="K (default 16)")
    parser.add_argument("--max-new-tokens", type=int, help="L (default 40; --decode: 256)")
    parser.add_argument("--repeats", type=int, help="R timed generations (default 3)")
    parser.add_argument("--decode", action="store_true",
                        help="the built-in engine's generators against Hugging Face's and the "
                        "decode roofline (one process)")
    parser.add_argument("--methods", nargs="+", default=DECODE_METHODS, choices=DECODE_METHODS,
                        help="--decode: the generators to measure")
    parser.add_argument("--prompt-length", type=int, default=72,
                        help="--decode: tokens per prompt of the random-weight models")
    parser.add_argument("--bandwidth-gbs", type=float,
                        help="--decode: the roofline's memory bandwidth (default: measured copy)")
    parser.add_argument("--small", action="store_true",
                        help="--decode on the tiny model, B=4 x K=4, 16 tokens, one repeat: "
                        "seconds on a CPU (plus compilation)")
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
    apply_defaults(args)
    if args.decode:
        print_decode(args)
        return
    if args.measure:
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


# ---------------------------------------------------------------------------- --decode

# name: the Qwen2 config fields of a random-weight model (None: the built-in policy). qwen0.5b is
# Qwen2.5-0.5B's public config; tiny is for trying the benchmark on a CPU in seconds.
DECODE_MODELS = {
    "builtin": None,
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                     tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                     max_position_embeddings=32768),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=1024,
                 tie_word_embeddings=True),
}  # fmt: skip
DECODE_METHODS = ["loop", "static", "compiled", "hf", "hf-static", "roofline"]
DECODE_LABELS = {
    "loop": "tba loop (`policy.sampler=loop`)",
    "static": "tba static cache, eager (`static`)",
    "compiled": "tba static cache, compiled (`compiled`)",
    "hf": "HF generate, dynamic cache",
    "hf-static": "HF generate, static cache + torch.compile",
    "roofline": "decode roofline",
}


def decode_model(name: str, device: torch.device, dtype: str):
    """(model, EOS id, pad id, vocabulary size of a random-weight model or None)."""
    if DECODE_MODELS[name] is None:
        model_dir = create_model("builtin", Path())
        tokenizer = load_tokenizer(model_dir)
        model = load_policy(model_dir, device, dtype=dtype)
        return model, tokenizer.eos_token_id, tokenizer.pad_token_id, None
    torch.manual_seed(0)
    config = Qwen2Config(**DECODE_MODELS[name], eos_token_id=2, pad_token_id=0, bos_token_id=1)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=getattr(torch, dtype)).eval()
    return model, 2, 0, config.vocab_size


def decode_prompts(args: argparse.Namespace, vocab_size: int | None) -> list[list[int]]:
    """B prompts x K samples: held-out math prompts (built-in policy) or random token ids of
    `--prompt-length` tokens (random-weight models)."""
    if vocab_size is None:
        model_dir = create_model("builtin", Path())
        return batch(model_dir, args.num_prompts, args.group_size)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab_size, (args.num_prompts, args.prompt_length),
                            generator=generator).tolist()  # fmt: skip
    return [prompt for prompt in prompts for _ in range(args.group_size)]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the decode step's limit."""
    source = torch.empty(2**28 if device.type == "cuda" else 2**26, dtype=torch.uint8,
                         device=device)  # fmt: skip
    target = torch.empty_like(source)
    best = math.inf
    for _ in range(5):
        synchronize(device)
        begin = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - begin)
    return 2 * source.numel() / best


def roofline(model, prompts: list[list[int]], new_tokens: int, bandwidth: float) -> float:
    """Tokens/s if every decode step only read the weights once and each row's KV cache at its
    average length, at `bandwidth` bytes/s."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
                 * next(model.parameters()).element_size())  # fmt: skip
    context = sum(len(p) for p in prompts) + len(prompts) * new_tokens / 2
    return len(prompts) / ((weights + context * per_token) / bandwidth)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(model, prompts, eos_id: int, pad_id: int, new_tokens: int, static: bool):
    """Hugging Face's `generate`, sampling from the full softmax at temperature 1 as tba does
    (no top-k or top-p); `static`: its static cache, compiled (on a CPU too)."""
    device = next(model.parameters()).device
    ids, mask, _ = left_pad(prompts, pad_id, device)
    options = {}
    if static:
        compile_config = CompileConfig(fullgraph=True)
        compile_config._compile_all_devices = True  # transformers compiles on CUDA only, else
        options = dict(cache_implementation="static", compile_config=compile_config)
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
        top_p=1.0, max_new_tokens=new_tokens, eos_token_id=eos_id, pad_token_id=pad_id,
        **options,
    )  # fmt: skip
    generated = out[:, ids.size(1) :]
    ended = (generated == eos_id).int().cumsum(-1)
    return int(((ended == 0) | ((ended == 1) & (generated == eos_id))).sum())


def decode_generator(method: str, model, eos_id: int, pad_id: int, args):
    """A function that generates the batch and returns how many tokens it generated."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(0)
    if method in ("hf", "hf-static"):
        return lambda prompts: hf_generate(model, prompts, eos_id, pad_id, args.max_new_tokens,
                                           static=method == "hf-static")  # fmt: skip
    sampler = (LoopSampler(model) if method == "loop"
               else StaticSampler(model, compile=method == "compiled"))  # fmt: skip

    def run(prompts):
        out = sampler.generate(prompts, eos_id=eos_id, pad_id=pad_id, generator=generator,
                               max_new_tokens=args.max_new_tokens)  # fmt: skip
        return sum(len(ids) for ids in out.response_ids)

    return run


def measure_decode(method: str, model, prompts, eos_id: int, pad_id: int, args) -> dict:
    """Warm-up (the first generation: compiles, records CUDA graphs), then the best of R."""
    device = next(model.parameters()).device
    run = decode_generator(method, model, eos_id, pad_id, args)

    def timed() -> tuple[float, int]:
        synchronize(device)
        begin = time.perf_counter()
        with torch.no_grad():
            tokens = run(prompts)
        synchronize(device)
        return time.perf_counter() - begin, tokens

    warm_up, _ = timed()
    seconds, tokens = min(timed() for _ in range(args.repeats))
    return {"warm_up_s": warm_up, "tokens_per_s": tokens / seconds,
            "tokens_per_sample": tokens / len(prompts)}  # fmt: skip


def print_decode(args: argparse.Namespace) -> None:
    """The generators side by side on each model, in this process."""
    device = torch.device(args.device)
    bandwidth = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, {torch.get_num_threads()} threads, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {args.dtype}; B={args.num_prompts} prompts x "
          f"K={args.group_size} samples, {args.max_new_tokens} new tokens, temperature 1; "
          f"roofline at {bandwidth / 1e9:.0f} GB/s ({'given' if args.bandwidth_gbs else 'copy'})"
          "\n")  # fmt: skip
    print("| model | generator | warm-up | tokens/s | tokens/sample | vs the loop |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model_name in args.models:
        model, eos_id, pad_id, vocab_size = decode_model(model_name, device, args.dtype)
        prompts = decode_prompts(args, vocab_size)
        loop_rate = None
        for method in args.methods:
            label = DECODE_LABELS[method]
            if method == "roofline":
                rate = roofline(model, prompts, args.max_new_tokens, bandwidth)
                ratio = f"{rate / loop_rate:.0f}x" if loop_rate else "-"
                print(f"| {model_name} | {label} | - | {rate:,.0f} | - | {ratio} |", flush=True)
                continue
            try:
                r = measure_decode(method, model, prompts, eos_id, pad_id, args)
            except Exception as error:  # one failed generator does not end the table
                print(f"| {model_name} | {label} | failed: {first_line(error)[:100]} ||||",
                      flush=True)  # fmt: skip
                continue
            loop_rate = r["tokens_per_s"] if method == "loop" else loop_rate
            ratio = f"{r['tokens_per_s'] / loop_rate:.2f}x" if loop_rate else "-"
            print(f"| {model_name} | {label} | {r['warm_up_s']:.1f} s | {r['tokens_per_s']:,.0f} "
                  f"| {r['tokens_per_sample']:.0f} | {ratio} |", flush=True)  # fmt: skip
        del model


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
