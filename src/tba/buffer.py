"""Replay buffer with Most-On-Policy (MOP) sampling.

Searchers keep adding samples produced by (possibly stale) policy versions while the trainer draws
batches of per-prompt groups of ``K`` samples. Every sample is **fresh** until it is trained on
(``fresh_uses`` times: once by default; TRL's ``num_iterations`` reuses each generation that many
times, the least-used samples first). MOP sampling mixes two sources per group:

- with probability ``recent_prob`` (the recent branch), a prompt with fresh samples, the newest
  weight version first, and its ``K`` least-used, then newest fresh samples. Fresh samples are
  used ``fresh_uses`` times (once by default): recent prompts are cycled without replacement
  across steps, so a batch is never trained on again because no new data arrived in between;
- otherwise, or when no prompt has fresh samples left, a replay group: a uniformly chosen prompt
  whose samples are drawn without replacement from a mixture of a reward softmax and a uniform
  distribution (reusing history, optionally prioritising high rewards).

A prompt counts as fresh when it has ``K`` fresh samples, or when all of its samples are fresh
(a first visit that lost some responses to dropped rewards). When full, the buffer evicts the
samples of the oldest policy version first. With ``max_staleness`` (in optimizer steps), the
feed also evicts the samples of weights published too long ago (`evict_older_than`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from typing import Any

import numpy as np

from tba.config import BufferConfig
from tba.core import Batch, Sample


class _PromptPool:
    """Uniform draws over a set of prompts, avoiding prompts already used in the batch."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self._unused = list(prompt_ids)

    def draw(self, rng: np.random.Generator, used: Container[int]) -> int | None:
        """A prompt not used yet in this batch, or None when every one of them is."""
        # Swap-remove keeps each draw O(1); prompts taken through another pool are dropped lazily.
        while self._unused:
            i = int(rng.integers(len(self._unused)))
            prompt_id = self._unused[i]
            self._unused[i] = self._unused[-1]
            self._unused.pop()
            if prompt_id not in used:
                return prompt_id
        return None


def _pick_prompt(
    pools: Sequence[_PromptPool], used: Container[int], rng: np.random.Generator
) -> int | None:
    """An unused prompt from the first pool that still has one: earlier pools are preferred."""
    for pool in pools:
        prompt_id = pool.draw(rng, used)
        if prompt_id is not None:
            return prompt_id
    return None


def _repeat_prompt(pools: Sequence[_PromptPool], rng: np.random.Generator) -> int:
    """More groups than prompts: repeat a prompt of the first non-empty pool."""
    pool = next(pool for pool in pools if pool.prompt_ids)
    return pool.prompt_ids[int(rng.integers(len(pool.prompt_ids)))]


def _mixture_probs(rewards: np.ndarray, reward_weight: float, temperature: float) -> np.ndarray:
    uniform = np.full(len(rewards), 1.0 / len(rewards))
    if reward_weight == 0.0:
        return uniform
    logits = rewards / temperature
    weights = np.exp(logits - logits.max())  # shift by the max so exp cannot overflow
    return reward_weight * weights / weights.sum() + (1.0 - reward_weight) * uniform


def _draw_without_replacement(
    rewards: np.ndarray,
    num_draws: int,
    rng: np.random.Generator,
    reward_weight: float,
    temperature: float,
) -> list[int]:
    """Sequential draws, each from the reward/uniform mixture over the not-yet-drawn indices."""
    remaining = np.arange(len(rewards))
    chosen: list[int] = []
    for _ in range(num_draws):
        cdf = np.cumsum(_mixture_probs(rewards[remaining], reward_weight, temperature))
        j = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        j = min(j, len(remaining) - 1)  # guards against rounding at the top of the cdf
        chosen.append(int(remaining[j]))
        remaining = np.delete(remaining, j)
    return chosen


def _fill_group(distinct: list[Sample], group_size: int, rng: np.random.Generator) -> list[Sample]:
    """Pad a group with random repeats; only reached when the prompt has too few samples."""
    missing = group_size - len(distinct)
    if missing <= 0:
        return distinct
    extra = rng.integers(len(distinct), size=missing)
    return distinct + [distinct[int(i)] for i in extra]


def _generation(s: Sample) -> tuple[int, int, int, float]:
    """What the samples of one generation share: the searcher process, the weights, the time."""
    return s.searcher_id, s.incarnation, s.version, s.created_at


def _validate_sampling_args(
    recent_prob: float, reward_weight: float, reward_temperature: float
) -> None:
    # Written as `not (...)` so that NaN is rejected too.
    if not 0.0 <= recent_prob <= 1.0:
        raise ValueError(f"recent_prob must be in [0, 1], got {recent_prob}")
    if not 0.0 <= reward_weight <= 1.0:
        raise ValueError(f"reward_weight must be in [0, 1], got {reward_weight}")
    if not reward_temperature > 0.0:
        raise ValueError(f"reward_temperature must be > 0, got {reward_temperature}")


# What makes two responses of a prompt duplicates of each other.
DEDUP_KEYS: dict[str, Callable[[list[int]], Hashable]] = {
    "none": lambda ids: None,
    "exact": tuple,  # the same tokens
    "near": frozenset,  # the same set of tokens, in any order and number
}


class ReplayBuffer:
    """Bounded store of samples keyed by prompt, with MOP group sampling.

    ``recent_prob`` (m) is the probability that a group comes from the recent branch;
    ``reward_weight`` and ``reward_temperature`` set the replay mixture
    ``reward_weight * softmax(r / T) + (1 - reward_weight) * uniform``; ``max_staleness`` is the
    staleness bound in optimizer steps (None: none); ``fresh_uses`` the times a sample is drawn
    as fresh.
    """

    def __init__(
        self,
        capacity: int,
        per_prompt_capacity: int | None = None,
        *,
        recent_prob: float = 1.0,
        reward_weight: float = 0.0,
        reward_temperature: float = 1.0,
        dedup: str = "none",
        max_staleness: int | None = None,
        fresh_uses: int = 1,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if per_prompt_capacity is not None and per_prompt_capacity < 1:
            raise ValueError(f"per_prompt_capacity must be >= 1, got {per_prompt_capacity}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if fresh_uses < 1:
            raise ValueError(f"fresh_uses must be >= 1, got {fresh_uses}")
        _validate_sampling_args(recent_prob, reward_weight, reward_temperature)
        if dedup not in DEDUP_KEYS:
            raise ValueError(f"dedup must be one of {', '.join(DEDUP_KEYS)}, got {dedup!r}")
        self.dedup = dedup
        self.capacity = capacity
        self.per_prompt_capacity = per_prompt_capacity
        self.recent_prob = recent_prob
        self.reward_weight = reward_weight
        self.reward_temperature = reward_temperature
        self.max_staleness = max_staleness
        self.fresh_uses = fresh_uses
        self._clear()

    def _clear(self) -> None:
        # prompt_id -> {insertion seq: sample}; dicts keep insertion order and delete in O(1).
        self._prompts: dict[int, dict[int, Sample]] = {}
        # prompt_id -> {seq: times trained on}: the fresh samples (trained on fewer than
        # `fresh_uses` times), in insertion order.
        self._fresh: dict[int, dict[int, int]] = {}
        # Min-heap of (version, seq, prompt_id) in eviction order. Entries whose sample was
        # already removed by the per-prompt limit are skipped when popped.
        self._heap: list[tuple[int, int, int]] = []
        self._size = 0
        self._next_seq = 0
        self._last_batch: set[tuple[int, ...]] = set()  # the previous batch's groups, as seqs
        # With dedup: prompt_id -> {response key: seq}, and how many samples it turned away.
        self._keys: dict[int, dict[Hashable, int]] = {}
        self.duplicates = 0

    @classmethod
    def from_config(cls, config: BufferConfig) -> ReplayBuffer:
        return cls(
            config.capacity,
            config.per_prompt_capacity,
            recent_prob=config.recent_prob,
            reward_weight=config.reward_weight,
            reward_temperature=config.reward_temperature,
            dedup=config.dedup,
            max_staleness=config.max_staleness,
            fresh_uses=config.fresh_uses,
        )

    def __len__(self) -> int:
        return self._size

    def fresh_prompts(self, group_size: int) -> int:
        """Prompts the recent branch can draw a group of fresh samples from."""
        return sum(self._is_fresh(pid, group_size) for pid in self._fresh)

    def fresh_groups(self, group_size: int) -> int:
        """Groups of fresh samples the recent branch can draw: a prompt gives one per
        `group_size` fresh samples (one, if all of its samples are fresh but fewer)."""
        return sum(max(len(fresh) // group_size, int(self._is_fresh(pid, group_size)))
                   for pid, fresh in self._fresh.items())  # fmt: skip

    # ----------------------------------------------------------------------------- storage

    def add(self, samples: Iterable[Sample]) -> int:
        """Insert samples (fresh), then evict down to capacity. Returns the number evicted.

        With `dedup`, a sample whose response duplicates one of its prompt's (`exact`: the same
        tokens; `near`: the same set of tokens, in any order and number) replaces it when its
        reward is higher and is turned away otherwise (either way counted in `duplicates`).

        Evicting once after the batch keeps the same samples as evicting after every insertion:
        both retain the largest (version, insertion) keys, so batching is only an optimisation.
        """
        touched: dict[int, None] = {}
        for s in samples:
            if not self._make_room_for(s):
                self.duplicates += 1
                continue
            self._insert(s, self._next_seq)
            self._next_seq += 1
            touched[s.prompt_id] = None
        evicted = 0
        if self.per_prompt_capacity is not None:
            for prompt_id in touched:
                evicted += self._trim_prompt(prompt_id, self.per_prompt_capacity)
        while self._size > self.capacity:
            _, seq, prompt_id = heapq.heappop(self._heap)
            if seq in self._prompts.get(prompt_id, {}):
                self._remove(prompt_id, seq)
                evicted += 1
        self._compact_heap()
        return evicted

    def _make_room_for(self, s: Sample) -> bool:
        """With dedup: False when `s` duplicates a stored sample of higher or equal reward;
        otherwise removes the worse duplicate, if any, and returns True."""
        if self.dedup == "none":
            return True
        seq = self._keys.get(s.prompt_id, {}).get(DEDUP_KEYS[self.dedup](s.response_ids))
        if seq is None:
            return True
        if self._prompts[s.prompt_id][seq].reward >= s.reward:
            return False
        self.duplicates += 1
        self._remove(s.prompt_id, seq)
        return True

    def _insert(self, s: Sample, seq: int, uses: int | None = 0) -> None:
        """Store `s` as `seq`, fresh and trained on `uses` times (None: not fresh)."""
        self._prompts.setdefault(s.prompt_id, {})[seq] = s
        if self.dedup != "none":
            self._keys.setdefault(s.prompt_id, {})[DEDUP_KEYS[self.dedup](s.response_ids)] = seq
        if uses is not None:
            self._fresh.setdefault(s.prompt_id, {})[seq] = uses
        heapq.heappush(self._heap, (s.version, seq, s.prompt_id))
        self._size += 1

    def _remove(self, prompt_id: int, seq: int) -> None:
        samples = self._prompts[prompt_id]
        s = samples.pop(seq)
        if not samples:
            del self._prompts[prompt_id]
        if self.dedup != "none":
            keys = self._keys[prompt_id]
            del keys[DEDUP_KEYS[self.dedup](s.response_ids)]
            if not keys:
                del self._keys[prompt_id]
        self._mark_trained(prompt_id, [seq], gone=True)
        self._size -= 1

    def _mark_trained(self, prompt_id: int, seqs: Iterable[int], gone: bool = False) -> None:
        """Count a use of each of `seqs`; those used `fresh_uses` times (or `gone`) stop being
        fresh."""
        fresh = self._fresh.get(prompt_id)
        if fresh is None:
            return
        for seq in seqs:
            if seq not in fresh:
                continue
            fresh[seq] += 1
            if gone or fresh[seq] >= self.fresh_uses:
                del fresh[seq]
        if not fresh:
            del self._fresh[prompt_id]

    def evict_older_than(self, min_version: int) -> int:
        """Remove every sample of a version below ``min_version``; returns how many."""
        evicted = 0
        while self._heap and self._heap[0][0] < min_version:
            _, seq, prompt_id = heapq.heappop(self._heap)
            if seq in self._prompts.get(prompt_id, {}):
                self._remove(prompt_id, seq)
                evicted += 1
        return evicted

    def _trim_prompt(self, prompt_id: int, limit: int) -> int:
        samples = self._prompts[prompt_id]
        excess = len(samples) - limit
        if excess <= 0:
            return 0
        oldest = heapq.nsmallest(excess, samples.items(), key=lambda kv: (kv[1].version, kv[0]))
        for seq, _ in oldest:
            self._remove(prompt_id, seq)
        return excess

    def _compact_heap(self) -> None:
        # Stale entries from per-prompt trimming would otherwise accumulate without bound.
        if len(self._heap) <= 2 * self._size + 1024:
            return
        self._heap = [
            (s.version, seq, prompt_id)
            for prompt_id, samples in self._prompts.items()
            for seq, s in samples.items()
        ]
        heapq.heapify(self._heap)

    # ---------------------------------------------------------------------------- sampling

    def sample(
        self, num_groups: int, group_size: int, rng: np.random.Generator, context: bool = False
    ) -> Batch:
        """Draw ``num_groups`` MOP groups of ``group_size`` samples, each from a single prompt;
        every sample drawn counts a use (fresh until ``fresh_uses``), and none is drawn as fresh
        twice in a batch. A batch takes distinct prompts while it can; a prompt with K fresh
        samples left after its first group (many samples per visit, or a task with a single
        prompt) gives fresh groups again. With `context`, `batch.context` gives each fresh group
        the other samples of the prompt that its generation made (trained before, or left for
        later steps), and each replayed group none, unless it is a single sample (a group of
        one, `group_size=1`, takes its statistics from its generation)."""
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if self._size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        fresh_pools = self._fresh_pools(group_size)
        replay_pools = self._replay_pools(group_size)
        used: dict[int, None] = {}  # prompts of this batch, in order
        taken: set[int] = set()  # the fresh samples this batch drew
        batch = Batch([])
        signatures = set()
        for _ in range(num_groups):
            prompt_id = None
            if rng.random() < self.recent_prob:
                prompt_id = _pick_prompt(fresh_pools, used, rng)
                if prompt_id is None:
                    prompt_id = next((p for p in used if len(self._fresh.get(p, {}).keys() - taken)
                                      >= group_size), None)  # fmt: skip
            siblings: list[Sample] = []
            if prompt_id is not None:
                seqs = self._fresh_group(prompt_id, group_size, taken)
                taken.update(seqs)
                batch.fresh += 1
                if context:
                    siblings = self._same_generation(prompt_id, seqs)
            else:
                prompt_id = _pick_prompt(replay_pools, used, rng)
                if prompt_id is None:  # more groups than prompts
                    prompt_id = _repeat_prompt(replay_pools, rng)
                seqs = self._replay_group(prompt_id, group_size, rng)
                if context and len(seqs) == 1:
                    siblings = self._same_generation(prompt_id, seqs)
            if context:
                batch.context.append(siblings)
            used[prompt_id] = None
            fresh = self._fresh.get(prompt_id, {})
            batch.reused += not any(fresh.get(seq) == 0 for seq in seqs)
            signature = tuple(sorted(seqs))
            batch.repeated += signature in self._last_batch
            signatures.add(signature)
            samples = self._prompts[prompt_id]
            batch.groups.append(_fill_group([samples[seq] for seq in seqs], group_size, rng))
            self._mark_trained(prompt_id, seqs)
        self._last_batch = signatures
        return batch

    def _is_fresh(self, prompt_id: int, group_size: int) -> bool:
        num_fresh = len(self._fresh.get(prompt_id, ()))
        return num_fresh >= group_size or num_fresh == len(self._prompts[prompt_id])

    def _fresh_pools(self, group_size: int) -> list[_PromptPool]:
        """Fresh prompts, most on-policy first: grouped by the version of the oldest sample of
        the group each would give (its K newest fresh ones), newest version first. Prompts with a
        single sample only when no prompt has two (a group of K >= 2 needs >= 2 distinct
        ones)."""
        by_version: dict[int, list[int]] = {}
        singles: list[int] = []
        for prompt_id, fresh in self._fresh.items():
            if not self._is_fresh(prompt_id, group_size):
                continue
            if len(fresh) < min(2, group_size):
                singles.append(prompt_id)
                continue
            samples = self._prompts[prompt_id]
            versions = sorted((samples[seq].version for seq in fresh), reverse=True)
            oldest_in_group = versions[min(group_size, len(versions)) - 1]
            by_version.setdefault(oldest_in_group, []).append(prompt_id)
        pools = [_PromptPool(by_version[v]) for v in sorted(by_version, reverse=True)]
        if not pools and not any(len(p) >= 2 for p in self._prompts.values()):
            pools.append(_PromptPool(singles))
        return pools

    def _replay_pools(self, group_size: int) -> list[_PromptPool]:
        """Prompts with >= K samples, then >= 2; single-sample prompts only when no prompt has
        two, so a group never degenerates to one distinct sample needlessly. Scanning
        ``self._prompts`` keeps the order, and so the draws, identical after a save/load."""
        tiers: list[list[int]] = [[], [], []]
        for prompt_id, samples in self._prompts.items():
            total = len(samples)
            tiers[0 if total >= group_size else 1 if total >= 2 else 2].append(prompt_id)
        if tiers[0] or tiers[1]:
            tiers.pop()
        return [_PromptPool(t) for t in tiers]

    def _fresh_group(self, prompt_id: int, group_size: int, taken: Container[int]) -> list[int]:
        """Seqs of the prompt's least-used, then newest fresh samples (by version, then
        insertion), other than those `taken` already."""
        samples, fresh = self._prompts[prompt_id], self._fresh[prompt_id]
        order = sorted((q for q in fresh if q not in taken),
                       key=lambda q: (-fresh[q], samples[q].version, q), reverse=True)  # fmt: skip
        return order[:group_size]

    def _same_generation(self, prompt_id: int, seqs: list[int]) -> list[Sample]:
        """The prompt's stored samples, other than `seqs`, made by the generation (searcher
        process, call, weights) that made any of `seqs`; in insertion order."""
        samples = self._prompts[prompt_id]
        generations = {_generation(samples[seq]) for seq in seqs}
        group = set(seqs)
        return [s for seq, s in sorted(samples.items())
                if seq not in group and _generation(s) in generations]  # fmt: skip

    def _replay_group(self, prompt_id: int, group_size: int, rng: np.random.Generator) -> list[int]:
        seqs = list(self._prompts[prompt_id])
        rewards = np.array([self._prompts[prompt_id][q].reward for q in seqs], dtype=np.float64)
        num_draws = min(group_size, len(seqs))
        order = _draw_without_replacement(
            rewards, num_draws, rng, self.reward_weight, self.reward_temperature
        )
        return [seqs[i] for i in order]

    # -------------------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """Everything in the buffer, freshness and the previous batch included (the sampling
        settings come from the run's config)."""
        return {
            "capacity": self.capacity,
            "per_prompt_capacity": self.per_prompt_capacity,
            "next_seq": self._next_seq,
            "prompts": [
                [prompt_id, [[seq, s.to_dict()] for seq, s in samples.items()]]
                for prompt_id, samples in self._prompts.items()
            ],
            "fresh": [seq for fresh in self._fresh.values() for seq in fresh],
            "fresh_used": [[seq, uses] for fresh in self._fresh.values()
                           for seq, uses in fresh.items() if uses],  # fmt: skip
            "duplicates": self.duplicates,
            "last_batch": sorted(list(group) for group in self._last_batch),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Replace the contents with a saved state (capacities included)."""
        self.capacity, self.per_prompt_capacity = d["capacity"], d["per_prompt_capacity"]
        self._clear()
        uses = {seq: 0 for seq in d["fresh"]} | dict(d.get("fresh_used", []))
        for _, entries in d["prompts"]:
            for seq, sample in entries:
                self._insert(Sample.from_dict(sample), seq, uses.get(seq))
        self._next_seq = d["next_seq"]
        self._last_batch = {tuple(group) for group in d["last_batch"]}
        self.duplicates = d["duplicates"]
