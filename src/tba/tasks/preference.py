"""Held-out metrics of preference tuning (the `summarize` and `tldr` tasks): how good the
policy's summaries are, and how far from the reference policy it went to write them. The two
together are the axes of the reward/KL Pareto front.

On the held-out rows (each a prompt and a reference summary):

- `eval_win_rate`: the share of prompts whose greedy summary the gold judge scores above the
  reference summary (a tie counts half);
- `eval_gold`: the judge's mean score of the greedy summaries;
- `eval_proxy_reward`: the training reward model's mean score of the same summaries (no
  truncation penalty: the model's own score);

and, when the reference policy pi_ref is known, on one response per prompt sampled from the
policy pi (at the sampling temperature tau, seeded), with both distributions at tau as training
computes its log-probs:

- `eval_kl`: KL(pi || pi_ref) per response token, over the full vocabulary:

      kl = sum_t sum_v pi(v | x, y<t) (log pi(v | x, y<t) - log pi_ref(v | x, y<t)) / sum_t 1

- `eval_ref_perplexity`: exp(-sum_t log pi_ref(y_t | x, y<t) / sum_t 1), how surprising the
  policy's responses are to the reference policy.

The sums run over every response token of every sampled response (EOS included). The reference
policy loads, the first time it is needed, in the process that evaluates, on the device and in
the dtype of the evaluated policy; it is not pickled with the task.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from tba.lazy_models import Lazy
from tba.policy.logprobs import log_softmax, response_logits
from tba.policy.model import load_model
from tba.policy.sampling import generate_batched
from tba.policy.sources import model_dir
from tba.policy.tokenizer import encode_prompts

# score_fn(prompts, responses) -> one score per response
ScoreFn = Callable[[list[str], list[str]], list[float]]


def win(ours: float, theirs: float) -> float:
    """1 when `ours` scores higher, 0.5 on a tie, else 0."""
    return 1.0 if ours > theirs else 0.5 if ours == theirs else 0.0


class PreferenceEvaluator:
    """`evaluate(model, tokenizer, settings)` of a preference task (see the module docstring).
    `rows` hold `prompt` and `reference`; `judge` is the gold judge, `proxy` the training reward;
    `reference_policy` a directory or a Hub id (None: no KL or perplexity)."""

    def __init__(
        self, rows: list[dict], judge: ScoreFn, proxy: ScoreFn, reference_policy: str | None
    ) -> None:
        self.prompts = [row["prompt"] for row in rows]
        self.references = [row["reference"] for row in rows]
        self.judge, self.proxy = judge, proxy
        self.reference_policy = reference_policy
        self._reference_scores: list[float] | None = None
        # Loaded in the process that evaluates, on the device and in the dtype of the policy.
        self.reference = Lazy(partial(_load_reference, reference_policy))

    @torch.no_grad()
    def __call__(self, model, tokenizer, settings) -> dict[str, float]:
        prompt_ids = encode_prompts(tokenizer, self.prompts, chat_template=settings.chat_template,
                                    max_length=settings.max_prompt_length)  # fmt: skip
        greedy = decode(tokenizer, respond(model, tokenizer, prompt_ids, settings, greedy=True))
        ours = self.judge(self.prompts, greedy)
        if self._reference_scores is None:  # the references never change: judged once
            self._reference_scores = self.judge(self.prompts, self.references)
        metrics = {
            "eval_win_rate": _mean([win(a, b) for a, b in zip(ours, self._reference_scores)]),
            "eval_gold": _mean(ours),
            "eval_proxy_reward": _mean(self.proxy(self.prompts, greedy)),
        }
        if self.reference_policy is not None:
            sampled = respond(model, tokenizer, prompt_ids, settings, greedy=False)
            kl, perplexity = closeness(
                model, self.reference.get(model), prompt_ids, sampled,
                pad_id=tokenizer.pad_token_id, temperature=settings.temperature,
            )  # fmt: skip
            metrics |= {"eval_kl": kl, "eval_ref_perplexity": perplexity}
        return metrics


def _load_reference(path_or_id: str, policy):
    """The reference policy, frozen, on the device and in the dtype of `policy`."""
    weights = policy.get_input_embeddings().weight
    path = model_dir(path_or_id, "the reference policy")
    reference = load_model(str(path), weights.device, weights.dtype)
    return reference.eval().requires_grad_(False)


def respond(
    model, tokenizer, prompt_ids: list[list[int]], settings, *, greedy: bool
) -> list[list[int]]:
    """One response per prompt (EOS included when it ended): greedy, or sampled at the settings'
    temperature with a generator seeded by `settings.seed`."""
    generator = None
    if not greedy:
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(settings.seed)
    return generate_batched(
        model, tokenizer, prompt_ids, max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature, greedy=greedy, generator=generator,
        batch_size=settings.batch_size, sampler=settings.sampler,
    )  # fmt: skip


def decode(tokenizer, responses: list[list[int]]) -> list[str]:
    return tokenizer.batch_decode(responses, skip_special_tokens=True)


@torch.no_grad()
def closeness(
    policy, reference, prompts: list[list[int]], responses: list[list[int]], *, pad_id: int,
    temperature: float = 1.0, batch_size: int = 16,
) -> tuple[float, float]:  # fmt: skip
    """(KL(pi || pi_ref) per response token, perplexity of the responses under pi_ref), both
    distributions at `temperature`, over every token of `responses` (see the module docstring).
    Computed `batch_size` responses at a time: full-vocabulary logits are large."""
    kl_sum = reference_logp_sum = tokens = 0.0
    for first in range(0, len(prompts), batch_size):
        rows = slice(first, first + batch_size)
        logits, ids, mask = response_logits(policy, prompts[rows], responses[rows],
                                            pad_id=pad_id, share_prompts=False)  # fmt: skip
        logp = log_softmax(logits, temperature)
        logits, _, _ = response_logits(reference, prompts[rows], responses[rows], pad_id=pad_id,
                                       share_prompts=False)  # fmt: skip
        logq = log_softmax(logits, temperature)
        mask = mask.to(logp.dtype)
        kl_sum += float(((logp.exp() * (logp - logq)).sum(-1) * mask).sum())
        reference_logp_sum += float((logq.gather(-1, ids[..., None]).squeeze(-1) * mask).sum())
        tokens += float(mask.sum())
    return kl_sum / tokens, math.exp(-reference_logp_sum / tokens)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
