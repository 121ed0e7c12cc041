"""`tba pretrain`: the built-in tiny models, supervised by the project on synthetic data.

- **math**: the policy, on a limited set of worked solutions. RL sharpens what a policy can
  already sample; it rarely teaches what the policy never samples. So the base policy is trained
  only part of the way: it solves some held-out problems greedily and many more within 16
  samples, which leaves TB something to sharpen.
- **redteam**: the red-teaming world of `tba.tasks.redteam_world`: the attacker's prior (the
  policy), the victim and the harmfulness classifier, sharing one word-level tokenizer.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from tba.policy.batching import right_pad
from tba.policy.model import build_tiny_llama
from tba.policy.tokenizer import build_char_tokenizer
from tba.tasks import math as math_task


def right_pad_pairs(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Concatenate prompt and response per row, right-pad; mark which targets are response tokens.

    Returns (input_ids, attention_mask, response_mask) where response_mask[:, t] says whether
    input_ids[:, t + 1] is a response token (the target of position t).
    """
    ids, attention = right_pad([p + r for p, r in zip(prompts, responses)], pad_id, "cpu")
    response_mask = torch.zeros((len(ids), ids.size(1) - 1), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        response_mask[i, len(p) - 1 : len(p) + len(r) - 1] = True
    return ids, attention, response_mask


def sft_loss(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Mean negative log-likelihood of the response tokens (the prompt is context only)."""
    ids, attention, response_mask = right_pad_pairs(prompts, responses, pad_id)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none"
    ).view_as(response_mask)
    return (nll * response_mask).sum() / response_mask.sum()


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
    `math_task.stopped_early`), as imperfect demonstrations do: the base policy picks up the habit
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
    examples = math_task.problems("train", num_examples, seed)
    prompts = [tokenizer(math_task.format_prompt(p.question))["input_ids"] for p in examples]
    rng = random.Random(seed)
    solutions = [
        math_task.stopped_early(p) if rng.random() < sloppy_fraction else p.solution
        for p in examples
    ]
    responses = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in solutions]
    responses = [r + [tokenizer.eos_token_id] for r in responses]

    supervise(model, prompts, responses, tokenizer.pad_token_id, steps=steps,
              batch_size=batch_size, lr=lr, rng=rng, log=log, name="pretrain")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def supervise(
    model,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    rng: random.Random,
    log=print,
    name: str = "sft",
) -> None:
    """Supervised fine-tuning on (prompt, response) pairs: AdamW, linear warm-up, cosine decay,
    shuffled passes over the data."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))),
    )
    order: list[int] = []
    start = time.time()
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(prompts)), len(prompts))
        batch, order = order[:batch_size], order[batch_size:]
        loss = sft_loss(model, [prompts[i] for i in batch], [responses[i] for i in batch], pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"{name} step {step}/{steps} loss {loss.item():.4f} ({time.time() - start:.0f}s)")


def build_redteam_world(out_dir: Path, *, seed: int, scale: float = 1.0, log=print) -> Path:
    """attacker/, victim/ and classifier/ in `out_dir`, each loadable with `from_pretrained` and
    holding the world's tokenizer. Sizes and steps keep the build under a minute or two on two
    CPU cores; `scale` multiplies the data and the steps (tests build a smaller world)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tba.policy.tokenizer import build_word_tokenizer
    from tba.tasks import redteam_world as world

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

    # The victim: instruction -> answer, with the hidden modes, briefly trained.
    examples = world.victim_examples(n(8000), rng)
    victim = tiny(64, 2)
    victim_prompts = [tokenizer(world.VICTIM_TEMPLATE.format(attack=e.instruction))["input_ids"]
                      for e in examples]  # fmt: skip
    supervise(victim, victim_prompts, encode([e.answer for e in examples], end=True), pad,
              steps=n(600), batch_size=64, lr=3e-3, rng=rng, log=log, name="victim")  # fmt: skip

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


def train_classifier(
    model, tokenizer, pairs: list[tuple[str, int]], *, steps: int, batch_size: int, lr: float,
    rng: random.Random, log=print,
) -> None:  # fmt: skip
    """Cross-entropy on (text, label) pairs, texts right-padded."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    start = time.time()
    model.train()
    for step in range(steps):
        batch = rng.sample(pairs, batch_size)
        ids = [tokenizer(text)["input_ids"] for text, _ in batch]
        input_ids, attention = right_pad(ids, tokenizer.pad_token_id, "cpu")
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        labels = torch.tensor([label for _, label in batch])
        loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"classifier step {step}/{steps} loss {loss.item():.4f} "
                f"({time.time() - start:.0f}s)")  # fmt: skip
