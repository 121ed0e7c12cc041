"""Peak memory of the trainer and of a searcher on a ~100M-parameter Llama, with and without LoRA.

The model (12 layers, width 768, 32k vocabulary, tied embeddings: 110M parameters) is created
randomly in a temporary directory. Every measurement runs in a fresh Python process, so that
`ru_maxrss` (the peak resident set size) is that of one role alone:

- trainer: load the policy, take `--steps` optimizer steps on B x K responses, publish weights;
- searcher: load the policy (and, without LoRA, the frozen reference copy), generate a batch with
  reference log-probs, receive a weight sync (the payload a trainer publishes, read from a file
  as it would arrive from Ray's object store), generate again.

"after imports" is the same process before the model is loaded (Python, torch, transformers).

    python -m benchmarks.memory                          # fp32 and bf16, LoRA rank 16 or none
    python -m benchmarks.memory --dtypes float32 --lora-rank 8
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tba.config import LoraConfig
from tba.core import Sample
from tba.policy.model import get_weights, load_policy
from tba.policy.tokenizer import build_char_tokenizer, load_tokenizer
from tba.searcher import Searcher, SearchSettings
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
    model = load_policy(args.model_dir, "cpu", dtype=args.dtype, lora=lora_config(args.rank))
    trainer = Trainer(model, pad_id=tokenizer.pad_token_id, temperature=1.0,
                      learning_rate=1e-5, max_grad_norm=1.0)  # fmt: skip
    groups = fake_groups(tokenizer, args.num_prompts, args.group_size, args.length)
    for _ in range(args.steps):
        trainer.step(groups, beta=0.05)
    weights, _, _ = trainer.next_version()
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
    model = load_policy(args.model_dir, "cpu", dtype=args.dtype, lora=lora_config(args.rank))
    settings = SearchSettings(
        samples_per_prompt=args.group_size, temperature=1.0, max_new_tokens=args.length,
        truncated="penalize", truncation_penalty=-1.0,
    )  # fmt: skip
    searcher = Searcher(model, tokenizer, task_rows(64), [last_number_reward], settings)
    searcher.generate(args.num_prompts)
    searcher.set_weights(load_file(args.payload), version=1, step=1)
    searcher.generate(args.num_prompts)
    return {"after_imports": imported, "peak": peak_rss_mib(), "end": rss_mib()}


def write_payload(args: argparse.Namespace) -> dict:
    """What a trainer publishes for this setting (weights nudged, so that a sync changes them)."""
    model = load_policy(args.model_dir, "cpu", dtype=args.dtype, lora=lora_config(args.rank))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1e-3)
    save_file(get_weights(model), args.payload)
    return {}


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


def run_role(role: str, args: argparse.Namespace, dtype: str, rank: int, payload: Path) -> dict:
    command = [
        sys.executable, __file__, "--role", role, "--model-dir", args.model_dir,
        "--dtype", dtype, "--rank", str(rank), "--payload", str(payload),
        "--steps", str(args.steps), "--num-prompts", str(args.num_prompts),
        "--group-size", str(args.group_size), "--length", str(args.length),
    ]  # fmt: skip
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=2, help="B")
    parser.add_argument("--group-size", type=int, default=4, help="K (and S)")
    parser.add_argument("--length", type=int, default=24, help="response tokens")
    # Internal: one measurement in this process.
    parser.add_argument("--role", choices=["trainer", "searcher", "payload"])
    parser.add_argument("--model-dir")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--payload")
    args = parser.parse_args()
    if args.role:
        role = {"trainer": measure_trainer, "searcher": measure_searcher, "payload": write_payload}
        print(json.dumps(role[args.role](args)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = str(Path(tmp) / "llama-110m")
        size = create_model(Path(args.model_dir))
        print(f"Llama with {size / 1e6:.0f}M parameters; B={args.num_prompts}, "
              f"K={args.group_size}, {args.length} response tokens, {args.steps} trainer steps\n")
        print("| role | dtype | LoRA | after imports | peak RSS | RSS at the end | sync payload |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for dtype in args.dtypes:
            for rank in (0, args.lora_rank):
                payload = Path(tmp) / f"payload-{dtype}-{rank}.safetensors"
                run_role("payload", args, dtype, rank, payload)
                lora = f"r={rank}" if rank else "no"
                trainer = run_role("trainer", args, dtype, rank, payload)
                searcher = run_role("searcher", args, dtype, rank, payload)
                for name, result in (("trainer", trainer), ("searcher", searcher)):
                    sent = f"{trainer['payload_mib']:.1f} MiB" if name == "trainer" else ""
                    print(f"| {name} | {dtype} | {lora} | {result['after_imports']:.0f} MiB | "
                          f"{result['peak']:.0f} MiB | {result['end']:.0f} MiB | {sent} |",
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
