"""`tba pretrain`: the built-in tiny models, supervised by the project on synthetic data.

- **math**: the policy, on a limited set of worked solutions. RL sharpens what a policy can
  already sample; it rarely teaches what the policy never samples. So the base policy is trained
  only part of the way: it solves some held-out problems greedily and many more within 16
  samples, which leaves TB something to sharpen.
- **redteam**: the red-teaming world of `tba.tasks.redteam_world`: the attacker's prior (the
  policy), the victim and the harmfulness classifier, sharing one word-level tokenizer.
- **summarize**: the summarisation world of `tba.tasks.summarize_world`: the SFT summariser (the
  policy) and the proxy reward model trained on the gold judge's preferences.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
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


def train_classifier(
    model, tokenizer, pairs: list[tuple[str, int]], *, steps: int, batch_size: int, lr: float,
    rng: random.Random, log=print,
) -> None:  # fmt: skip
    """Cross-entropy on (text, label) pairs, texts right-padded."""

    def batch_loss() -> torch.Tensor:
        batch = rng.sample(pairs, batch_size)
        ids = [tokenizer(text)["input_ids"] for text, _ in batch]
        input_ids, attention = right_pad(ids, tokenizer.pad_token_id, "cpu")
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        labels = torch.tensor([label for _, label in batch])
        return torch.nn.functional.cross_entropy(logits, labels)

    fit(model, batch_loss, steps=steps, lr=lr, name="classifier", log=log)


def fit(
    model, batch_loss: Callable[[], torch.Tensor], *, steps: int, lr: float, name: str, log=print
) -> None:
    """`steps` AdamW steps at a constant `lr`, each on `batch_loss()` (a fresh batch's loss)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    start = time.time()
    model.train()
    for step in range(steps):
        loss = batch_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"{name} step {step}/{steps} loss {loss.item():.4f} ({time.time() - start:.0f}s)")



def build_summarize_world(out_dir: Path, *, seed: int, scale: float = 1.0, log=print) -> Path:
    """policy/ (the SFT summariser) and proxy/ (its reward model) in `out_dir`, each loadable
    with `from_pretrained` and holding the world's tokenizer, and world.json (what the build
    measured: the SFT policy's greedy win rate on the held-out posts, the proxy's pairwise
    accuracy). `scale` multiplies the data and the steps (tests build a smaller world).

    - The SFT policy imitates the careless reference summaries of `summarize_world.posts("sft")`:
      it learns to copy events from the post (the copying sets in after a few hundred steps)
      and keeps the annotator's habits (greedy, it mostly leaves out the last key event).
    - The proxy is a Bradley-Terry reward model trained on the gold judge's preferences between
      the SFT policy's sampled summaries of a post (as the paper's proxy was trained on a larger
      model's labels), ties left out. It is small (one layer) and sees only what one policy
      writes, so it learns the judge in part: it credits the events a summary states without
      checking them against the post, and a policy that adds or repeats events over-optimises
      it. Its pairwise accuracy on the pairs of held-out posts is logged and saved to world.json.
    """
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tba.policy.tokenizer import build_word_tokenizer
    from tba.tasks import summarize_world as world
    from tba.tasks.preference import win

    start = time.time()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer(world.vocabulary())
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    def n(count: int) -> int:
        return max(1, round(count * scale))

    posts = world.posts("sft", n(8000))
    policy = build_tiny_llama(
        len(tokenizer), pad_token_id=pad, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        hidden_size=64, num_layers=2, num_heads=4, max_positions=128, seed=seed,
    )  # fmt: skip
    prompts = [tokenizer(p.prompt)["input_ids"] for p in posts]
    responses = [tokenizer(p.reference, add_special_tokens=False)["input_ids"] + [eos]
                 for p in posts]  # fmt: skip
    supervise(policy, prompts, responses, pad, steps=n(1200), batch_size=32, lr=3e-3, rng=rng,
              log=log, name="summarizer")  # fmt: skip
    held_out_posts = world.posts("test", n(512))
    (greedy,) = zip(*sample_summaries(policy, tokenizer, [p.prompt for p in held_out_posts],
                                      samples=1, max_new_tokens=world.MAX_SUMMARY_WORDS,
                                      seed=seed, greedy=True))  # fmt: skip
    sft_win_rate = sum(
        win(world.judge(p.prompt, summary).score, world.judge(p.prompt, p.reference).score)
        for p, summary in zip(held_out_posts, greedy)
    ) / len(held_out_posts)
    log(f"SFT policy: greedy win rate {sft_win_rate:.3f} against the references")

    # The proxy learns from the policy's own summaries; a fifth of the posts are held out.
    labelled = [p.prompt for p in world.posts("preference", n(2000))]
    summaries = sample_summaries(policy, tokenizer, labelled, samples=4,
                                 max_new_tokens=world.MAX_SUMMARY_WORDS, seed=seed)  # fmt: skip
    pairs = [ranked_pairs(post, four, world.gold_scores) for post, four in zip(labelled, summaries)]
    cut = len(labelled) - max(1, len(labelled) // 5)
    train = [pair for per_post in pairs[:cut] for pair in per_post]
    held_out = [pair for per_post in pairs[cut:] for pair in per_post]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=pad, num_labels=1)  # fmt: skip
    proxy = LlamaForSequenceClassification(config)
    train_reward_model(proxy, tokenizer, train, steps=n(400), batch_size=64, lr=3e-3, rng=rng,
                       log=log)  # fmt: skip
    report = {
        "version": world.VERSION,
        "sft_greedy_win_rate": sft_win_rate,
        "proxy_train_pairs": len(train),
        "proxy_train_accuracy": pairwise_accuracy(proxy, tokenizer, train),
        "proxy_held_out_pairs": len(held_out),
        "proxy_held_out_accuracy": pairwise_accuracy(proxy, tokenizer, held_out),
        "build_seconds": round(time.time() - start, 1),
    }
    log(f"proxy reward model: pairwise accuracy {report['proxy_held_out_accuracy']:.3f} on "
        f"{len(held_out)} pairs of held-out posts ({report['proxy_train_accuracy']:.3f} on its "
        f"{len(train)} training pairs)")  # fmt: skip
    for name, model in (("policy", policy), ("proxy", proxy)):
        model.save_pretrained(out_dir / name)
        tokenizer.save_pretrained(out_dir / name)
    (out_dir / "world.json").write_text(json.dumps(report, indent=2))
    return out_dir


@torch.no_grad()
def sample_summaries(
    model, tokenizer, prompts: list[str], *, samples: int, max_new_tokens: int, seed: int,
    greedy: bool = False, batch_size: int = 512,
) -> list[list[str]]:  # fmt: skip
    """`samples` responses to each prompt at temperature 1 (or greedy), decoded."""
    from tba.policy.sampling import generate

    generator = torch.Generator().manual_seed(seed)
    ids = [tokenizer(p)["input_ids"] for p in prompts for _ in range(samples)]
    texts: list[str] = []
    for first in range(0, len(ids), batch_size):
        out = generate(model, ids[first : first + batch_size], eos_id=tokenizer.eos_token_id,
                       pad_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens,
                       greedy=greedy, generator=generator)  # fmt: skip
        texts += tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    return [texts[i : i + samples] for i in range(0, len(texts), samples)]


Preference = tuple[str, str, str]  # (prompt, chosen response, rejected response)


def ranked_pairs(prompt: str, responses: list[str], judge) -> list[Preference]:
    """Every pair of distinct responses that `judge(prompts, responses) -> scores` does not tie,
    the preferred one first."""
    scores = judge([prompt] * len(responses), responses)
    return [
        (prompt, a, b) if sa > sb else (prompt, b, a)
        for i, (a, sa) in enumerate(zip(responses, scores))
        for b, sb in zip(responses[i + 1 :], scores[i + 1 :])
        if sa != sb
    ]


def reward_model_scores(model, tokenizer, prompts: list[str], responses: list[str]):
    """The reward model's score of each `prompt + response + EOS`, read at that EOS, as
    `tldr.RewardModel` reads it (differentiable)."""
    from tba.tasks.tldr import last_token_logits

    ids = [tokenizer(p + r + tokenizer.eos_token)["input_ids"] for p, r in zip(prompts, responses)]
    input_ids, attention = right_pad(ids, tokenizer.pad_token_id, "cpu")
    batch = {"input_ids": input_ids, "attention_mask": attention}
    return last_token_logits(model, batch)[:, 0]


def train_reward_model(
    model, tokenizer, pairs: list[Preference], *, steps: int, batch_size: int, lr: float,
    rng: random.Random, center: float = 0.01, log=print,
) -> None:  # fmt: skip
    """Bradley-Terry on preference pairs, with a small pull of the scores toward zero (so that
    typical summaries score near 0 and the truncation penalty, -1, means the same to every run):

        loss = -log sigmoid(r(chosen) - r(rejected)) + center * (r(chosen) + r(rejected))^2
    """

    def batch_loss() -> torch.Tensor:
        batch = rng.sample(pairs, min(batch_size, len(pairs)))
        prompts = [p for p, _, _ in batch] * 2
        scores = reward_model_scores(model, tokenizer, prompts,
                                     [c for _, c, _ in batch] + [r for _, _, r in batch])
        chosen, rejected = scores.chunk(2)
        return (-torch.nn.functional.logsigmoid(chosen - rejected)
                + center * (chosen + rejected) ** 2).mean()  # fmt: skip

    fit(model, batch_loss, steps=steps, lr=lr, name="reward model", log=log)
    model.eval()


@torch.no_grad()
def pairwise_accuracy(model, tokenizer, pairs: list[Preference], batch_size: int = 256) -> float:
    """The share of pairs the reward model orders as the labels do (a tie counts half)."""
    if not pairs:
        return float("nan")
    agree = 0.0
    for first in range(0, len(pairs), batch_size):
        batch = pairs[first : first + batch_size]
        prompts = [p for p, _, _ in batch] * 2
        scores = reward_model_scores(model, tokenizer, prompts,
                                     [c for _, c, _ in batch] + [r for _, _, r in batch])
        chosen, rejected = scores.chunk(2)
        agree += float((chosen > rejected).sum() + 0.5 * (chosen == rejected).sum())
    return agree / len(pairs)
