"""The searcher: generates scored samples with a (possibly stale) copy of the policy.

One `generate` call takes the next prompts of the searcher's own shuffled stream, samples S
responses per prompt, scores them with the task's reward functions, computes the reference
log-prob of each response (stored with the sample, so the trainer never runs the reference), and
returns `Sample`s tagged with the weight version that produced them. What else a sample carries is
what the objective's `Needs` ask for: each token's reference log-prob (`token_ref_logp`), and the
value of every step prefix of its response, estimated from rollouts of its own (`step_values`,
`tba.vine_values`).
"""

from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.config import RunConfig
from tba.core import RewardFn, Sample
from tba.errors import RunError
from tba.objectives import OBJECTIVES
from tba.policy.decoding import evaluating
from tba.policy.engines import ENGINES, Engine
from tba.policy.logprobs import token_logprobs
from tba.policy.model import frozen_copy, is_lora, set_weights
from tba.policy.sampling import Generation
from tba.policy.tokenizer import encode_prompts
from tba.rewards.scorer import RewardScorer, Scores, TrainerState
from tba.vine_values import ValueEstimator


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
        config: RunConfig,
        *,
        searcher_id: int = 0,
        seed: int = 0,
        incarnation: int = 0,
        stream_seed: int | None = None,
        stream_taken: int = 0,
        model_dir: str | None = None,
        shares_trainer_model: bool = False,
        engine: type[Engine] | None = None,
    ) -> None:
        """`config`: the run's, whose sections the searcher reads (`policy`: sampling and
        prompts; `train`: samples per prompt, the truncation rule, the objective's needs and
        micro-batch; `searchers`: its engine, exploration temperature and reward limits; `task`:
        the reward weights). `seed` drives sampling; the prompt order comes from `stream_seed`
        (default: `seed`), continued from position `stream_taken`. Samples are numbered per
        `incarnation` (a restarted searcher process is a new one), so the trainer can tell a
        sample handed over twice or never from the others. `model_dir`: where `model` was loaded
        from (a vLLM engine loads it from there). `shares_trainer_model`: `model` is the
        trainer's own module (in the trainer's process), which it samples with as it is when
        weights are published: no copy of the weights, and its training mode and gradients are
        left to the trainer. `engine`: the class of `config.searchers.engine` (default: the one
        this process's `ENGINES` registers under its type; a searcher process is handed the
        trainer's, which may hold an engine registered there alone)."""
        self.policy = model
        self.shares_trainer_model = shares_trainer_model
        # With LoRA the reference is the base model with the adapters switched off: one copy of
        # the base weights in this process, not two.
        self.reference = None if is_lora(model) else frozen_copy(model)
        if not shares_trainer_model:
            self.policy.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.rows = rows
        sc, tc = config.searchers, config.train
        self.config = config
        self.scorer = RewardScorer(
            reward_fns, weights=config.task.reward_weights, timeout_s=sc.reward_timeout_s,
            max_failures=sc.max_reward_failures,
        )  # fmt: skip
        self.samples_per_prompt = tc.samples_per_prompt or tc.group_size
        # Exploration: the searcher samples at this temperature (its samples' behaviour log-probs
        # are the sampler's, at it); the reference's log-probs are at the policy's.
        self.sample_temperature = sc.temperature or config.policy.temperature
        # Samples per reference-scoring pass: the trainer's micro-batch, so that no no-grad pass
        # holds more activations than a train pass does (None: the whole batch, as the trainer).
        self.score_batch = tc.micro_batch_groups * tc.group_size if tc.micro_batch_groups else None
        needs = OBJECTIVES[tc.loss].needs
        self.token_ref_logps = needs.token_ref_logp  # each response token's reference log-prob
        self.searcher_id = searcher_id
        self.incarnation = incarnation
        self.num_generated = 0  # the next sample's sequence number
        self.reward_faults: list[tuple[str, str, int]] = []
        self.version = 0
        self.step = 0  # the optimizer step at which the weights of `version` were published
        self.empty_batches = 0  # batches in a row of which no sample was kept
        self.stream = PromptStream(
            len(rows), seed if stream_seed is None else stream_seed, stream_taken
        )
        self.prompt_ids = encode_prompts(
            tokenizer, [row["prompt"] for row in rows], chat_template=config.policy.chat_template,
            max_length=config.policy.max_prompt_length,
        )  # fmt: skip
        engine_class = engine or ENGINES[sc.engine.type]
        self.engine: Engine = engine_class.start(
            model, tokenizer, seed=seed, model_dir=model_dir, policy=config.policy,
            settings=sc.engine,
        )  # fmt: skip
        self.values = None
        if needs.step_values:  # Monte Carlo values of step prefixes (VinePPO's)
            self.values = ValueEstimator(
                self.engine, tokenizer, tc.vineppo, max_new_tokens=config.policy.max_new_tokens,
                temperature=self.sample_temperature, score=self._rollout_rewards,
            )  # fmt: skip

    def set_weights(self, weights: dict[str, np.ndarray], version: int, step: int) -> None:
        """Copy `weights` (`get_weights`' arrays) into the searcher's own model, then `adopt`
        them as `version`."""
        set_weights(self.policy, weights)
        self.adopt(version, step)

    def adopt(self, version: int, step: int) -> None:
        """The model now holds the weights of `version`, published at optimizer step `step`
        (copied into it, or the trainer's own module as it is now): generate with them."""
        self.engine.load_weights(self.policy)
        self.version, self.step = version, step

    def generate(self, num_prompts: int) -> tuple[list[Sample], dict[str, float]]:
        """Samples for the next `num_prompts` prompts of the stream, and generation stats."""
        start = time.time()
        per_prompt = self.samples_per_prompt
        row_ids = [i for i in self.stream.take(num_prompts) for _ in range(per_prompt)]
        prompts = [self.prompt_ids[i] for i in row_ids]
        with evaluating(self.policy):  # a shared trainer's module is in training mode
            out = self.engine.generate(prompts, max_new_tokens=self.config.policy.max_new_tokens,
                                       temperature=self.sample_temperature)  # fmt: skip
            completions = self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
            scores, rewards, reward_dropped = self._score(row_ids, completions, out)
            ref_logps, ref_token_logps = self._reference_logps(prompts, out.response_ids)
            kept = [i for i in range(len(row_ids)) if math.isfinite(rewards[i])]
            vine, vine_stats = {}, {}
            if self.values is not None and kept:
                estimates, vine_stats = self.values.estimate(
                    [row_ids[i] for i in kept], [prompts[i] for i in kept],
                    [out.response_ids[i] for i in kept],
                )  # fmt: skip
                vine = {i: e for i, e in zip(kept, estimates) if e is not None}
                kept = [i for i in kept if i in vine]
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
                reward_parts={name: values[i] for name, values in scores.parts.items()
                              if values[i] is not None},
                extras={name: values[i] for name, values in scores.extras.items()},
                reward_metrics=scores.metrics,
                incarnation=self.incarnation,
                seq=self.num_generated + n,
            )
            for n, i in enumerate(kept)
        ]
        for sample, i in zip(samples, kept):
            if ref_token_logps is not None:
                sample.ref_token_logps = ref_token_logps[i]
            if i in vine:
                sample.step_ends, sample.step_values = vine[i].ends, vine[i].values
                sample.rollouts = vine[i].rollouts
        self.num_generated += len(samples)
        tokens = sum(len(r) for r in out.response_ids)
        elapsed = time.time() - start
        # VinePPO's rollouts are generated samples too: their tokens count (and cost) alike.
        generated_tokens = tokens + vine_stats.get("vine_tokens", 0)
        stats = {
            **vine_stats,
            "gen_seconds": elapsed,
            "generated": len(row_ids),
            "gen_tokens": generated_tokens,
            "gen_tokens_per_s": generated_tokens / elapsed,
            "truncated_frac": sum(out.truncated) / len(out.truncated),
            "dropped": len(row_ids) - len(samples),
            "reward_dropped": reward_dropped,
            "reward_unscored": scores.unscored,
            "response_length": tokens / len(out.response_ids),
        }
        self._check_yield(samples, stats, out)
        return samples, stats

    def _check_yield(self, samples: list[Sample], stats: dict[str, float], out: Generation) -> None:
        """A batch can lose all of its samples (a reward that failed on it, responses cut off and
        dropped); `max_reward_failures` batches in a row without one mean the run cannot train:
        `RunError`, naming why, rather than a run that waits or trains on nothing."""
        self.empty_batches = 0 if samples else self.empty_batches + 1
        limit = self.config.searchers.max_reward_failures
        if self.empty_batches < limit:
            return
        cut = sum(out.truncated) if self.config.train.truncated == "drop" else 0
        fault = self.reward_faults[-1] if self.reward_faults else None
        why = [f"{stats['reward_dropped']} without a usable reward"]
        if fault is not None:
            why[0] += f" ({fault[0]} {fault[1]})"
        if stats["reward_unscored"]:
            why.append(f"{stats['reward_unscored']} that no reward function scored (all None)")
        if cut:
            why.append(f"{cut} cut off at policy.max_new_tokens and dropped (train.truncated=drop)")
        raise RunError(f"no usable sample in {limit} batches in a row "
                       f"(searchers.max_reward_failures); of the last {stats['generated']}: "
                       f"{', '.join(why)}")  # fmt: skip

    def take_reward_faults(self) -> list[tuple[str, str, int]]:
        """(function, reason, completions dropped) of every faulty reward call since the last
        call of this method."""
        faults, self.reward_faults = self.reward_faults, []
        return faults

    @torch.no_grad()
    def _reference_logps(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> tuple[list[float], list[list[float]] | None]:
        """log pi_ref of each response: the frozen copy, or the base model under the adapters;
        and, where the objective needs them, of each of its tokens."""
        if self.reference is not None:
            reference, adapters_off = self.reference, contextlib.nullcontext()
        else:
            reference, adapters_off = self.policy, self.policy.disable_adapter()
        size = self.score_batch or len(prompts)
        temperature = self.config.policy.temperature
        sums: list[float] = []
        rows: list[list[float]] = []
        with adapters_off:
            for start in range(0, len(prompts), size):  # the trainer's micro-batches
                token_logps, mask = token_logprobs(
                    reference, prompts[start : start + size], responses[start : start + size],
                    pad_id=self.tokenizer.pad_token_id, temperature=temperature,
                )  # fmt: skip
                token_logps = token_logps * mask
                sums += token_logps.sum(-1).tolist()
                if self.token_ref_logps:
                    rows += token_logps.tolist()
        if not self.token_ref_logps:
            return sums, None
        return sums, [row[: len(response)] for row, response in zip(rows, responses)]

    def _rollout_rewards(
        self, row_ids: list[int], responses: list[list[int]], truncated: list[bool]
    ) -> list[float]:
        """The rewards of VinePPO's rollouts (whole responses), scored as samples are."""
        completions = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        out = Generation(response_ids=responses, logps=[0.0] * len(responses),
                         token_logps=[[] for _ in responses], truncated=truncated)
        return self._score(row_ids, completions, out)[1]

    def _score(
        self, row_ids: list[int], completions: list[str], out: Generation
    ) -> tuple[Scores, list[float], int]:
        """The reward functions' scores, each completion's reward (NaN: drop it), and how many
        completions the reward functions dropped (a fault, or no function scored them). A response
        without EOS is scored as any other, or gets the truncation penalty, or is dropped
        (`train.truncated`)."""
        prompts = [self.rows[i]["prompt"] for i in row_ids]
        columns = {
            key: [self.rows[i][key] for i in row_ids] for key in self.rows[0] if key != "prompt"
        }
        tc = self.config.train
        # TRL's TrainerState: max_steps 0 where the run has no step limit.
        scores = self.scorer.score(prompts, completions, out.response_ids, columns,
                                   TrainerState(self.step, tc.max_steps or 0))  # fmt: skip
        self.reward_faults += scores.faults
        rewards = list(scores.totals)
        reward_dropped = 0
        for i, cut in enumerate(out.truncated):
            if cut and tc.truncated != "score":
                rewards[i] = tc.truncation_penalty if tc.truncated == "penalize" else math.nan
            elif math.isnan(rewards[i]):
                reward_dropped += 1
        return scores, rewards, reward_dropped
