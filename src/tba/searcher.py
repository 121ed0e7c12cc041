"""The searcher: generates scored samples with a (possibly stale) copy of the policy.

One `generate` call takes the next prompts of the searcher's own shuffled stream, samples S
responses per prompt, scores them with the task's reward functions, computes the reference
log-prob of each response (stored with the sample, so the trainer never runs the reference), and
returns `Sample`s tagged with the weight version that produced them.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.config import RunConfig
from tba.core import RewardFn, Sample
from tba.policy.logprobs import sequence_logprobs
from tba.policy.model import frozen_copy, is_lora, set_weights
from tba.policy.sampling import generate
from tba.policy.tokenizer import encode_prompts
from tba.rewards.scorer import RewardScorer


@dataclass
class SearchSettings:
    samples_per_prompt: int
    temperature: float  # of the policy: the log-probs of the reference are taken at it
    max_new_tokens: int
    truncated: str  # "penalize" or "drop"
    truncation_penalty: float
    chat_template: bool = False  # prompts wrapped in the tokenizer's chat template
    reward_timeout_s: float = 60.0
    max_reward_failures: int = 5
    # Exploration: the searcher samples at this temperature instead (None: `temperature`). The
    # samples' behaviour log-probs are the sampler's, at this temperature.
    sample_temperature: float | None = None

    @classmethod
    def from_config(cls, config: RunConfig) -> SearchSettings:
        tc = config.train
        return cls(
            samples_per_prompt=tc.samples_per_prompt or tc.group_size,
            temperature=config.policy.temperature,
            max_new_tokens=config.policy.max_new_tokens,
            truncated=tc.truncated,
            truncation_penalty=tc.truncation_penalty,
            reward_timeout_s=config.searchers.reward_timeout_s,
            max_reward_failures=config.searchers.max_reward_failures,
            chat_template=config.policy.chat_template,
            sample_temperature=config.searchers.temperature,
        )


class PromptStream:
    """Endless shuffled passes over the training rows; each searcher has its own order.

    The stream is a function of its seed, so its position (`taken`, prompts handed out so far) is
    all a checkpoint needs: `PromptStream(n, seed, taken)` continues where it stopped.
    """

    def __init__(self, num_rows: int, seed: int, taken: int = 0) -> None:
        self.num_rows = num_rows
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []
        self.taken = 0
        self.take(taken)

    def take(self, count: int) -> list[int]:
        while len(self.order) < count:
            self.order += self.rng.permutation(self.num_rows).tolist()
        taken, self.order = self.order[:count], self.order[count:]
        self.taken += count
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
        incarnation: int = 0,
        stream_seed: int | None = None,
        stream_taken: int = 0,
    ) -> None:
        """`seed` drives sampling; the prompt order comes from `stream_seed` (default: `seed`),
        continued from position `stream_taken`. Samples are numbered per `incarnation` (a
        restarted searcher process is a new one), so the trainer can tell a sample handed over
        twice or never from the others."""
        self.policy = model
        # With LoRA the reference is the base model with the adapters switched off: one copy of
        # the base weights in this process, not two.
        self.reference = None if is_lora(model) else frozen_copy(model)
        self.policy.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.rows = rows
        self.scorer = RewardScorer(
            reward_fns, settings.reward_timeout_s, settings.max_reward_failures
        )
        self.settings = settings
        self.searcher_id = searcher_id
        self.incarnation = incarnation
        self.num_generated = 0  # the next sample's sequence number
        self.reward_faults: list[tuple[str, str, int]] = []
        self.version = 0
        self.stream = PromptStream(
            len(rows), seed if stream_seed is None else stream_seed, stream_taken
        )
        self.prompt_ids = encode_prompts(
            tokenizer, [row["prompt"] for row in rows], chat_template=settings.chat_template
        )
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
            temperature=s.sample_temperature or s.temperature,
            generator=self.generator,
        )
        completions = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        rewards, parts, extras, reward_dropped = self._score(row_ids, completions, out.truncated)
        ref_logps = self._reference_logps(prompts, out.response_ids)
        now = time.time()
        kept = [i for i in range(len(row_ids)) if math.isfinite(rewards[i])]
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
                extras={name: values[i] for name, values in extras.items()},
                incarnation=self.incarnation,
                seq=self.num_generated + n,
            )
            for n, i in enumerate(kept)
        ]
        self.num_generated += len(samples)
        tokens = sum(len(r) for r in out.response_ids)
        elapsed = time.time() - start
        stats = {
            "gen_seconds": elapsed,
            "generated": len(row_ids),
            "gen_tokens": tokens,
            "gen_tokens_per_s": tokens / elapsed,
            "truncated_frac": sum(out.truncated) / len(out.truncated),
            "dropped": len(row_ids) - len(samples),
            "reward_dropped": reward_dropped,
            "response_length": tokens / len(out.response_ids),
        }
        return samples, stats

    def take_reward_faults(self) -> list[tuple[str, str, int]]:
        """(function, reason, completions dropped) of every faulty reward call since the last
        call of this method."""
        faults, self.reward_faults = self.reward_faults, []
        return faults

    @torch.no_grad()
    def _reference_logps(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        """log pi_ref of each response: the frozen copy, or the base model under the adapters."""
        if self.reference is not None:
            reference, adapters_off = self.reference, contextlib.nullcontext()
        else:
            reference, adapters_off = self.policy, self.policy.disable_adapter()
        with adapters_off:
            return sequence_logprobs(
                reference, prompts, responses, pad_id=self.tokenizer.pad_token_id,
                temperature=self.settings.temperature,
            ).tolist()  # fmt: skip

    def _score(
        self, row_ids: list[int], completions: list[str], truncated: list[bool]
    ) -> tuple[list[float], dict[str, list[float]], dict[str, list], int]:
        """Sum of the reward functions (NaN: drop), the values per function, the extra columns
        they logged, and how many completions a reward fault dropped. Truncated responses are
        penalised or dropped."""
        prompts = [self.rows[i]["prompt"] for i in row_ids]
        columns = {
            key: [self.rows[i][key] for i in row_ids] for key in self.rows[0] if key != "prompt"
        }
        totals, parts, faults, extras = self.scorer.score(prompts, completions, columns)
        self.reward_faults += faults
        s = self.settings
        reward_dropped = 0
        for i, cut in enumerate(truncated):
            if cut:
                totals[i] = s.truncation_penalty if s.truncated == "penalize" else math.nan
            elif math.isnan(totals[i]):
                reward_dropped += 1
        return totals, parts, extras, reward_dropped
