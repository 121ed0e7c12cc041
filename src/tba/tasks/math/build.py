"""The built-in math policy (`builtin:math`, `tba pretrain`): a tiny Llama supervised on a limited
set of worked solutions.

RL sharpens what a policy can already sample; it rarely teaches what the policy never samples. So
the base policy is trained only part of the way: it solves some held-out problems greedily and
many more within 16 samples, which leaves TB something to sharpen. It is built once per setting
of `pretrain` and seed, and cached.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

from tba.config import PretrainConfig
from tba.policy.model import build_tiny_llama
from tba.policy.sft import supervise
from tba.policy.sources import built_once
from tba.policy.tokenizer import build_char_tokenizer
from tba.tasks.math import world


def policy_dir(pretrain: PretrainConfig, seed: int, log=print) -> Path:
    """The built-in math policy of these settings and seed, built on first use."""
    return built_once(
        cached_dir(pretrain, seed), "config.json", "the built-in base policy",
        lambda staging: pretrain_math_policy(
            staging, num_examples=pretrain.num_examples, steps=pretrain.steps,
            batch_size=pretrain.batch_size, lr=pretrain.learning_rate,
            sloppy_fraction=pretrain.sloppy_fraction, seed=seed, log=log,
        ),
        log,
    )  # fmt: skip


def cached_dir(pretrain: PretrainConfig, seed: int) -> Path:
    """The cache entry is keyed by everything that shapes the base policy."""
    settings = pretrain.model_dump(exclude={"cache_dir"}) | {
        "seed": seed,
        "task_version": world.VERSION,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(pretrain.cache_dir).expanduser() / f"math-{key}"


def pretrain_math_policy(
    out_dir: Path,
    *,
    num_examples: int,
    steps: int,
    batch_size: int,
    lr: float,
    sloppy_fraction: float,
    seed: int,
    log=print,
) -> Path:
    """Train the tiny policy on `num_examples` worked solutions for `steps` steps, save it.

    A `sloppy_fraction` of the three-step solutions stop one step early (see
    `world.stopped_early`), as imperfect demonstrations do: the base policy picks up the habit
    often enough that greedy decoding keeps it, while sampling still finishes many problems.
    """
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        seed=seed,
    )
    examples = world.problems("train", num_examples, seed)
    prompts = [tokenizer(world.format_prompt(p.question))["input_ids"] for p in examples]
    rng = random.Random(seed)
    solutions = [
        world.stopped_early(p) if rng.random() < sloppy_fraction else p.solution for p in examples
    ]
    responses = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in solutions]
    responses = [r + [tokenizer.eos_token_id] for r in responses]

    supervise(model, prompts, responses, tokenizer.pad_token_id, steps=steps,
              batch_size=batch_size, lr=lr, rng=rng, log=log, name="pretrain")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
