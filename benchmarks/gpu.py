"""What tba does on one GPU, in one command that fits a window of machine time: its parts run in
order of value within `--budget` seconds (540 by default: a 10-minute window with a margin), no
download (models from public configurations with random weights; the embedded task's base
policy built where it runs), vLLM not needed, Ray optional.

Parts (`--parts`, all by default), in the order they run:

- model: a Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
  4864, vocabulary 151,936, tied embeddings, rope theta 1e6; random weights) in bf16 through
  `TBATrainer`, synchronous, B=8 prompts x K=16 responses of 256 new tokens: the step's parts,
  train tokens/s and MFU (6 * parameters * tokens over the card's dense bf16 peak), peak memory.
- model-async: that model the same way, asynchronously, with 2 and then 1 searchers as Ray
  actors on the trainer's GPU (`searchers.num_gpus=auto`), against the synchronous `model` part:
  samples/s trained and generated, the trainer's idle share (waiting for samples over the step),
  staleness, and the hand-off on each side (the trainer's publish a step, `sync_seconds`; a
  searcher's copy a version, `searcher{i}/weight_sync_s`). Then, where the budget leaves every
  later part its estimate, 2 searchers with another split of the GPU (`searchers.num_gpus=0.25`
  each), and which split gave the most samples/s; where it does not, the row says that only
  `auto` was tried. One Ray instance serves the runs. Skipped, in one line, without Ray.
- handoff: that model's weights from the trainer to a searcher's copy through host memory
  (`get_weights` + `set_weights`: the object store's path), against a device-to-device copy of
  every parameter; the trainer's publish into its shared buckets and a searcher process's copy
  out of them into its own model (`BucketReader.copy_newest`: by CUDA IPC on the trainer's GPU,
  through shared memory on a CPU; `benchmarks.shared_buckets`); and whether the synchronous
  in-process searcher samples with the trainer's own module (no hand-off at all).
  `python -m benchmarks.handoff` times each path through Ray, publish to adopted.
- sampling: that model writing 128 x 256 tokens with `benchmarks.engines`' generators: tba's
  samplers (its loop, and the compiled one a searcher uses on a GPU) against Hugging Face
  `generate` (dynamic cache; static cache + `torch.compile`), and the decode roofline (every
  weight and the mean KV cache read once per decoding step, at the card's memory bandwidth).
- memory-1.5b, memory-3b, memory-7b-qlora: the rows of `benchmarks.memory --suite qwen` not yet
  measured on a GPU, each in a fresh process as that suite measures them (Qwen2.5-1.5B and 3B
  each tuned four ways, 7B with QLoRA): peak device memory of one train step and of reference
  scoring, and the step's seconds.
- sync: the embedded math task, synchronous, the searcher in the trainer process
  (`train.mode=sync searchers.count=0`), for `--minutes` of training: held-out greedy pass@1
  against time, samples/s, and what a step is made of (generation, weight hand-off, update).
  The first embedded part to run builds the task's base policy where it is not cached.
- async: the same task asynchronously, 2 searchers as Ray actors beside the trainer (on a GPU
  sharing it: `searchers.num_gpus=auto`, a third of it each): the same, and how stale the
  trained samples were. Skipped, in one line, without Ray.

**The budget.** Each part has an estimate of its seconds (`PARTS`: on one H100 or H200 from the
figures of docs/results/gpu.md, with `--small` on a 2-core CPU). A part whose estimate no longer
fits in what is left of the budget is skipped, in one line (and as skipped in the JSON); the
parts after it still run if theirs fit. Each part runs in its own process under its own timeout,
the rest of the budget, so that a hung part cannot take the whole window: at its timeout its
process group is stopped and what it finished (model-async's runs, the memory rows) is kept.
After every part, `gpu.json` (every figure; the commit, card, versions and each part's seconds
and estimate) and `gpu.md` (the table) are rewritten in `--out`, so that a benchmark killed
midway keeps what it measured; the part that was running is named there. The table is printed
last.

**The commit measured**, where the working tree was copied without `.git`: the `TBA_COMMIT`
environment variable, else `benchmarks/.commit` (written before the copy by `--write-commit`),
else `git rev-parse HEAD`, else "unknown" (`benchmarks.budget`).

`--small` runs every part with tiny shapes and short runs (the memory rows with the narrow
shapes of `benchmarks.memory --small`, in fp32, which a CPU multiplies faster than bf16), to try
it on a CPU: its estimates add up to 4.6 minutes on 2 idle cores.

    TBA_COMMIT=<sha> python -m benchmarks.gpu --budget 540 --out $OUT/gpu   # one GPU
    python -m benchmarks.gpu --small                   # a CPU, tiny shapes, every part
    python -m benchmarks.gpu --parts model,sampling    # some parts only
    python -m benchmarks.gpu --write-commit            # benchmarks/.commit, before a copy
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import Qwen2ForCausalLM

from benchmarks import memory
from benchmarks.budget import Budget, commit, run_part, write_atomically, write_commit
from benchmarks.common import run_logged
from benchmarks.engines import copy_bandwidth, measure_decode, roofline
from benchmarks.shapes import qwen_config, random_qwen
from benchmarks.shared_buckets import time_buckets
from tba import TBAConfig, TBATrainer
from tba.config import load_config
from tba.errors import first_line
from tba.policy.model import get_weights, set_weights
from tba.policy.tokenizer import build_char_tokenizer
from tba.quiet import quiet_libraries
from tba.run_dir import read_metrics
from tba.runtime.placement import local_ray_gpus, searcher_gpus, shares_trainer_model
from tba.runtime.ray_cluster import ray_session
from tba.tasks import resolve_policy
from tba.tasks.math import world
from tba.trainer import Trainer, trainer_settings

DEFAULT_BUDGET_S = 540.0  # one 10-minute window, less its start-up and the transfers


@dataclass(frozen=True)
class Part:
    """One part of the benchmark: what it measures, and its estimated seconds on one H100 or
    H200 and with `--small` on a 2-core CPU (an embedded run: plus its `--minutes`)."""

    label: str
    gpu_s: float
    small_s: float
    ray: bool = False  # skipped without Ray
    embedded: bool = False  # a `tba train` run of `--minutes`


@dataclass(frozen=True)
class AsyncRun:
    """One asynchronous run of the model part: searcher actors, `searchers.num_gpus`, and its
    estimated seconds (on a GPU; `--small` on a CPU)."""

    searchers: int
    num_gpus: str
    gpu_s: float
    small_s: float


# model-async's runs, all made: 2 searchers then 1, with `auto`'s split. Not yet run on a GPU:
# guessed from `model` (its start, its sampler's compilation), plus Ray's start and the
# searchers' loading for the first; the second shares the Ray instance and the saved model.
ASYNC_RUNS = (AsyncRun(2, "auto", 140, 30), AsyncRun(1, "auto", 100, 20))
# Where the budget leaves time for it (only on a GPU: a CPU has no GPU to split).
SECOND_SPLIT = AsyncRun(2, "0.25", 100, 0)

# In order of value: what a budget runs first. GPU seconds from docs/results/gpu.md: `model`
# 2026-12-04 (`--parts model,model-async` was 24 s into model-async after 200 s); sampling
# 2026-11-28 (the compiled generators' first calls, 33 s and 8 s, and five generations of
# 128 x 256 tokens at 3.1k-27k tokens/s); memory rows 2026-12-04 (eight 0.5B and 7B rows in
# ~200 s; a 7B QLoRA row also saves and reloads the model, 15 GB); handoff, sync and async
# were not timed: guessed. `--small`: `python -m benchmarks.gpu --small` on a 2-core CPU.
PARTS = {
    "model": Part("Qwen2.5-0.5B-shaped random model through TBATrainer, synchronous", 180, 20),
    "model-async": Part("that model asynchronously, 2 and 1 searchers (Ray actors) on the "
                        "trainer's GPU", sum(r.gpu_s for r in ASYNC_RUNS),
                        sum(r.small_s for r in ASYNC_RUNS), ray=True),
    "handoff": Part("weight hand-off of that model: host memory, shared buckets (both sides), "
                    "a device copy", 60, 20),
    "sampling": Part("sampling that model: tba's samplers, HF generate (dynamic; static + "
                     "compile)", 100, 20),
    "memory-1.5b": Part("memory of a train step, Qwen2.5-1.5B: full, full 8-bit Adam, LoRA, "
                        "QLoRA", 100, 40),
    "memory-3b": Part("memory of a train step, Qwen2.5-3B: full, full 8-bit Adam, LoRA, QLoRA",
                      120, 40),
    "memory-7b-qlora": Part("memory of a train step, Qwen2.5-7B with QLoRA", 120, 12),
    "sync": Part("embedded math task, synchronous (searcher in the trainer process)", 60, 15,
                 embedded=True),
    "async": Part("embedded math task, asynchronous, 2 searchers (Ray actors) beside the "
                  "trainer", 90, 25, ray=True, embedded=True),
}  # fmt: skip
# The embedded task's base policy, built by the first embedded part where it is not cached:
# 1 min 48 s on a 2-core CPU (docs/results/math.md); `--small`'s in seconds.
BASE_POLICY_S = {"gpu": 110.0, "small": 5.0}

# Each memory part: the shape of `benchmarks.memory`'s qwen suite and which of its rows.
MEMORY_PARTS = {
    "memory-1.5b": ("qwen2.5-1.5b", False),  # (shape, QLoRA only)
    "memory-3b": ("qwen2.5-3b", False),
    "memory-7b-qlora": ("qwen2.5-7b", True),
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
    async_steps: int  # steps of an asynchronous run (its searchers start while it waits)


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


def write_partial(out: Path, result: dict) -> None:
    """What a part has measured so far, kept if it is stopped before its end."""
    write_atomically(out / "partial.json", json.dumps(result, indent=1))


# ------------------------------------------------------------------------ the embedded task


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
    """`tba train` for `--minutes` of training in its own process, as a user runs it, after the
    base policy (built here where it is not cached); its held-out pass@1 every tenth of the run,
    its throughput and staleness."""
    base = base_policy(args.small, args.out)
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
                                        "overrides": overrides, "base_policy": base}  # fmt: skip


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


# --------------------------------------------------------------- the Qwen2.5-0.5B-shaped model


def qwen_model(shape: Shape, tokenizer, device: torch.device, seed: int = 0) -> Qwen2ForCausalLM:
    """Qwen2.5-0.5B's architecture (its public configuration, `benchmarks.shapes`) with
    `shape.changes`, random weights, bf16, made where it runs."""
    config = qwen_config("qwen2.5-0.5b", pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, **shape.changes)  # fmt: skip
    return random_qwen(config, device, torch.bfloat16, seed=seed)


def searcher_copy(shape: Shape, device: str) -> Qwen2ForCausalLM:
    """A searcher's model of `shape` (other random weights than the trainer's), made in the
    searcher's process."""
    return qwen_model(shape, build_char_tokenizer(), torch.device(device), seed=1)


def math_prompts(count: int) -> list[str]:
    return [world.format_prompt(p.question) for p in world.problems("train", count, seed=0)]


def even_token_share(completion_ids, **kwargs) -> list[float]:
    """A reward that varies from response to response of a random model: its share of even ids."""
    return [sum(token % 2 == 0 for token in ids) / max(len(ids), 1) for ids in completion_ids]


def save_model(shape: Shape, device: torch.device, out: Path) -> tuple[Path, int]:
    """The model of `shape` saved with its tokenizer under `out` (where the runs load it); its
    directory and parameter count."""
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
    return model_dir, parameters


def model_overrides(shape: Shape, device: torch.device, run_dir: Path, how: list[str]) -> list[str]:
    """`TBATrainer`'s settings for a run of the model part: `how` it runs, and the rest."""
    return [
        *how, f"policy.device={device}", f"searchers.device={device}", "policy.dtype=bfloat16",
        f"train.num_prompts={shape.num_prompts}", f"train.group_size={shape.group_size}",
        f"policy.max_new_tokens={shape.new_tokens}", "train.max_minutes=null",
        f"train.micro_batch_groups={shape.micro_batch_groups}",
        # Evaluated at the start and the end only, on few prompts: this part times training.
        "task.num_eval=4", "task.num_eval_pass_k=1", "eval.pass_k=1", "eval.every_minutes=null",
        f"output_dir={run_dir}", f"policy.num_threads={torch.get_num_threads()}",
    ]  # fmt: skip


def train_model(model_dir: Path, shape: Shape, overrides: list[str]) -> None:
    rows = [{"prompt": text} for text in math_prompts(8 * shape.num_prompts)]
    trainer = TBATrainer(model=str(model_dir), reward_funcs=even_token_share,
                         args=TBAConfig.from_overrides(overrides), train_dataset=rows)  # fmt: skip
    trainer.train(overwrite=True)


def step_means(records: list[dict], keys: tuple[str, ...]) -> tuple[dict[str, float], int]:
    """The mean of `keys` over the steps that trained, the first left out (it compiles and
    warms up); and how many steps that is."""
    steps = [r for r in records if "loss" in r][1:]
    return {key: float(np.mean([r[key] for r in steps])) for key in keys}, len(steps)


def measure_model(shape: Shape, device: torch.device, out: Path) -> dict:
    """`TBATrainer`, synchronous, `shape.steps` steps: the mean step after the first."""
    model_dir, parameters = save_model(shape, device, out)
    how = ["train.mode=sync", "searchers.count=0", f"train.max_steps={shape.steps}"]
    train_model(model_dir, shape, model_overrides(shape, device, out / "run", how))
    step, averaged = step_means(read_metrics(out / "run" / "metrics.jsonl"),
                                ("step_seconds", "wait_seconds", "sync_seconds",
                                 "train_seconds", "train_tokens_per_s"))  # fmt: skip
    name, peak_flops, _ = card(device)
    flops = 6 * parameters * step["train_tokens_per_s"]
    return {
        "mode": "sync", "parameters": parameters, "step": step, "steps_averaged": averaged,
        "samples_per_s": shape.num_prompts * shape.group_size / step["step_seconds"],
        "idle_share": step["wait_seconds"] / step["step_seconds"],
        "peak_memory_gib": peak_memory_gib(device), "card": name, "peak_flops": peak_flops,
        "mfu": flops / peak_flops if peak_flops else None,
    }  # fmt: skip


def async_overrides(shape: Shape, device: torch.device, run_dir: Path, run: AsyncRun) -> list[str]:
    how = ["train.mode=async", f"searchers.count={run.searchers}",
           f"searchers.num_gpus={run.num_gpus}", f"train.max_steps={shape.async_steps}",
           f"train.initial_buffer_samples={shape.num_prompts * shape.group_size}"]  # fmt: skip
    return model_overrides(shape, device, run_dir, how)


def latest_per_searcher(records: list[dict], key: str) -> list[float]:
    """Each searcher's last `searcher{i}/<key>` (a figure since its process started)."""
    latest: dict[str, float] = {}
    for record in records:
        for name, value in record.items():
            if name.startswith("searcher") and name.endswith("/" + key):
                latest[name] = value
    return list(latest.values())


def weight_transfers(run_dir: Path) -> list[str]:
    """The ways the weights reached the searchers (`weight_transfer` events)."""
    path = run_dir / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sorted({e["path"] for e in events if e.get("event") == "weight_transfer"})


def async_figures(run_dir: Path, shape: Shape) -> dict:
    """A finished asynchronous run's throughput, the trainer's idle share, staleness and the
    hand-off on each side, from its metrics, events and summary."""
    records = read_metrics(run_dir / "metrics.jsonl")
    step, averaged = step_means(records, ("step_seconds", "wait_seconds", "sync_seconds",
                                          "train_seconds"))  # fmt: skip
    summary = json.loads((run_dir / "eval.json").read_text())
    copies = latest_per_searcher(records, "weight_sync_s")
    return {
        "step": step, "steps_averaged": averaged,
        "samples_per_s": shape.num_prompts * shape.group_size / step["step_seconds"],
        "generated_per_s": sum(latest_per_searcher(records, "samples_per_s")),
        "idle_share": step["wait_seconds"] / step["step_seconds"],
        "staleness_steps_mean": summary.get("staleness_steps_mean"),
        "fresh_groups": summary.get("groups_fresh", 0) / max(summary.get("groups_trained", 0), 1),
        "trainer_publish_seconds": step["sync_seconds"],
        "searcher_weight_sync_s": float(np.mean(copies)) if copies else None,
        "weight_transfer": weight_transfers(run_dir),
    }  # fmt: skip


def measure_async_run(shape: Shape, device: torch.device, model_dir: Path, run_dir: Path,
                      run: AsyncRun) -> dict:  # fmt: skip
    overrides = async_overrides(shape, device, run_dir, run)
    share, why = searcher_gpus(load_config(None, overrides))
    start = time.time()
    train_model(model_dir, shape, overrides)
    return {"searchers": run.searchers, "num_gpus": run.num_gpus, "gpu_share": share,
            "gpu_share_why": why, "seconds": time.time() - start,
            **async_figures(run_dir, shape)}  # fmt: skip


def split_skip_reason(device: torch.device, elapsed_s: float, allowed_s: float) -> str | None:
    """Why the second split of the GPU is not tried (None: it is): no GPU, or its estimate does
    not fit in what the part may take (its own estimate and what the budget spares)."""
    if device.type != "cuda":
        return ("no GPU: the searchers ran on the CPU (searchers.num_gpus=0), there is nothing "
                "to split")  # fmt: skip
    if elapsed_s + SECOND_SPLIT.gpu_s > allowed_s:
        return (f"a second split (searchers.num_gpus={SECOND_SPLIT.num_gpus}, ~"
                f"{SECOND_SPLIT.gpu_s:.0f} s) did not fit the budget ("
                f"{max(allowed_s - elapsed_s, 0):.0f} s to spare)")  # fmt: skip
    return None


def measure_model_async(shape: Shape, device: torch.device, out: Path, small: bool,
                        spare_s: float) -> dict:  # fmt: skip
    """The model part asynchronously: every run of `ASYNC_RUNS`, then `SECOND_SPLIT` where the
    part's estimate and `spare_s` leave time for it; one Ray instance for all. Each run is kept
    in `partial.json` as it ends."""
    start = time.monotonic()
    estimate = PARTS["model-async"].small_s if small else PARTS["model-async"].gpu_s
    model_dir, parameters = save_model(shape, device, out)
    result: dict = {"parameters": parameters, "runs": []}
    first = load_config(None, async_overrides(shape, device, out / "run", ASYNC_RUNS[0]))
    with ray_session(first, print, local_ray_gpus(first)):
        for index, run in enumerate(ASYNC_RUNS):
            result["runs"].append(measure_async_run(shape, device, model_dir,
                                                    out / f"run{index}", run))  # fmt: skip
            write_partial(out, result)
        why_not = split_skip_reason(device, time.monotonic() - start, estimate + spare_s)
        if why_not is None:
            result["runs"].append(measure_async_run(shape, device, model_dir,
                                                    out / "split", SECOND_SPLIT))  # fmt: skip
    result["split_not_tried"] = why_not
    return result


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
    """Best of `repeats`: the trainer's weights into a searcher's copy of the policy through
    host memory and as a device-to-device copy of every parameter; the trainer's publish into its
    shared buckets and a searcher process's copy out of them (`benchmarks.shared_buckets`)."""
    tokenizer = build_char_tokenizer()
    trainer_model = qwen_model(shape, tokenizer, device, seed=0)
    searcher_model = qwen_model(shape, tokenizer, device, seed=1)

    def copy() -> None:
        with torch.no_grad():
            for target, source in zip(searcher_model.parameters(), trainer_model.parameters()):
                target.copy_(source)

    get_s, set_s, copy_s = [], [], []
    for _ in range(repeats):
        seconds, weights = timed(device, get_weights, trainer_model)
        get_s.append(seconds)
        set_s.append(timed(device, set_weights, searcher_model, weights)[0])
        copy_s.append(timed(device, copy)[0])
    first = next(searcher_model.parameters())
    assert torch.equal(first, next(trainer_model.parameters()))
    buckets = time_buckets(trainer_model, partial(searcher_copy, shape, str(device)), repeats)
    size = sum(p.numel() * p.element_size() for p in trainer_model.parameters())
    # The synchronous in-process mode of the `model` part: does its searcher sample with the
    # trainer's own module (on `cuda`, the device `cuda:0` of the parameters)?
    config = load_config(None, ["train.mode=sync", "searchers.count=0",
                                f"policy.device={device.type}"])  # fmt: skip
    trainer = Trainer(trainer_model, **trainer_settings(config, tokenizer.pad_token_id, None))
    return {"bytes": size, "get_seconds": min(get_s), "set_seconds": min(set_s),
            "handoff_seconds": min(g + s for g, s in zip(get_s, set_s)),
            "copy_seconds": min(copy_s), "bucket_publish_seconds": buckets["publish_seconds"],
            "bucket_read_seconds": buckets["read_seconds"],
            "bucket_read_first_seconds": buckets["read_first_seconds"],
            "ipc": device.type == "cuda",
            "in_process_shares_module": shares_trainer_model(config, trainer)}  # fmt: skip


# ----------------------------------------------------------------------- the memory suite's rows


def memory_settings(device: torch.device, small: bool) -> argparse.Namespace:
    """`benchmarks.memory --suite qwen`'s settings on `device` (`--small`: its narrow shapes, in
    fp32: a CPU's bf16 matrix products are slow)."""
    small_flags = ["--small", "--dtypes", "float32"] if small else []
    return memory.parse_args(["--suite", "qwen", "--device", str(device), *small_flags])


def memory_rows(part: str, settings: argparse.Namespace) -> list[tuple]:
    """The rows of the memory suite that `part` measures."""
    shape, qlora_only = MEMORY_PARTS[part]
    rows = [row for row in memory.qwen_rows(settings) if row[0] == shape]
    return [row for row in rows if row[3]] if qlora_only else rows


def measure_memory(part: str, device: torch.device, small: bool, out: Path) -> dict:
    """The part's rows of the memory suite, each in a fresh process; each kept in `partial.json`
    as it ends."""
    settings = memory_settings(device, small)
    result: dict = {"shape": MEMORY_PARTS[part][0], "dtype": settings.dtype,
                    "num_prompts": settings.num_prompts, "group_size": settings.group_size,
                    "prompt_length": settings.prompt_length, "length": settings.length,
                    "micro_batch_groups": settings.micro_batch_groups, "rows": []}  # fmt: skip
    for row in memory_rows(part, settings):
        _, rank, checkpointing, bits, optimizer, master_weights = row
        try:
            measured = memory.measure_qwen_row(settings, row)
        except subprocess.CalledProcessError as error:
            lines = (error.stderr or "").strip().splitlines() or ["no output"]
            measured = {"error": lines[-1][:200]}
        result["rows"].append({"tuning": memory.tuning_label(rank, bits, optimizer, master_weights),
                               "checkpointing": checkpointing, **measured})  # fmt: skip
        write_partial(out, result)
    return result


# ------------------------------------------------------------------- one part in its process


def measure(part: str, args: argparse.Namespace) -> dict:
    """One part, in this process (`--measure`)."""
    quiet_libraries()
    if args.small:
        torch.set_num_threads(1)  # tiny shapes gain nothing from more, a shared machine loses
    device = torch.device(args.device)
    shape = SHAPES["tiny" if args.small else "qwen2.5-0.5b"]
    out = args.out / part
    out.mkdir(parents=True, exist_ok=True)
    if part in ("sync", "async"):
        return run_embedded(part, args)
    if part == "model":
        return measure_model(shape, device, out)
    if part == "model-async":
        return measure_model_async(shape, device, out, args.small, args.spare_s)
    if part == "sampling":
        return measure_sampling(shape, device)
    if part == "handoff":
        return measure_handoff(shape, device)
    return measure_memory(part, device, args.small, out)


def part_command(part: str, args: argparse.Namespace, spare_s: float) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu", "--measure", part, "--device", args.device,
            "--out", str(args.out), "--minutes", f"{args.minutes:g}", "--spare-s",
            f"{spare_s:.0f}", *(["--small"] if args.small else [])]  # fmt: skip


def measure_in_process(part: str, args: argparse.Namespace, timeout_s: float, spare_s: float,
                       started: Callable[[int], None]) -> dict:  # fmt: skip
    """One part in a fresh process (its own peak memory; a failure there leaves the other parts
    standing), for at most `timeout_s`: its figures; where it stopped before its end, what it
    had kept (`partial.json`) and why, else RuntimeError saying why."""
    partial_file = args.out / part / "partial.json"
    partial_file.unlink(missing_ok=True)  # an earlier benchmark's
    command = part_command(part, args, spare_s)
    log = args.out / "logs" / f"{part}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {part}: {' '.join(command[2:])} (at most "
          f"{timeout_s:.0f} s)", flush=True)  # fmt: skip
    done = run_part(command, log, timeout_s, started)
    printed = done.stdout.strip().splitlines()
    if done.returncode == 0 and printed:
        return json.loads(printed[-1])
    why = (f"stopped at the end of the budget, after {done.seconds:.0f} s (log: {log})"
           if done.returncode is None else last_line(log))  # fmt: skip
    if partial_file.exists():
        return json.loads(partial_file.read_text()) | {"incomplete": why}
    raise RuntimeError(why)


def last_line(log: Path) -> str:
    lines = log.read_text().strip().splitlines() or ["no output"]
    return f"{lines[-1][:200]} (log: {log})"


# ------------------------------------------------------------------------------- the budget


def part_estimate(part: str, small: bool, minutes: float, base_built: bool) -> float:
    """The seconds `part` is expected to take (an embedded run: with its `minutes` of training,
    and the base policy's build where no embedded part has run yet)."""
    spec = PARTS[part]
    seconds = spec.small_s if small else spec.gpu_s
    if spec.embedded:
        seconds += 60 * minutes
        if not base_built:
            seconds += BASE_POLICY_S["small" if small else "gpu"]
    return seconds


def skip_reason(part: str, estimate: float, budget: Budget) -> str | None:
    """Why `part` does not run now (None: it runs)."""
    if PARTS[part].ray and importlib.util.find_spec("ray") is None:
        return "Ray is not installed (`pip install ray`)"
    if not budget.admits(estimate):
        return (f"its estimate, {estimate:.0f} s, exceeds the {budget.left():.0f} s left of the "
                f"{budget.seconds:.0f} s budget")  # fmt: skip
    return None


def run_parts(parts: list[str], args: argparse.Namespace,
              clock: Callable[[], float] = time.monotonic) -> dict:  # fmt: skip
    """Each of `parts` in its turn, in its own process, within `args.budget` seconds; the
    results written after every part."""
    budget = Budget(args.budget, clock)
    results: dict = {"meta": metadata(args)}
    spent = results["meta"]["part_seconds"] = {}
    estimates = results["meta"]["estimates"] = {}
    base_built = False
    for index, part in enumerate(parts):
        estimate = estimates[part] = part_estimate(part, args.small, args.minutes, base_built)
        why_not = skip_reason(part, estimate, budget)
        if why_not is not None:
            results[part] = f"skipped: {why_not}"
            results.setdefault("skipped", []).append(part)
            print(f"{part}: {results[part]}", flush=True)
            write_outputs(results, args)
            continue
        later = sum(part_estimate(p, args.small, args.minutes, True) for p in parts[index + 1:])
        results["running"] = {"part": part, "since": time.strftime("%H:%M:%S")}
        write_outputs(results, args)
        start = clock()

        def started(pid: int) -> None:
            results["running"]["pid"] = pid
            write_outputs(results, args)

        try:
            results[part] = measure_in_process(part, args, budget.left(),
                                               budget.left() - estimate - later, started)
            if "incomplete" in results[part]:
                results.setdefault("failed", []).append(part)
        except (RuntimeError, OSError, ValueError) as error:  # (ValueError: no JSON printed)
            results[part] = f"failed: {first_line(error)}"
            results.setdefault("failed", []).append(part)
            print(f"{part}: {results[part]}", flush=True)
        except BaseException:  # this benchmark was stopped: say which part it cut
            results[part] = f"stopped after {clock() - start:.0f} s: the benchmark was stopped"
            results.setdefault("failed", []).append(part)
            raise
        finally:
            spent[part] = clock() - start
            del results["running"]
            results["meta"]["wall_minutes"] = budget.spent() / 60
            write_outputs(results, args)
        base_built = base_built or PARTS[part].embedded
        print(f"[{time.strftime('%H:%M:%S')}] {part}: {spent[part]:.0f} s (estimate "
              f"{estimate:.0f} s); {budget.left():.0f} s of the budget left", flush=True)
    results["meta"]["wall_minutes"] = budget.spent() / 60
    write_outputs(results, args)
    return results


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
    memory_kind = "peak GPU memory" if r["card"] != "CPU" else "peak resident memory"
    text = (f"{step_text(step, 'generation')} ({thousands(step['train_tokens_per_s'])} train "
            f"tokens/s{mfu}); {memory_kind} {r['peak_memory_gib']:.2f} GiB; "
            f"{r['samples_per_s']:.0f} samples/s")  # fmt: skip
    return label, text


def share_text(run: dict) -> str:
    share = run["gpu_share"]
    if run["num_gpus"] == "auto":
        return f"`searchers.num_gpus=auto`: {share:.3g} GPU each ({run['gpu_share_why']})"
    return f"`searchers.num_gpus={run['num_gpus']}`"


def async_run_row(run: dict, sync: dict | str | None) -> tuple[str, str]:
    against = ""
    if isinstance(sync, dict):
        against = (f" (synchronous step: {sync['samples_per_s']:.0f}, "
                   f"{run['samples_per_s'] / sync['samples_per_s']:.2f}×)")  # fmt: skip
    copy = run["searcher_weight_sync_s"]
    transfer = ", ".join(run["weight_transfer"]) or "not reported"
    text = (f"{run['samples_per_s']:.0f} samples/s trained{against}, "
            f"{run['generated_per_s']:.0f} generated; trainer idle {run['idle_share']:.0%} of "
            f"its steps (waiting for samples); staleness {run['staleness_steps_mean'] or 0:.1f} "
            f"steps on average, {run['fresh_groups']:.0%} fresh groups; hand-off ({transfer}): "
            f"trainer publish {seconds(run['trainer_publish_seconds'])} s a step, searcher copy "
            f"{seconds(copy) if copy is not None else '—'} s a version; "
            f"{step_text(run['step'], 'waiting')}")  # fmt: skip
    actors = "searchers (Ray actors)" if run["searchers"] > 1 else "searcher (a Ray actor)"
    label = (f"the same model, asynchronous, {run['searchers']} {actors} on the trainer's "
             f"device, {share_text(run)}")  # fmt: skip
    return label, text


def split_row(r: dict) -> tuple[str, str]:
    tried = [run for run in r["runs"] if run["searchers"] == ASYNC_RUNS[0].searchers]
    rates = "; ".join(f"{share_text(run)}: {run['samples_per_s']:.0f} samples/s"
                      for run in tried)  # fmt: skip
    text = f"tried {rates}"
    if len(tried) > 1:
        best = max(tried, key=lambda run: run["samples_per_s"])
        text += (f"; best: `searchers.num_gpus={best['num_gpus']}` (Ray's fractions reserve "
                 "the GPU, they do not divide its compute or memory)")  # fmt: skip
    elif r.get("split_not_tried"):
        text += f"; only this split: {r['split_not_tried']}"
    return (f"split of the GPU between the trainer and {ASYNC_RUNS[0].searchers} searchers",
            text)  # fmt: skip


def model_async_rows(r: dict, sync: dict | str | None) -> list[tuple[str, str]]:
    rows = [async_run_row(run, sync) for run in r["runs"]]
    if r["runs"] and "incomplete" not in r:
        rows.append(split_row(r))
    if "incomplete" in r:
        rows.append((PARTS["model-async"].label, f"incomplete: {r['incomplete']}"))
    return rows


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
            f"{r['copy_seconds']:.2g} s; shared buckets ({shared} to searchers beside the "
            f"trainer): the trainer's publish {r['bucket_publish_seconds']:.2g} s, a searcher "
            f"process's copy out of them {r['bucket_read_seconds']:.2g} s (first "
            f"{r['bucket_read_first_seconds']:.2g} s); the synchronous in-process searcher "
            f"{module}")  # fmt: skip


def count(parameters: int) -> str:
    return f"{parameters / 1e9:.3g}B" if parameters >= 1e9 else f"{parameters / 1e6:.3g}M"


def gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def memory_row(part: str, r: dict) -> tuple[str, str]:
    entries = []
    for row in r["rows"]:
        head = f"{row['tuning']} (checkpointing {'on' if row['checkpointing'] else 'off'})"
        if "error" in row:
            entries.append(f"{head} failed: {row['error']}")
        elif row["oom"]:
            entries.append(f"{head} out of memory")
        else:
            estimated = (f" (estimated {gib(row['estimate_mib'])})" if "estimate_mib" in row
                         else "")  # fmt: skip
            entries.append(f"{head}: step {gib(row['step_peak_mib'])}{estimated}, reference "
                           f"scoring {gib(row['score_peak_mib'])}, {row['step_seconds']:.2f} s")
    if "incomplete" in r:
        entries.append(f"incomplete: {r['incomplete']}")
    parameters = next((row["parameters"] for row in r["rows"] if "parameters" in row), None)
    size = f" ({count(parameters)} parameters)" if parameters else ""
    label = (f"peak memory of a train step, {r['shape']}{size}, {r['dtype']}, "
             f"B={r['num_prompts']} × K={r['group_size']}, {r['prompt_length']}-token prompts, "
             f"{r['length']} new tokens")  # fmt: skip
    return label, "; ".join(entries) or "no row measured"


def part_rows(part: str, r: dict | str, results: dict, shape: Shape) -> list[tuple[str, str]]:
    if isinstance(r, str):
        return [(PARTS[part].label, r)]
    if part in ("sync", "async"):
        return [embedded_row(part, r)]
    if part == "model":
        return [model_row(r, shape)]
    if part == "model-async":
        return model_async_rows(r, results.get("model"))
    if part == "sampling":
        return [sampling_row(r)]
    if part == "handoff":
        return [handoff_row(r)]
    return [memory_row(part, r)]


def report(results: dict, small: bool) -> str:
    meta = results["meta"]
    shape = SHAPES["tiny" if small else "qwen2.5-0.5b"]
    lines = [f"`{meta['command']}` on {meta['device']} ({meta['date']}; tba at {meta['commit']}; "
             f"torch {meta['torch']}{', CUDA ' + meta['cuda'] if meta['cuda'] else ''}, "
             f"transformers {meta['transformers']}; {meta['cpus']} CPUs; budget "
             f"{meta['budget_s']:.0f} s); one seed each.", ""]  # fmt: skip
    bases = [results[m]["base_policy"] for m in ("sync", "async")
             if isinstance(results.get(m), dict) and "base_policy" in results[m]]  # fmt: skip
    if bases:
        base = bases[0]
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
        if part in results:
            rows += part_rows(part, results[part], results, shape)
    if "running" in results:
        rows.append((PARTS[results["running"]["part"]].label,
                     f"running since {results['running']['since']}"))  # fmt: skip
    spent = meta["part_seconds"]
    if spent:
        rows.append(("seconds per part (estimate)", ", ".join(
            f"{part} {spent[part]:.0f} ({meta['estimates'][part]:.0f})" for part in spent)))
    table = ["| what | result |", "|---|---|", *(f"| {what} | {text} |" for what, text in rows)]
    return "\n".join(lines + table) + "\n"


def write_outputs(results: dict, args: argparse.Namespace) -> None:
    write_atomically(args.out / "gpu.json", json.dumps(results, indent=1))
    write_atomically(args.out / "gpu.md", report(results, args.small))


def metadata(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    found = commit()
    ray_version = None
    if importlib.util.find_spec("ray") is not None:
        from importlib.metadata import version

        ray_version = version("ray")
    return {
        "command": "python -m benchmarks.gpu " + " ".join(sys.argv[1:]),
        "device": card(device)[0], "date": time.strftime("%Y-%m-%d"),
        "started": time.strftime("%H:%M:%S"), "commit": found["commit"],
        "commit_source": found["source"], "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "ray": ray_version, "cpus": os.cpu_count(),
        "small": args.small, "minutes": args.minutes, "budget_s": args.budget,
        "shape": asdict(SHAPES["tiny" if args.small else "qwen2.5-0.5b"]),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="parts, in the order they run:\n" + "\n".join(
            f"  {name:15} {part.label}" for name, part in PARTS.items()),
    )  # fmt: skip
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, from {', '.join(PARTS)} (default: all); they run "
                        "in the order above")  # fmt: skip
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for all the parts: one whose estimate no longer fits is "
                        f"skipped (default: {DEFAULT_BUDGET_S:.0f})")  # fmt: skip
    parser.add_argument("--small", action="store_true",
                        help="every part with tiny shapes and short runs, on a CPU")
    parser.add_argument("--minutes", type=float,
                        help="training per embedded run (default: 2; with --small 0.25)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model parts run (the embedded runs: policy.device=auto)")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu"), help="output directory")
    parser.add_argument("--write-commit", action="store_true",
                        help="write this repository's commit into benchmarks/.commit (for a "
                        "copy without .git) and stop")  # fmt: skip
    # One part in this process, and the seconds it may spend beyond its estimate (internal).
    parser.add_argument("--measure", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--spare-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.minutes is None:
        args.minutes = 0.25 if args.small else 2.0
    if args.write_commit:
        try:
            print(f"benchmarks/.commit: {write_commit()}")
        except RuntimeError as error:
            parser.error(str(error))
        return
    if args.measure:
        print(json.dumps(measure(args.measure, args)))
        return
    parts = args.parts.split(",")
    if unknown := [part for part in parts if part not in PARTS]:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.budget <= 0:
        parser.error("--budget: seconds, more than 0")
    parts = [part for part in PARTS if part in parts]  # in order of value
    args.out.mkdir(parents=True, exist_ok=True)
    # A `timeout` or a window's end: stop the running part and keep what was measured.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results = run_parts(parts, args)
    table = report(results, args.small)
    spent = ", ".join(f"{part} {s:.0f} s" for part, s in results["meta"]["part_seconds"].items())
    print(f"\n{results['meta']['wall_minutes']:.1f} minutes ({spent}); {args.out / 'gpu.md'}, "
          f"{args.out / 'gpu.json'}\n")  # fmt: skip
    print(table, end="")
    if results.get("failed"):
        sys.exit(1)


if __name__ == "__main__":
    main()
