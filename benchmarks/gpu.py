"""What tba does on one GPU, in one command: at most 8 minutes on one H100 or H200, no download
(models from public configurations with random weights; the embedded task's base policy built
where it runs), vLLM not needed, Ray optional.

Parts (`--parts`, all by default):

- sync: the embedded math task, synchronous, the searcher in the trainer process
  (`train.mode=sync searchers.count=0`), for `--minutes` of training: held-out greedy pass@1
  against time, samples/s, and what a step is made of (generation, weight hand-off, update).
- async: the same task asynchronously, 2 searchers as Ray actors beside the trainer (on a GPU
  sharing it: `searchers.num_gpus=auto`, a third of it each): the same, and how stale the
  trained samples were.
  Skipped, in one line, when Ray is not installed.
- model: a Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
  4864, vocabulary 151,936, tied embeddings, rope theta 1e6; random weights) in bf16 through
  `TBATrainer`, synchronous, B=8 prompts x K=16 responses of 256 new tokens: the step's parts,
  train tokens/s and MFU (6 * parameters * tokens over the card's dense bf16 peak), peak memory.
- model-async: that model the same way, asynchronously, with 2 searchers as Ray actors on the
  trainer's GPU (a third of it each), against the synchronous `model` part: samples/s, the
  trainer's idle share (waiting for samples over the step), staleness. Skipped, in one line,
  when Ray is not installed.
- sampling: that model writing 128 x 256 tokens with `benchmarks.engines`' generators: tba's
  samplers (its loop, and the compiled one a searcher uses on a GPU) against Hugging Face
  `generate` (dynamic cache; static cache + `torch.compile`), and the decode roofline (every
  weight and the mean KV cache read once per decoding step, at the card's memory bandwidth).
- handoff: that model's weights from the trainer to a searcher's copy through host memory
  (`get_weights` + `set_weights`: the object store's path), against a device-to-device copy of
  every parameter; the trainer's publish into its shared buckets (a copy on the device: what it
  blocks for when searchers on its GPU take the weights by CUDA IPC, `tba.runtime.
  weight_buckets`); and whether the synchronous in-process searcher samples with the trainer's
  own module (no hand-off at all). `python -m benchmarks.handoff` measures the searcher's side
  of each path, through Ray.

It writes `gpu.md` (the table) and `gpu.json` (every figure, and the seconds each part took)
into `--out` and prints the table last. The 8 minutes are an estimate from the figures of
docs/results/gpu.md: 2 x 2 minutes of training and their start-ups, about 2.5 minutes for the
model's four parts, and the base policy's build where it is not cached (`--minutes` shortens the
embedded runs). `--small` runs the same with tiny shapes and short runs (on a CPU: under 3
minutes).

    python -m benchmarks.gpu                           # one GPU, <= 8 minutes
    python -m benchmarks.gpu --small                   # a CPU, tiny shapes
    python -m benchmarks.gpu --parts model,sampling    # some parts only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import Qwen2ForCausalLM

from benchmarks.common import run_logged
from benchmarks.engines import copy_bandwidth, measure_decode, roofline
from benchmarks.shapes import qwen_config, random_qwen
from tba import TBAConfig, TBATrainer
from tba.config import load_config
from tba.errors import first_line
from tba.policy.model import get_weights, set_weights
from tba.policy.tokenizer import build_char_tokenizer
from tba.quiet import quiet_libraries
from tba.run_dir import read_metrics
from tba.runtime.placement import shares_trainer_model
from tba.runtime.weight_buckets import WeightBuckets
from tba.tasks import resolve_policy
from tba.tasks.math import world
from tba.trainer import Trainer, trainer_settings

PARTS = {
    "sync": "embedded math task, synchronous (searcher in the trainer process)",
    "async": "embedded math task, asynchronous, 2 searchers (Ray actors) beside the trainer",
    "model": "Qwen2.5-0.5B-shaped random model through TBATrainer, synchronous",
    "model-async": "that model asynchronously, 2 searchers (Ray actors) on the trainer's GPU",
    "sampling": "sampling that model: tba's samplers, HF generate (dynamic; static + compile)",
    "handoff": "weight hand-off of that model against a device-to-device copy",
}


@dataclass(frozen=True)
class Shape:
    """A model of Qwen2.5-0.5B's architecture and the batch it trains and samples."""

    changes: dict  # to Qwen2.5-0.5B's public configuration (none: that model's shape)
    num_prompts: int  # B
    group_size: int  # K
    new_tokens: int
    steps: int  # TBATrainer steps; the first is a warm-up, left out of the averages
    micro_batch_groups: int
    async_steps: int  # steps of the asynchronous run (its searchers start while it waits)


SHAPES = {
    "qwen2.5-0.5b": Shape({}, 8, 16, 256, steps=4, micro_batch_groups=4, async_steps=12),
    "tiny": Shape(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, vocab_size=4096),
                  2, 4, 16, steps=3, micro_batch_groups=1, async_steps=4),
}  # fmt: skip

# The embedded task at a size that runs in seconds on a CPU (--small): its own tiny base policy.
SMALL_TASK = [
    "pretrain.num_examples=64", "pretrain.steps=4", "pretrain.batch_size=16",
    "task.num_train=64", "task.num_eval=16", "task.num_eval_pass_k=4", "eval.pass_k=2",
    "train.num_prompts=2", "train.group_size=4", "policy.max_new_tokens=12",
]  # fmt: skip

# Dense bf16 tensor-core peak (FLOP/s) and memory bandwidth (bytes/s) by the name CUDA reports,
# from NVIDIA's data sheets; the most specific name first.
CARDS = [
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", 835e12, 3.9e12),
    ("H100", 989e12, 3.35e12),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("H200 NVL", 835e12, 4.8e12),
    ("H200", 989e12, 4.8e12),  # SXM
    ("A100", 312e12, 2.0e12),  # 80 GB SXM
]


def card(device: torch.device) -> tuple[str, float | None, float | None]:
    """(name, bf16 peak FLOP/s, memory bytes/s) of the device; None where not known."""
    if device.type != "cuda":
        return "CPU", None, None
    name = torch.cuda.get_device_name(device)
    for key, flops, bandwidth in CARDS:
        if key in name:
            return name, flops, bandwidth
    return name, None, None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float:
    """The most this process held: on a GPU in tensors, on a CPU in resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ------------------------------------------------------------------ the embedded task (a, b)


def base_policy(small: bool, out: Path) -> dict:
    """The embedded task's base policy, built here if it is not cached (the runs then use it)."""
    config = load_config(None, small_task(small, out))
    start = time.time()
    built = []
    path = resolve_policy(config.policy.model, config.pretrain, config.seed,
                          lambda message: built.append(message))  # fmt: skip
    return {"path": str(path), "seconds": time.time() - start, "built": bool(built)}


def small_task(small: bool, out: Path) -> list[str]:
    return [*SMALL_TASK, f"pretrain.cache_dir={out / 'cache'}"] if small else []


def run_embedded(mode: str, args: argparse.Namespace) -> dict:
    """`tba train` for `--minutes` of training in its own process, as a user runs it; its
    held-out pass@1 every tenth of the run, its throughput and staleness."""
    overrides = [f"train.max_minutes={args.minutes}",
                 f"eval.every_minutes={args.minutes / 10:.4g}"]  # fmt: skip
    if mode == "sync":
        overrides += ["train.mode=sync", "searchers.count=0"]
    else:
        # On a GPU, `searchers.num_gpus=auto` (the default) puts both beside the trainer.
        overrides += ["train.mode=async", "searchers.count=2"]
    if args.small:
        overrides += ["policy.num_threads=1", *small_task(True, args.out)]
        if mode == "async":  # train once one batch is in: the searchers start slowly on 2 cores
            overrides.append("train.initial_buffer_samples=8")
    run_dir = args.out / mode
    command = [sys.executable, "-m", "tba.cli", "train", *overrides, f"output_dir={run_dir}",
               "--overwrite"]  # fmt: skip
    start = time.time()
    try:
        run_logged(command, run_dir)
    except subprocess.CalledProcessError:
        raise RuntimeError(last_line(args.out / f"{mode}.log")) from None
    return embedded_results(run_dir) | {"wall_seconds": time.time() - start,
                                        "overrides": overrides}  # fmt: skip


def embedded_results(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "eval.json").read_text())
    records = read_metrics(run_dir / "metrics.jsonl")
    curve = [(r["time"] / 60, r["eval_pass@1"]) for r in records if "eval_pass@1" in r]
    # Steps without an evaluation, what training alone is made of (all, if every step had one).
    steps = [r for r in records if "loss" in r]
    steps = [r for r in steps if "eval_pass@1" not in r] or steps
    parts = ("step_seconds", "wait_seconds", "sync_seconds", "train_seconds")
    trained = max(summary.get("groups_trained", 0), 1)
    return {
        "base": summary["base"]["eval_pass@1"], "final": summary["final"]["eval_pass@1"],
        "curve": curve, "steps": summary["steps"], "train_minutes": summary["train_minutes"],
        "samples_per_s": summary["samples_per_s"],
        "staleness_steps_mean": summary.get("staleness_steps_mean"),
        "fresh_groups": summary.get("groups_fresh", 0) / trained,
        "samples_lost": summary.get("samples_lost"),
        "step": {key: float(np.mean([r[key] for r in steps])) for key in parts} if steps else {},
    }  # fmt: skip


# ---------------------------------------------------------- the Qwen2.5-0.5B-shaped model (c-e)


def qwen_model(shape: Shape, tokenizer, device: torch.device, seed: int = 0) -> Qwen2ForCausalLM:
    """Qwen2.5-0.5B's architecture (its public configuration, `benchmarks.shapes`) with
    `shape.changes`, random weights, bf16, made where it runs."""
    config = qwen_config("qwen2.5-0.5b", pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, **shape.changes)  # fmt: skip
    return random_qwen(config, device, torch.bfloat16, seed=seed)


def math_prompts(count: int) -> list[str]:
    return [world.format_prompt(p.question) for p in world.problems("train", count, seed=0)]


def even_token_share(completion_ids, **kwargs) -> list[float]:
    """A reward that varies from response to response of a random model: its share of even ids."""
    return [sum(token % 2 == 0 for token in ids) / max(len(ids), 1) for ids in completion_ids]


def measure_model(shape: Shape, device: torch.device, out: Path, mode: str = "sync") -> dict:
    """`TBATrainer`, synchronous (`shape.steps` steps: the mean step after the first) or
    asynchronous with 2 searcher actors (`shape.async_steps`: the mean step after the first
    that trained)."""
    tokenizer = build_char_tokenizer()
    model = qwen_model(shape, tokenizer, device)
    parameters = sum(p.numel() for p in model.parameters())
    model_dir = out / "qwen-shaped"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    if device.type == "cuda":  # the peak of training, not of creating the model in fp32
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    batch = shape.num_prompts * shape.group_size
    if mode == "sync":
        how = ["train.mode=sync", "searchers.count=0", f"train.max_steps={shape.steps}"]
    else:  # one GPU: `searchers.num_gpus=auto` puts both searchers on it, beside the trainer
        how = ["train.mode=async", "searchers.count=2", f"train.max_steps={shape.async_steps}",
               f"train.initial_buffer_samples={batch}"]  # fmt: skip
    overrides = [
        *how, f"policy.device={device}", f"searchers.device={device}", "policy.dtype=bfloat16",
        f"train.num_prompts={shape.num_prompts}", f"train.group_size={shape.group_size}",
        f"policy.max_new_tokens={shape.new_tokens}", "train.max_minutes=null",
        f"train.micro_batch_groups={shape.micro_batch_groups}",
        # Evaluated at the start and the end only, on few prompts: this part times training.
        "task.num_eval=4", "task.num_eval_pass_k=1", "eval.pass_k=1", "eval.every_minutes=null",
        f"output_dir={out / 'run'}", f"policy.num_threads={torch.get_num_threads()}",
    ]  # fmt: skip
    rows = [{"prompt": text} for text in math_prompts(8 * shape.num_prompts)]
    trainer = TBATrainer(model=str(model_dir), reward_funcs=even_token_share,
                         args=TBAConfig.from_overrides(overrides), train_dataset=rows)  # fmt: skip
    trainer.train(overwrite=True)
    steps = [r for r in read_metrics(out / "run" / "metrics.jsonl") if "loss" in r][1:]
    step = {key: float(np.mean([r[key] for r in steps]))
            for key in ("step_seconds", "wait_seconds", "sync_seconds", "train_seconds",
                        "train_tokens_per_s")}  # fmt: skip
    summary = json.loads((out / "run" / "eval.json").read_text())
    trained = max(summary.get("groups_trained", 0), 1)
    name, peak_flops, _ = card(device)
    flops = 6 * parameters * step["train_tokens_per_s"]
    return {
        "mode": mode, "parameters": parameters, "step": step, "steps_averaged": len(steps),
        "samples_per_s": batch / step["step_seconds"],
        "idle_share": step["wait_seconds"] / step["step_seconds"],
        "staleness_steps_mean": summary.get("staleness_steps_mean"),
        "fresh_groups": summary.get("groups_fresh", 0) / trained,
        "peak_memory_gib": peak_memory_gib(device), "card": name, "peak_flops": peak_flops,
        "mfu": flops / peak_flops if peak_flops else None,
    }  # fmt: skip


def timed(device: torch.device, work, *arguments) -> tuple[float, object]:
    """(seconds, work(*arguments)), the device's queue drained before and after."""
    synchronize(device)
    start = time.time()
    result = work(*arguments)
    synchronize(device)
    return time.time() - start, result


def measure_sampling(shape: Shape, device: torch.device) -> dict:
    """B x K responses of `shape.new_tokens` tokens (B math prompts repeated K times, as a
    searcher samples them), with `benchmarks.engines`' generators: tba's samplers (on a GPU its
    loop and the compiled one a searcher uses there; on a CPU the loop and the eager static
    one) and Hugging Face `generate` (dynamic cache; on a GPU also its static cache compiled),
    each after a warm-up generation (which compiles), and the decode roofline."""
    tokenizer = build_char_tokenizer()
    model = qwen_model(shape, tokenizer, device)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = [tokenizer(text)["input_ids"] for text in math_prompts(shape.num_prompts)
               for _ in range(shape.group_size)]  # fmt: skip
    methods = ["loop", "compiled", "hf", "hf-static"] if device.type == "cuda" else \
        ["loop", "static", "hf"]  # fmt: skip
    settings = argparse.Namespace(max_new_tokens=shape.new_tokens, repeats=1)
    results: dict = {"rows": len(prompts), "new_tokens": shape.new_tokens}
    for method in methods:
        try:
            results[method] = measure_decode(method, model, prompts, eos, pad, settings)
        except Exception as error:  # one failed generator (a compiler missing) ends nothing
            results[method] = {"error": first_line(error)[:150]}
    name, _, bandwidth = card(device)
    source = "data sheet"
    if bandwidth is None:
        bandwidth, source = copy_bandwidth(device), "measured copy"
    results["roofline"] = {
        "tokens_per_s": roofline(model, prompts, shape.new_tokens, bandwidth),
        "bandwidth": bandwidth, "bandwidth_source": source, "card": name,
    }  # fmt: skip
    return results


def measure_handoff(shape: Shape, device: torch.device, repeats: int = 3) -> dict:
    """Best of `repeats`: the trainer's weights into a searcher's copy of the policy as tba
    publishes them, and as a device-to-device copy of every parameter."""
    tokenizer = build_char_tokenizer()
    trainer_model = qwen_model(shape, tokenizer, device, seed=0)
    searcher_model = qwen_model(shape, tokenizer, device, seed=1)

    def copy() -> None:
        with torch.no_grad():
            for target, source in zip(searcher_model.parameters(), trainer_model.parameters()):
                target.copy_(source)

    buckets = WeightBuckets(trainer_model)
    get_s, set_s, copy_s, publish_s = [], [], [], []
    try:
        for version in range(repeats):
            seconds, weights = timed(device, get_weights, trainer_model)
            get_s.append(seconds)
            set_s.append(timed(device, set_weights, searcher_model, weights)[0])
            copy_s.append(timed(device, copy)[0])
            publish_s.append(timed(device, buckets.publish, version, version)[0])
    finally:
        buckets.close()
    first = next(searcher_model.parameters())
    assert torch.equal(first, next(trainer_model.parameters()))
    size = sum(p.numel() * p.element_size() for p in trainer_model.parameters())
    # The synchronous in-process mode of the `model` part: does its searcher sample with the
    # trainer's own module (on `cuda`, the device `cuda:0` of the parameters)?
    config = load_config(None, ["train.mode=sync", "searchers.count=0",
                                f"policy.device={device.type}"])  # fmt: skip
    trainer = Trainer(trainer_model, **trainer_settings(config, tokenizer.pad_token_id, None))
    return {"bytes": size, "get_seconds": min(get_s), "set_seconds": min(set_s),
            "handoff_seconds": min(g + s for g, s in zip(get_s, set_s)),
            "copy_seconds": min(copy_s), "bucket_publish_seconds": min(publish_s),
            "ipc": device.type == "cuda",
            "in_process_shares_module": shares_trainer_model(config, trainer)}  # fmt: skip


def run_measurement(part: str, args: argparse.Namespace) -> dict:
    """One of the model's parts in a fresh process: its own peak memory, and a failure there
    leaves the other parts standing."""
    command = [sys.executable, "-m", "benchmarks.gpu", "--measure", part, "--device", args.device,
               "--out", str(args.out), *(["--small"] if args.small else [])]  # fmt: skip
    log = args.out / f"{part}.log"
    print(f"[{time.strftime('%H:%M:%S')}] {part}: {' '.join(command[2:])}", flush=True)
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=sink, text=True)
    if done.returncode != 0:
        raise RuntimeError(last_line(log))
    return json.loads(done.stdout.strip().splitlines()[-1])


def last_line(log: Path) -> str:
    lines = log.read_text().strip().splitlines() or ["no output"]
    return f"{lines[-1][:200]} (log: {log})"


def measure(part: str, args: argparse.Namespace) -> dict:
    quiet_libraries()
    if args.small:
        torch.set_num_threads(1)  # tiny shapes gain nothing from more, a shared machine loses
    device = torch.device(args.device)
    shape = SHAPES["tiny" if args.small else "qwen2.5-0.5b"]
    out = args.out / part
    out.mkdir(parents=True, exist_ok=True)
    if part in ("model", "model-async"):
        return measure_model(shape, device, out, "sync" if part == "model" else "async")
    if part == "sampling":
        return measure_sampling(shape, device)
    return measure_handoff(shape, device)


# ------------------------------------------------------------------------------------ report


def thousands(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def seconds(value: float) -> str:
    return f"{value:.3g}" if value >= 1e-3 else "< 0.001"


def step_text(step: dict, generation: str) -> str:
    return (f"step {seconds(step['step_seconds'])} s = {generation} "
            f"{seconds(step['wait_seconds'])} + train {seconds(step['train_seconds'])} + hand-off "
            f"{seconds(step['sync_seconds'])}")  # fmt: skip


def embedded_row(mode: str, r: dict) -> tuple[str, str]:
    label = ("embedded math, `train.mode=sync searchers.count=0`" if mode == "sync" else
             "embedded math, asynchronous, 2 searchers (Ray actors)")  # fmt: skip
    text = (f"{r['base']:.1%} → {r['final']:.1%} held-out pass@1 in {r['train_minutes']:.2f} "
            f"min, {r['steps']} steps, {r['samples_per_s']:.0f} samples/s")  # fmt: skip
    if r["step"]:
        text += "; " + step_text(r["step"], "generation" if mode == "sync" else "waiting")
    if r["steps"] == 0:
        text += "; no step: starting took the whole time"
    elif mode == "async" and r["staleness_steps_mean"] is not None:
        text += (f"; staleness {r['staleness_steps_mean']:.1f} steps on average, "
                 f"{r['fresh_groups']:.0%} fresh groups")  # fmt: skip
    return label, text + f"; {r['samples_lost']} samples lost"


def model_row(r: dict, shape: Shape) -> tuple[str, str]:
    name = "Qwen2.5-0.5B-shaped" if shape == SHAPES["qwen2.5-0.5b"] else "tiny Qwen2-shaped"
    label = (f"{name} random model ({r['parameters'] / 1e6:.3g}M parameters), bf16, "
             f"`TBATrainer`, sync, B={shape.num_prompts} × K={shape.group_size}, "
             f"{shape.new_tokens} new tokens")  # fmt: skip
    step = r["step"]
    mfu = (f", {r['mfu']:.0%} MFU of {r['peak_flops'] / 1e12:.0f} TFLOP/s"
           if r["mfu"] is not None else "")  # fmt: skip
    memory = "peak GPU memory" if r["card"] != "CPU" else "peak resident memory"
    text = (f"{step_text(step, 'generation')} ({thousands(step['train_tokens_per_s'])} train "
            f"tokens/s{mfu}); {memory} {r['peak_memory_gib']:.2f} GiB")  # fmt: skip
    return label, text


def model_async_row(r: dict, sync: dict | str | None) -> tuple[str, str]:
    text = (f"{r['samples_per_s']:.0f} samples/s, trainer idle {r['idle_share']:.0%} of its "
            f"steps, staleness {r['staleness_steps_mean'] or 0:.1f} steps on average, "
            f"{r['fresh_groups']:.0%} fresh groups; {step_text(r['step'], 'waiting')}")  # fmt: skip
    if isinstance(sync, dict):
        text += (f"; synchronous: {sync['samples_per_s']:.0f} samples/s, trainer idle "
                 f"{sync['idle_share']:.0%} (generating)")  # fmt: skip
    return "the same model, asynchronous, 2 searchers (Ray actors) on the trainer's device", text


SAMPLERS = {
    "loop": "tba loop", "static": "tba static cache", "compiled": "tba compiled",
    "hf": "HF `generate`", "hf-static": "HF static cache + `torch.compile`",
}  # fmt: skip


def sampling_row(r: dict) -> tuple[str, str]:
    rates = []
    for method, label in SAMPLERS.items():
        entry = r.get(method)
        if entry is None:
            continue
        if "error" in entry:
            rates.append(f"{label} failed: {entry['error']}")
            continue
        text = f"{label} {thousands(entry['tokens_per_s'])}"
        if method in ("compiled", "hf-static"):
            text += f" (first call {entry['warm_up_s']:.0f} s)"
        rates.append(text)
    roofline = r["roofline"]
    rates.append(f"decode roofline ~{thousands(roofline['tokens_per_s'])} "
                 f"({roofline['bandwidth'] / 1e12:.2g} TB/s, {roofline['bandwidth_source']})")
    return (f"sampling tokens/s, same model, {r['rows']} × {r['new_tokens']} tokens",
            "; ".join(rates))  # fmt: skip


def handoff_row(r: dict) -> tuple[str, str]:
    size = f"{r['bytes'] / 1e9:.3g} GB" if r["bytes"] >= 1e8 else f"{r['bytes'] / 1e6:.3g} MB"
    shared = "CUDA IPC" if r["ipc"] else "shared memory"
    module = "samples with the trainer's module (no hand-off)" if r["in_process_shares_module"] \
        else "loads its own copy (a hand-off each step)"  # fmt: skip
    return (f"weight hand-off of {size}",
            f"through host memory (`get_weights` + `set_weights`) {r['handoff_seconds']:.3g} s "
            f"(get {r['get_seconds']:.3g}, set {r['set_seconds']:.3g}); device-to-device copy "
            f"{r['copy_seconds']:.2g} s; the trainer's publish into its shared buckets ({shared} "
            f"to searchers beside it) {r['bucket_publish_seconds']:.2g} s; the synchronous "
            f"in-process searcher {module}")  # fmt: skip


def report(results: dict, args: argparse.Namespace) -> str:
    meta = results["meta"]
    shape = SHAPES["tiny" if args.small else "qwen2.5-0.5b"]
    lines = [f"`{meta['command']}` on {meta['device']} ({meta['date']}; torch {meta['torch']}"
             f"{', CUDA ' + meta['cuda'] if meta['cuda'] else ''}, transformers "
             f"{meta['transformers']}; {meta['cpus']} CPUs); one seed each.", ""]  # fmt: skip
    base = results.get("base_policy")
    if base:
        how = f"built here in {base['seconds']:.0f} s" if base["built"] else "found in the cache"
        lines += [f"Base policy of the embedded task: {how}.", ""]
    curves = {mode: results[mode] for mode in ("sync", "async")
              if isinstance(results.get(mode), dict) and "curve" in results[mode]}  # fmt: skip
    if curves:
        lines += ["| run | held-out pass@1 against minutes of training |", "|---|---|"]
        for mode, r in curves.items():
            points = ", ".join(f"{m:.2f}: {v:.1%}" for m, v in r["curve"])
            lines.append(f"| {mode} | {points} |")
        lines.append("")
    rows = []
    for part in PARTS:
        r = results.get(part)
        if r is None:
            continue
        if isinstance(r, str):
            rows.append((PARTS[part], r))
        elif part in ("sync", "async"):
            rows.append(embedded_row(part, r))
        elif part == "model":
            rows.append(model_row(r, shape))
        elif part == "model-async":
            rows.append(model_async_row(r, results.get("model")))
        elif part == "sampling":
            rows.append(sampling_row(r))
        else:
            rows.append(handoff_row(r))
    table = ["| what | result |", "|---|---|", *(f"| {what} | {text} |" for what, text in rows)]
    return "\n".join(lines + table) + "\n"


def metadata(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "command": "python -m benchmarks.gpu " + " ".join(sys.argv[1:]),
        "device": card(device)[0] if device.type == "cuda" else "CPU",
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "cpus": os.cpu_count(), "commit": commit,
        "small": args.small, "minutes": args.minutes,
        "shape": asdict(SHAPES["tiny" if args.small else "qwen2.5-0.5b"]),
    }  # fmt: skip


def run_parts(parts: list[str], args: argparse.Namespace) -> dict:
    results: dict = {"meta": metadata(args)}
    path = args.out / "gpu.json"

    def save() -> None:
        path.write_text(json.dumps(results, indent=1))

    seconds = results["meta"]["part_seconds"] = {}
    if {"sync", "async"} & set(parts):
        start = time.time()
        results["base_policy"] = base_policy(args.small, args.out)
        seconds["base_policy"] = time.time() - start
    for part in parts:
        if part in ("async", "model-async") and importlib.util.find_spec("ray") is None:
            results[part] = "skipped: Ray is not installed (`pip install ray`)"
            print(f"async: {results[part]}", flush=True)
            continue
        start = time.time()
        try:
            if part in ("sync", "async"):
                results[part] = run_embedded(part, args)
            else:
                results[part] = run_measurement(part, args)
        except (RuntimeError, OSError) as error:
            results[part] = f"failed: {error}"
            results.setdefault("failed", []).append(part)
            print(f"{part}: {results[part]}", flush=True)
        seconds[part] = time.time() - start
        save()
    save()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="parts:\n" + "\n".join(f"  {name:9} {text}" for name, text in PARTS.items()),
    )  # fmt: skip
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated, from {', '.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--small", action="store_true", help="tiny shapes and short runs (a CPU: under 3 minutes)"
    )
    parser.add_argument(
        "--minutes", type=float, help="training per embedded run (default: 2; with --small 0.4)"
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model parts run (the embedded runs: policy.device=auto)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/gpu"), help="output directory")
    parser.add_argument(
        "--measure", choices=["model", "model-async", "sampling", "handoff"],
        help=argparse.SUPPRESS,
    )  # one part in this process (internal)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    parts = args.parts.split(",")
    if unknown := [part for part in parts if part not in PARTS]:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.minutes is None:
        args.minutes = 0.4 if args.small else 2.0
    if args.small:
        torch.set_num_threads(1)  # (the tiny base policy built here)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results = run_parts(parts, args)
    results["meta"]["wall_minutes"] = (time.time() - start) / 60
    (args.out / "gpu.json").write_text(json.dumps(results, indent=1))
    table = report(results, args)
    (args.out / "gpu.md").write_text(table)
    spent = ", ".join(f"{part} {s:.0f} s" for part, s in results["meta"]["part_seconds"].items())
    print(f"\n{results['meta']['wall_minutes']:.1f} minutes ({spent}); {args.out / 'gpu.md'}, "
          f"{args.out / 'gpu.json'}\n")  # fmt: skip
    print(table, end="")
    if results.get("failed"):
        sys.exit(1)


if __name__ == "__main__":
    main()
