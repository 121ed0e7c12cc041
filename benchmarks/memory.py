"""Memory of the trainer and the searchers: three suites, every measurement in a fresh process.

- `--suite roles` (the default): peak RSS of each role on a ~100M-parameter Llama, with and
  without LoRA, and with LoRA on the base quantized to 4 bits (QLoRA, `--qlora-bits`). The
  model (12 layers, width 768, 32k vocabulary, tied embeddings: 110M parameters) is created
  randomly in a temporary directory.
  - trainer: load the policy, take `--steps` optimizer steps on B x K responses, publish weights;
  - searcher: load the policy (and, without LoRA, the frozen reference copy), generate a batch
    with reference log-probs, receive a weight sync (the payload a trainer publishes, read from a
    file as it would arrive from Ray's object store), generate again.
  "after imports" is the same process before the model is loaded (Python, torch, transformers).
- `--suite logprobs`: one TB train step of a narrow model with Qwen2.5's 151,936-token vocabulary,
  where the logits are most of the memory: the log-probs from the full (tokens x vocabulary)
  logits against the chunked computation tba uses (`tba.policy.chunked_logprobs`). Peak memory of
  the step and its time (median over `--steps`).
- `--suite qwen`: one TB train step, then the searcher's reference scoring of the same batch (in
  passes of one micro-batch, as a searcher scores),
  on Qwen2.5 0.5B, 1.5B, 3B and 7B (public configurations, random weights made on the device,
  bf16), each tuned four ways: full fine-tuning as by default (AdamW, fp32 master weights), full
  with the least optimizer memory (bitsandbytes' 8-bit AdamW, bf16 weights without masters,
  Kahan-compensated: `train.optimizer=adamw_8bit train.master_weights=none`), LoRA r=16 and
  QLoRA r=16 (the base saved in memory, then loaded back in 4 bits with double quantization);
  gradient checkpointing as `auto` decides it for the shape on this device, and the 0.5B full
  step once with the other choice; B x K = 8 x 16 responses of 256 tokens after 64-token
  prompts, micro-batches of 4 groups: peak device memory (CUDA's allocator) of each, which fit
  on the card, and the peak estimated before the step (`estimated_peak_mib`: what is held, and
  the activations of `tba.policy.activation_memory`, gradients and Adam's state). `--small`
  runs the same on a CPU with narrow shapes, to try it (peak RSS, the interpreter included).

    python -m benchmarks.memory                          # roles: fp32, bf16; none, LoRA, QLoRA
    python -m benchmarks.memory --suite logprobs         # CPU, ~1 min
    python -m benchmarks.memory --suite qwen             # one GPU, ~5 min
    python -m benchmarks.memory --suite qwen --small     # the same on a CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import tba.policy.logprobs as logprobs_module
from benchmarks.shapes import parameters, qwen_config, random_qwen
from tba.config import LoraConfig, QuantizationConfig, RunConfig, TrainConfig
from tba.core import Sample
from tba.peak_memory import PeakMemory
from tba.policy.activation_memory import ModelShape, activation_bytes, checkpointing_choice
from tba.policy.decoding import evaluating
from tba.policy.logprobs import sequence_logprobs
from tba.policy.model import (
    DTYPES,
    add_lora,
    enable_checkpointing,
    get_weights,
    load_policy,
    resolve_device,
)
from tba.policy.tokenizer import build_char_tokenizer, load_tokenizer
from tba.searcher import Searcher
from tba.tasks.math.task import math_task
from tba.tasks.verifiers.last_number import last_number_reward
from tba.trainer import Trainer


def rss_mib() -> float:
    """The resident set size now (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ------------------------------------------------------------------------ the measured roles


def lora_config(rank: int):
    return LoraConfig(r=rank) if rank else None


def task_rows(count: int) -> list[dict]:
    return math_task(num_train=count, num_eval=1, seed=0).train_rows


def fake_groups(tokenizer, num_prompts: int, group_size: int, length: int):
    """B groups of K responses of `length` tokens each, as the buffer would hand them over."""
    rng = random.Random(0)
    rows = task_rows(num_prompts)
    groups = []
    for prompt_id, row in enumerate(rows):
        prompt = tokenizer(row["prompt"])["input_ids"]
        groups.append([
            Sample(prompt_id, prompt, [rng.randrange(4, 60) for _ in range(length)],
                   reward=float(k % 2), ref_logp=-50.0, behaviour_logp=-50.0, version=0,
                   behaviour_token_logps=[-50.0 / length] * length)
            for k in range(group_size)
        ])  # fmt: skip
    return groups


def measure_trainer(args: argparse.Namespace) -> dict:
    imported = rss_mib()
    tokenizer = load_tokenizer(args.model_dir)
    model = load_policy(args.model_dir, "cpu", dtype=args.dtype, lora=lora_config(args.rank),
                        quantization=QuantizationConfig(bits=args.bits))  # fmt: skip
    trainer = Trainer(model, TrainConfig(learning_rate=1e-5, max_grad_norm=1.0),
                      pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip
    groups = fake_groups(tokenizer, args.num_prompts, args.group_size, args.length)
    for _ in range(args.steps):
        trainer.step(groups, beta=0.05)
    weights = trainer.weights()
    return {
        "after_imports": imported,
        "peak": peak_rss_mib(),
        "end": rss_mib(),
        "payload_mib": sum(array.nbytes for array in weights.values()) / 2**20,
        "trainable": sum(p.numel() for p in trainer.masters.params),
    }


def measure_searcher(args: argparse.Namespace) -> dict:
    imported = rss_mib()
    tokenizer = load_tokenizer(args.model_dir)
    model = load_policy(args.model_dir, "cpu", dtype=args.dtype, lora=lora_config(args.rank),
                        quantization=QuantizationConfig(bits=args.bits))  # fmt: skip
    config = RunConfig(policy={"max_new_tokens": args.length},
                       train={"group_size": args.group_size, "truncated": "penalize"})  # fmt: skip
    searcher = Searcher(model, tokenizer, task_rows(64), [last_number_reward], config)
    searcher.generate(args.num_prompts)
    searcher.set_weights(load_file(args.payload), version=1, step=1)
    searcher.generate(args.num_prompts)
    return {"after_imports": imported, "peak": peak_rss_mib(), "end": rss_mib()}


def write_payload(args: argparse.Namespace) -> dict:
    """What a trainer publishes for this setting (weights nudged, so that a sync changes them)."""
    model = load_policy(args.model_dir, "cpu", dtype=args.dtype, lora=lora_config(args.rank),
                        quantization=QuantizationConfig(bits=args.bits))  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1e-3)
    save_file(get_weights(model), args.payload)
    return {}


# ------------------------------------------------------------ one train step at a real shape


def random_groups(vocab: int, num_prompts: int, group_size: int, prompt_length: int,
                  length: int, seed: int = 0) -> list[list[Sample]]:  # fmt: skip
    """B groups of K responses of `length` random tokens after a random prompt each."""
    rng = random.Random(seed)
    groups = []
    for prompt_id in range(num_prompts):
        prompt = [rng.randrange(2, vocab) for _ in range(prompt_length)]
        groups.append([
            Sample(prompt_id, prompt, [rng.randrange(2, vocab) for _ in range(length)],
                   reward=float(k % 2), ref_logp=-12.0 * length, behaviour_logp=-12.0 * length,
                   version=0, behaviour_token_logps=[-12.0] * length)
            for k in range(group_size)
        ])  # fmt: skip
    return groups


ROOT = Path(__file__).resolve().parents[1]  # measurements run as `python -m benchmarks.memory`
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)  # fmt: skip


def measure_step(args: argparse.Namespace) -> dict:
    """One configuration of the logprobs or qwen suite: train steps, then the reference scoring of
    the same batch, each with its own peak."""
    device = resolve_device(args.device)
    config = qwen_config(args.shape, **(SMALL if args.small else {}))
    if args.bits:
        model = quantized_qwen(config, device, args)
    else:
        model = random_qwen(config, device, DTYPES[args.dtype])
        if args.rank:
            model = add_lora(model, LoraConfig(r=args.rank))
        if args.checkpointing:
            enable_checkpointing(model)
    if args.logprobs == "full":  # the plain computation everywhere, in place of the chunked one
        logprobs_module.output_layer = lambda model: None
    settings = TrainConfig(learning_rate=1e-6, max_grad_norm=1.0,
                           micro_batch_groups=args.micro_batch_groups, optimizer=args.optimizer,
                           master_weights=args.master_weights,
                           gradient_checkpointing=args.checkpointing)  # fmt: skip
    trainer = Trainer(model.train(), settings, pad_id=0, temperature=1.0)
    groups = random_groups(config.vocab_size, args.num_prompts, args.group_size,
                           args.prompt_length, args.length)  # fmt: skip
    memory = PeakMemory(device)
    seconds = []
    try:
        for _ in range(args.steps):
            memory.reset()
            held = memory.current_mib()  # the model, Adam's state, Python: before the step
            estimate = estimated_peak_mib(trainer, args, held, device)
            start = time.perf_counter()
            trainer.step(groups, beta=0.05)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        step_peak = memory.peak_mib()
        memory.reset()
        flat = [s for group in groups for s in group]
        size = (args.micro_batch_groups or args.num_prompts) * args.group_size
        with torch.no_grad(), evaluating(model):
            for start in range(0, len(flat), size):  # as a searcher scores: a micro-batch a pass
                part = flat[start : start + size]
                sequence_logprobs(model, [s.prompt_ids for s in part],
                                  [s.response_ids for s in part], pad_id=0)  # fmt: skip
        score_peak = memory.peak_mib()
    except torch.OutOfMemoryError:
        return {"oom": True, "parameters": parameters(config)}
    return {"oom": False, "parameters": parameters(config), "step_peak_mib": step_peak,
            "held_mib": held, "estimate_mib": estimate,
            "score_peak_mib": score_peak, "step_seconds": statistics.median(seconds),
            "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in flat)}  # fmt: skip


def estimated_peak_mib(trainer: Trainer, args: argparse.Namespace, held_mib: float,
                       device: torch.device) -> float:  # fmt: skip
    """The peak of the next step as estimated before it: what is held (measured), and the larger
    of its last micro-batch's backward pass (the activations of `tba.policy.activation_memory`,
    the model's gradients, and the fp32 masters' gradients of the micro-batches before it) and
    its optimizer step (every weight's gradient; Adam's state where this step makes it, 8 bytes
    a weight, 2 in 8 bits; torch AdamW's temporary of 4 bytes a weight; with
    `master_weights=none`, each 16-bit weight stepped alone as an fp32 view with an fp32
    gradient)."""
    masters = trainer.masters
    model_grads = sum(p.numel() * p.element_size() for p in masters.model_params)
    master_grads = sum(m.numel() * 4 for m, p in zip(masters.params, masters.model_params)
                       if m is not p)  # fmt: skip
    weights = sum(m.numel() for m in masters.params)
    largest = max(m.numel() for m in masters.params)
    torch_adam = args.optimizer == "adamw"
    state = 0 if trainer.optimizer.state else weights * (8 if torch_adam else 2)
    if args.master_weights == "none":
        temporary = (8 + 4 * torch_adam) * largest
    else:
        temporary = 4 * weights * torch_adam
    rows = (args.micro_batch_groups or args.num_prompts) * args.group_size
    activations = activation_bytes(ModelShape.of(trainer.model), rows,
                                   args.prompt_length + args.length,
                                   checkpointing=args.checkpointing,
                                   device_type=device.type)  # fmt: skip
    several = rows < args.num_prompts * args.group_size  # master gradients from earlier ones
    backward = activations + model_grads + (master_grads if several else 0)
    step = sum(m.numel() * m.element_size() for m in masters.params) + state + temporary
    return held_mib + max(backward, step) / 2**20


def quantized_qwen(config, device: torch.device, args: argparse.Namespace):
    """QLoRA: a random model of `config` saved, then loaded back as a run loads it, its linear
    layers quantized to `args.bits` (bitsandbytes quantizes while loading), with adapters. Saved
    in memory (/dev/shm where it holds the model), not on disk: a 7B model is 15 GB in bf16."""
    size = parameters(config) * DTYPES[args.dtype].itemsize
    shm = Path("/dev/shm")
    memory = str(shm) if shm.is_dir() and shutil.disk_usage(shm).free > 1.2 * size else None
    with tempfile.TemporaryDirectory(dir=memory) as directory:
        model = random_qwen(config, device, DTYPES[args.dtype])
        model.save_pretrained(directory)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return load_policy(directory, device, dtype=args.dtype, lora=LoraConfig(r=args.rank),
                           gradient_checkpointing=args.checkpointing,
                           quantization=QuantizationConfig(bits=args.bits, double_quant=True))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_command(args: argparse.Namespace, shape: str, rank: int, checkpointing: bool,
                 logprobs: str, bits: int = 0, optimizer: str = "adamw",
                 master_weights: str = "fp32") -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "benchmarks.memory", "--role", "step", "--shape", shape,
        "--rank", str(rank), "--bits", str(bits), "--logprobs", logprobs, "--dtype", args.dtype,
        "--device", args.device, "--optimizer", optimizer, "--master-weights", master_weights,
        "--steps", str(args.steps), "--num-prompts", str(args.num_prompts),
        "--group-size", str(args.group_size), "--prompt-length", str(args.prompt_length),
        "--length", str(args.length), "--micro-batch-groups", str(args.micro_batch_groups or 0),
        *(["--checkpointing"] if checkpointing else []), *(["--small"] if args.small else []),
    ]  # fmt: skip


def run_step(args: argparse.Namespace, *config) -> dict:
    done = subprocess.run(step_command(args, *config), check=True, capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def logprobs_suite(args: argparse.Namespace) -> None:
    """Full logits against chunked log-probs, on the narrow wide-vocabulary model."""
    print(f"narrow Qwen2 (vocabulary 151,936, width 64, 1 layer), {args.dtype}, "
          f"B={args.num_prompts} x K={args.group_size}, {args.length} response tokens, "
          f"median of {args.steps} steps\n")  # fmt: skip
    print("| log-probs | peak RSS of a train step | of which the step's own | step seconds | "
          "reference scoring peak |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    results = {}
    for logprobs in ("full", "chunked"):
        result = results[logprobs] = run_step(args, "narrow", 0, False, logprobs)
        result["own_mib"] = result["step_peak_mib"] - result["held_mib"]
        print(f"| {logprobs} | {result['step_peak_mib']:.0f} MiB | {result['own_mib']:.0f} MiB | "
              f"{result['step_seconds']:.2f} | {result['score_peak_mib']:.0f} MiB |",
              flush=True)  # fmt: skip
    full, chunked = results["full"], results["chunked"]
    print(f"\nfull / chunked: the step's own memory {full['own_mib'] / chunked['own_mib']:.1f}x, "
          f"time {full['step_seconds'] / chunked['step_seconds']:.2f}x")  # fmt: skip


QWEN_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")
# (LoRA rank, bits of the base: QLoRA when > 0, train.optimizer, train.master_weights): full
# fine-tuning as today's default, full with the least optimizer memory, LoRA, QLoRA.
QWEN_TUNINGS = [(0, 0, "adamw", "fp32"), (0, 0, "adamw_8bit", "none"), (16, 0, "adamw", "fp32"),
                (16, 4, "adamw", "fp32")]  # fmt: skip


def qwen_rows(args: argparse.Namespace) -> list[tuple]:
    """(shape, rank, checkpointing, bits, optimizer, master weights) of every measurement: each
    shape with each tuning, gradient checkpointing as `train.gradient_checkpointing=auto` sets
    it for the shape on this device (`auto_checkpointing`); and the 0.5B full step with the
    other choice, to show what it changes."""
    rows = [(shape, rank, auto_checkpointing(args, shape), bits, optimizer, master_weights)
            for shape in QWEN_SHAPES for rank, bits, optimizer, master_weights in QWEN_TUNINGS]
    rows.insert(1, ("qwen2.5-0.5b", 0, not rows[0][2], 0, "adamw", "fp32"))
    return rows


def auto_checkpointing(args: argparse.Namespace, shape: str) -> bool:
    """What `train.gradient_checkpointing=auto` decides for a step of `shape` on this device
    (`tba.policy.activation_memory.checkpointing_choice`): here, before the model is made, from
    the device's whole free memory."""
    config = qwen_config(shape, **(SMALL if args.small else {}))
    rows = (args.micro_batch_groups or args.num_prompts) * args.group_size
    on, _ = checkpointing_choice("auto", resolve_device(args.device),
                                 ModelShape.of_config(config, DTYPES[args.dtype].itemsize),
                                 rows, args.prompt_length + args.length)  # fmt: skip
    return on


def tuning_label(rank: int, bits: int, optimizer: str, master_weights: str) -> str:
    """How a row of the qwen suite is tuned, as its table says it."""
    tuning = (f"QLoRA r={rank}, {bits}-bit base" if bits else f"LoRA r={rank}" if rank
              else "full")  # fmt: skip
    tuning += ", 8-bit Adam" if optimizer != "adamw" else ""
    return tuning + (", no masters (Kahan)" if master_weights == "none" else "")


def measure_qwen_row(args: argparse.Namespace, row: tuple) -> dict:
    """One row of `qwen_rows` measured in a fresh process: its step's and reference scoring's
    peaks and the step's seconds, or `oom`. CalledProcessError where the process failed."""
    shape, rank, checkpointing, bits, optimizer, master_weights = row
    return run_step(args, shape, rank, checkpointing, "chunked", bits, optimizer, master_weights)


def qwen_suite(args: argparse.Namespace) -> None:
    """Qwen2.5 sizes, full, LoRA and QLoRA: the step's peak and whether it fits."""
    total = (torch.cuda.get_device_properties(0).total_memory / 2**30
             if torch.cuda.is_available() else None)  # fmt: skip
    card = torch.cuda.get_device_name(0) if total else "CPU (--small shapes)"
    print(f"{card}; {args.dtype}; B={args.num_prompts} x K={args.group_size}, "
          f"{args.prompt_length}-token prompts, {args.length} response tokens, "
          f"micro-batches of {args.micro_batch_groups} groups\n")  # fmt: skip
    print("| model | parameters | tuning | checkpointing | train step peak | estimate | "
          "reference scoring peak | step seconds |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = qwen_rows(args)
    for row in rows:
        shape, rank, checkpointing, bits, optimizer, master_weights = row
        if args.only and shape not in args.only:
            continue
        result = measure_qwen_row(args, row)
        tuning = tuning_label(rank, bits, optimizer, master_weights)
        size = f"{result['parameters'] / 1e9:.2f}B"
        if result["oom"]:
            print(f"| {shape} | {size} | {tuning} | {checkpointing} | out of memory | | | |",
                  flush=True)  # fmt: skip
            continue
        print(f"| {shape} | {size} | {tuning} | {checkpointing} | "
              f"{result['step_peak_mib'] / 1024:.1f} GiB | {result['estimate_mib'] / 1024:.1f} "
              f"GiB | {result['score_peak_mib'] / 1024:.1f} GiB | {result['step_seconds']:.2f} |",
              flush=True)  # fmt: skip


# ------------------------------------------------------------------------------- the driver


def create_model(directory: Path, hidden_size: int = 768, num_layers: int = 12) -> int:
    """A random Llama (32k vocabulary, tied embeddings, heads of 64) saved in `directory`; its
    parameter count. The defaults: 110M parameters."""
    tokenizer = build_char_tokenizer()
    heads = hidden_size // 64
    config = LlamaConfig(
        vocab_size=32000, hidden_size=hidden_size, intermediate_size=hidden_size * 8 // 3 // 64
        * 64, num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def run_role(role: str, args: argparse.Namespace, dtype: str, rank: int, bits: int,
             payload: Path) -> dict:  # fmt: skip
    command = [
        sys.executable, "-m", "benchmarks.memory", "--role", role, "--model-dir", args.model_dir,
        "--dtype", dtype, "--rank", str(rank), "--bits", str(bits), "--payload", str(payload),
        "--steps", str(args.steps), "--num-prompts", str(args.num_prompts),
        "--group-size", str(args.group_size), "--length", str(args.length),
    ]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def roles_suite(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = str(Path(tmp) / "llama-110m")
        size = create_model(Path(args.model_dir))
        print(f"Llama with {size / 1e6:.0f}M parameters; B={args.num_prompts}, "
              f"K={args.group_size}, {args.length} response tokens, {args.steps} trainer steps\n")
        print("| role | dtype | LoRA | after imports | peak RSS | RSS at the end | sync payload |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        tunings = [(0, 0), (args.lora_rank, 0), *((args.lora_rank, b) for b in args.qlora_bits)]
        for dtype in args.dtypes:
            for rank, bits in tunings:
                payload = Path(tmp) / f"payload-{dtype}-{rank}-{bits}.safetensors"
                run_role("payload", args, dtype, rank, bits, payload)
                lora = (f"r={rank}" if rank else "no") + (f", base in {bits} bits" if bits else "")
                trainer = run_role("trainer", args, dtype, rank, bits, payload)
                searcher = run_role("searcher", args, dtype, rank, bits, payload)
                for name, result in (("trainer", trainer), ("searcher", searcher)):
                    sent = f"{trainer['payload_mib']:.1f} MiB" if name == "trainer" else ""
                    print(f"| {name} | {dtype} | {lora} | {result['after_imports']:.0f} MiB | "
                          f"{result['peak']:.0f} MiB | {result['end']:.0f} MiB | {sent} |",
                          flush=True)  # fmt: skip


# Per suite: the settings its measurements default to (the roles suite's are the parser's).
SUITE_DEFAULTS = {
    "roles": {},
    "logprobs": dict(dtypes=["float32"], steps=3, num_prompts=4, group_size=8, length=64,
                     prompt_length=16, micro_batch_groups=0),
    # One step each: its peak holds everything (Adam's state is made in the first step); within
    # 5 minutes on one H100 or H200 for the 17 rows.
    "qwen": dict(dtypes=["bfloat16"], steps=1, num_prompts=8, group_size=16, length=256,
                 prompt_length=64, micro_batch_groups=4),
}  # fmt: skip
SMALL_QWEN = dict(num_prompts=2, group_size=4, length=16, prompt_length=8, micro_batch_groups=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the chosen suite's defaults (and `--small`'s) filled in."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=list(SUITE_DEFAULTS), default="roles")
    parser.add_argument("--small", action="store_true",
                        help="qwen suite: narrow shapes and a small batch, to try it on a CPU")
    parser.add_argument("--only", nargs="+", help="qwen suite: these shapes only")
    parser.add_argument("--dtypes", nargs="+", default=None)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--qlora-bits", type=int, nargs="*", default=[4],
                        help="roles suite: also LoRA on the base quantized to these bits")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=None, help="B")
    parser.add_argument("--group-size", type=int, default=None, help="K (and S)")
    parser.add_argument("--length", type=int, default=None, help="response tokens")
    parser.add_argument("--prompt-length", type=int, default=None)
    parser.add_argument("--micro-batch-groups", type=int, default=None,
                        help="groups per micro-batch (0: the whole batch at once)")
    parser.add_argument("--device", default="auto")
    # Internal: one measurement in this process.
    parser.add_argument("--role", choices=["trainer", "searcher", "payload", "step"])
    parser.add_argument("--model-dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--bits", type=int, default=0)
    parser.add_argument("--payload")
    parser.add_argument("--shape")
    parser.add_argument("--logprobs", choices=["full", "chunked"], default="chunked")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--optimizer", default="adamw", help="step: train.optimizer")
    parser.add_argument("--master-weights", default="fp32", help="step: train.master_weights")
    args = parser.parse_args(argv)
    defaults = dict(dtypes=["float32", "bfloat16"], steps=2, num_prompts=2, group_size=4,
                    length=24, prompt_length=16, micro_batch_groups=0)  # fmt: skip
    defaults |= SUITE_DEFAULTS[args.suite] | (SMALL_QWEN if args.small else {})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.micro_batch_groups = args.micro_batch_groups or None
    args.dtype = args.dtype if args.role else args.dtypes[0]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role:
        role = {"trainer": measure_trainer, "searcher": measure_searcher,
                "payload": write_payload, "step": measure_step}  # fmt: skip
        print(json.dumps(role[args.role](args)))
        return
    {"roles": roles_suite, "logprobs": logprobs_suite, "qwen": qwen_suite}[args.suite](args)


if __name__ == "__main__":
    main()
