"""The searcher: generates scored samples with a (possibly stale) copy of the policy.

One `generate` call takes the next prompts of the searcher's own shuffled stream, samples S
responses per prompt, scores them with the task's reward functions, computes the reference
log-prob of each response (stored with the sample, so the trainer never runs the reference), and
returns `Sample`s tagged with the weight version that produced them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.buffer import Sample
from tba.policy.logprobs import sequence_logprobs
from tba.policy.model import frozen_copy, set_weights
from tba.policy.sampling import generate
from tba.tasks import RewardFn


@dataclass
class SearchSettings:
    samples_per_prompt: int
    temperature: float
    max_new_tokens: int
    truncated: str  # "penalize" or "drop"
    truncation_penalty: float


class PromptStream:
    """Endless shuffled passes over the training rows; each searcher has its own order."""

    def __init__(self, num_rows: int, seed: int) -> None:
        self.num_rows = num_rows
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []

    def take(self, count: int) -> list[int]:
        while len(self.order) < count:
            self.order += self.rng.permutation(self.num_rows).tolist()
        taken, self.order = self.order[:count], self.order[count:]
        return taken


class Searcher:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        rows: list[dict],
        reward_fns: list[RewardFn],
        settings: SearchSettings,
        *,
        searcher_id: int = 0,
        seed: int = 0,
    ) -> None:
        self.policy = model
        self.reference = frozen_copy(model)
        self.policy.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.rows = rows
        self.reward_fns = reward_fns
        self.settings = settings
        self.searcher_id = searcher_id
        self.version = 0
        self.stream = PromptStream(len(rows), seed)
        self.prompt_ids = [tokenizer(row["prompt"])["input_ids"] for row in rows]
        self.generator = torch.Generator(device=next(model.parameters()).device)
        self.generator.manual_seed(seed)

    def set_weights(self, weights: dict[str, np.ndarray], version: int) -> None:
        set_weights(self.policy, weights)
        self.version = version

    def generate(self, num_prompts: int) -> tuple[list[Sample], dict[str, float]]:
        """Samples for the next `num_prompts` prompts of the stream, and generation stats."""
        start = time.time()
        s = self.settings
        row_ids = [i for i in self.stream.take(num_prompts) for _ in range(s.samples_per_prompt)]
        prompts = [self.prompt_ids[i] for i in row_ids]
        out = generate(
            self.policy,
            prompts,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            generator=self.generator,
        )
        completions = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        rewards, parts = self._score(row_ids, completions, out.truncated)
        with torch.no_grad():
            ref_logps = sequence_logprobs(
                self.reference,
                prompts,
                out.response_ids,
                pad_id=self.tokenizer.pad_token_id,
                temperature=s.temperature,
            ).tolist()
        now = time.time()
        samples = [
            Sample(
                prompt_id=row_ids[i],
                prompt_ids=prompts[i],
                response_ids=out.response_ids[i],
                reward=rewards[i],
                ref_logp=ref_logps[i],
                behaviour_logp=out.logps[i],
                behaviour_token_logps=out.token_logps[i],
                version=self.version,
                searcher_id=self.searcher_id,
                created_at=now,
                truncated=out.truncated[i],
                reward_parts={name: values[i] for name, values in parts.items()},
            )
            for i in range(len(row_ids))
            if math.isfinite(rewards[i])
        ]
        tokens = sum(len(r) for r in out.response_ids)
        elapsed = time.time() - start
        stats = {
            "gen_seconds": elapsed,
            "generated": len(row_ids),
            "gen_tokens": tokens,
            "gen_tokens_per_s": tokens / elapsed,
            "truncated_frac": sum(out.truncated) / len(out.truncated),
            "dropped": len(row_ids) - len(samples),
            "response_length": tokens / len(out.response_ids),
        }
        return samples, stats

    def _score(
        self, row_ids: list[int], completions: list[str], truncated: list[bool]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Sum of the reward functions; truncated responses penalised or dropped (NaN)."""
        prompts = [self.rows[i]["prompt"] for i in row_ids]
        columns = {
            key: [self.rows[i][key] for i in row_ids] for key in self.rows[0] if key != "prompt"
        }
        parts = {fn.__name__: fn(prompts, completions, **columns) for fn in self.reward_fns}
        totals = [float(sum(values)) for values in zip(*parts.values())]
        s = self.settings
        for i, cut in enumerate(truncated):
            if cut:
                totals[i] = s.truncation_penalty if s.truncated == "penalize" else math.nan
        return totals, parts
