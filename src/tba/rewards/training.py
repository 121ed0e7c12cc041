"""Training the embedded worlds' judges: a classifier on labelled texts, and a Bradley-Terry
reward model on preference pairs. Both read a sequence-classification head at the last token
(`tba.rewards.models.last_token_logits`), as scoring does."""

from __future__ import annotations

import random

import torch

from tba.policy.batching import right_pad
from tba.policy.sft import fit
from tba.rewards.models import last_token_logits

Preference = tuple[str, str, str]  # (prompt, chosen response, rejected response)


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
    `tba.rewards.models.RewardModel` reads it (differentiable)."""
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
