"""The embedded red-teaming world's models (`builtin:redteam`, `tba pretrain task.name=redteam`):
the attacker's prior (the policy), the victim and the harmfulness classifier, sharing one
word-level tokenizer, built once into the cache directory. The world is the task, so it is the
same for every run seed."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from tba.config import PretrainConfig
from tba.policy.model import build_tiny_llama
from tba.policy.sft import supervise
from tba.policy.sources import built_once
from tba.policy.tokenizer import build_word_tokenizer
from tba.rewards.training import train_classifier
from tba.tasks.redteam import world


def world_dir(pretrain: PretrainConfig, log=print) -> Path:
    """The embedded red-teaming world (attacker/, victim/, classifier/), built on first use."""
    target = Path(pretrain.cache_dir).expanduser() / f"redteam-v{world.VERSION}"
    build = partial(build_redteam_world, seed=0, log=log)
    return built_once(target, "classifier/config.json", "the red-teaming world", build, log)


def build_redteam_world(out_dir: Path, *, seed: int, scale: float = 1.0, log=print) -> Path:
    """attacker/, victim/ and classifier/ in `out_dir`, each loadable with `from_pretrained` and
    holding the world's tokenizer. Sizes and steps keep the build under a minute or two on two
    CPU cores; `scale` multiplies the data and the steps (tests build a smaller world)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer(world.vocabulary())
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    def encode(texts: list[str], end: bool) -> list[list[int]]:
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return [i + [eos] for i in ids] if end else ids

    def tiny(hidden: int, layers: int):
        return build_tiny_llama(
            len(tokenizer), pad_token_id=pad, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=eos, hidden_size=hidden, num_layers=layers, num_heads=2,
            max_positions=64, seed=seed,
        )  # fmt: skip

    # The attacker's prior: instructions drawn from the grammar, after the fixed prompt.
    def n(count: int) -> int:
        return max(1, round(count * scale))

    attacks = [world.instruction(rng) for _ in range(n(20000))]
    attacker = tiny(64, 2)
    prompt = tokenizer(world.ATTACKER_PROMPT)["input_ids"]
    supervise(attacker, [prompt] * len(attacks), encode(attacks, end=True), pad, steps=n(500),
              batch_size=64, lr=3e-3, rng=rng, log=log, name="attacker")  # fmt: skip

    # The victim: instruction -> answer, with the hidden modes, trained just long enough to tell a
    # mode of three triggers from its near misses with two (imperfectly still).
    examples = world.victim_examples(n(8000), rng)
    victim = tiny(64, 2)
    victim_prompts = [tokenizer(world.VICTIM_TEMPLATE.format(attack=e.instruction))["input_ids"]
                      for e in examples]  # fmt: skip
    supervise(victim, victim_prompts, encode([e.answer for e in examples], end=True), pad,
              steps=n(1200), batch_size=64, lr=3e-3, rng=rng, log=log, name="victim")  # fmt: skip

    # The classifier: P(harmful) of an answer, read at its last token.
    pairs = world.classifier_examples(n(4000), rng)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=pad, num_labels=2,
                         id2label={0: "benign", 1: "harmful"},
                         label2id={"benign": 0, "harmful": 1})  # fmt: skip
    classifier = LlamaForSequenceClassification(config)
    train_classifier(classifier, tokenizer, pairs, steps=n(300), batch_size=64, lr=3e-3, rng=rng,
                     log=log)  # fmt: skip

    for name, model in (("attacker", attacker), ("victim", victim), ("classifier", classifier)):
        model.save_pretrained(out_dir / name)
        tokenizer.save_pretrained(out_dir / name)
    return out_dir
