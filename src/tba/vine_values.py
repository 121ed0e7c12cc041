"""VinePPO's values (Kazemnejad et al., 2024): Monte Carlo estimates of how much reward is still
to come from each step of a response, made by the searcher that generated it.

A response is split into steps at the tokens whose text holds the delimiter (a newline by
default): a step ends with such a token, wherever inside it the delimiter falls, and the last
step ends with the response. The states are the prompt alone (s_0) and the prompt followed by the
response's first 1, 2, ... steps. For every distinct state (a state several responses share, the
prompt above all, is generated for once), `rollouts` continuations are sampled with the
searcher's engine and weights, each within what is left of the response length limit, and scored
with the task's reward on the whole response (prefix and continuation). Their mean is V(s).

At most `max_states` states per response: when a response has more steps, only evenly spaced
step ends are kept (neighbouring steps merge). A state whose rollouts all failed to score has no
value, and the responses that need it are dropped, as a response without a reward is.

The searchers make these values where the objective's `Needs.step_values` asks for them (VinePPO,
whose loss, `tba.objectives.vineppo`, reads them); the settings are the config's own section,
`train.vineppo` (`VinePPOSettings`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from tba.config import VinePPOSettings
from tba.policy.engines import Engine

# score(row ids, whole responses' token ids, truncated flags) -> rewards (NaN: no reward)
Score = Callable[[list[int], list[list[int]], list[bool]], list[float]]


@dataclass
class StepValues:
    """One response's steps: each step's end (exclusive; the last is the response's length),
    V of the state before each step, and the rollouts this response was the first to need."""

    ends: list[int]
    values: list[float]
    rollouts: int


class StepSplitter:
    """Where a response's steps end: after every token whose text holds the delimiter."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, delimiter: str) -> None:
        self.tokenizer, self.delimiter = tokenizer, delimiter
        self._ends_step: dict[int, bool] = {}  # by token id, decoded once

    def ends_step(self, token: int) -> bool:
        if token not in self._ends_step:
            self._ends_step[token] = self.delimiter in self.tokenizer.decode([token])
        return self._ends_step[token]

    def step_ends(self, response: list[int], max_states: int) -> list[int]:
        """Each step's end (exclusive), at most `max_states` of them; the last is
        `len(response)` (a delimiter in the last token opens no empty step)."""
        boundaries = [t + 1 for t, token in enumerate(response[:-1]) if self.ends_step(token)]
        return evenly_spaced(boundaries, max_states - 1) + [len(response)]


def evenly_spaced(items: list[int], keep: int) -> list[int]:
    """`items` if there are at most `keep`, else `keep` of them evenly spaced (first and last
    included when keep >= 2)."""
    if len(items) <= keep:
        return items
    if keep == 0:
        return []
    picked = np.linspace(0, len(items) - 1, keep).round().astype(int)
    return [items[i] for i in picked]


class ValueEstimator:
    """V of every step prefix of a batch's responses, from `settings.rollouts` continuations
    each, generated with `engine` (the searcher's, at its weights and sampling temperature)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        settings: VinePPOSettings,
        *,
        max_new_tokens: int,
        temperature: float,
        score: Score,
    ) -> None:
        self.engine, self.settings, self.score = engine, settings, score
        self.splitter = StepSplitter(tokenizer, settings.delimiter)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    def estimate(
        self, row_ids: list[int], prompts: list[list[int]], responses: list[list[int]]
    ) -> tuple[list[StepValues | None], dict[str, float]]:
        """Each response's `StepValues` (None when one of its states has no value), and stats:
        distinct states, rollouts, their tokens and seconds."""
        start = time.time()
        s = self.settings
        ends = [self.splitter.step_ends(response, s.max_states) for response in responses]
        # Each distinct state once: (row, response prefix) -> its index, in order of first need.
        states: dict[tuple[int, tuple[int, ...]], int] = {}
        needs: list[list[int]] = []
        first_needed: list[int] = []  # per state: the response that needed it first
        for i, (row, response) in enumerate(zip(row_ids, responses)):
            needs.append([])
            for end in [0, *ends[i][:-1]]:
                key = (row, tuple(response[:end]))
                if key not in states:
                    states[key] = len(states)
                    first_needed.append(i)
                needs[i].append(states[key])
        values, tokens = self._rollout_values(list(states), prompts, row_ids)
        per_response = []
        for i in range(len(responses)):
            estimates = [values[k] for k in needs[i]]
            rollouts = s.rollouts * sum(first_needed[k] == i for k in set(needs[i]))
            ok = all(math.isfinite(v) for v in estimates)
            per_response.append(StepValues(ends[i], estimates, rollouts) if ok else None)
        return per_response, {
            "vine_states": len(states),
            "vine_rollouts": len(states) * s.rollouts,
            "vine_tokens": tokens,
            "vine_seconds": time.time() - start,
        }

    def _rollout_values(
        self,
        keys: list[tuple[int, tuple[int, ...]]],
        prompts: list[list[int]],
        row_ids: list[int],
    ) -> tuple[list[float], int]:
        """The mean reward of `rollouts` continuations of each state (NaN when none scored), and
        the tokens generated (those past a prefix's room too: they cost as much). Generated in
        chunks of about as many sequences as the batch."""
        prompt_of = dict(zip(row_ids, prompts))
        n = self.settings.rollouts
        per_call = max(1, len(row_ids) // n)  # states per engine call
        values: list[float] = []
        tokens = 0
        for first in range(0, len(keys), per_call):
            chunk = keys[first : first + per_call]
            rows = [row for row, _ in chunk for _ in range(n)]
            prefixes = [list(prefix) for _, prefix in chunk for _ in range(n)]
            contexts = [prompt_of[row] + prefix for row, prefix in zip(rows, prefixes)]
            longest = self.max_new_tokens - min(len(prefix) for prefix in prefixes)
            out = self.engine.generate(contexts, max_new_tokens=longest,
                                       temperature=self.temperature)  # fmt: skip
            # Each continuation within what its prefix left of the response length limit.
            responses, truncated = [], []
            for prefix, continuation, cut in zip(prefixes, out.response_ids, out.truncated):
                room = self.max_new_tokens - len(prefix)
                responses.append(prefix + continuation[:room])
                truncated.append(cut or len(continuation) > room)
                tokens += len(continuation)
            rewards = np.array(self.score(rows, responses, truncated), dtype=float)
            for k in range(len(chunk)):
                scored = rewards[k * n : (k + 1) * n]
                scored = scored[np.isfinite(scored)]
                values.append(float(scored.mean()) if scored.size else math.nan)
        return values, tokens
