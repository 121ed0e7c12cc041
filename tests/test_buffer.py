from __future__ import annotations

import itertools
import json
import math
import time

import numpy as np
import pytest

from tba.buffer import ReplayBuffer
from tba.core import Sample

_counter = itertools.count()


def make(prompt_id: int, version: int, reward: float = 0.0) -> Sample:
    """A sample whose response_ids hold a unique tag, so samples are identifiable after load."""
    return Sample(
        prompt_id=prompt_id,
        prompt_ids=[1, 2, prompt_id],
        response_ids=[next(_counter)],
        reward=reward,
        ref_logp=-1.5,
        behaviour_logp=-1.25,
        version=version,
    )


def tag(s: Sample) -> int:
    return s.response_ids[0]


def inclusion_probs(rewards: list[float], k: int, weight: float, temp: float) -> np.ndarray:
    """Exact per-sample inclusion probability of the sequential mixture draw (enumeration)."""
    n = len(rewards)
    incl = np.zeros(n)
    for order in itertools.permutations(range(n), k):
        p, remaining = 1.0, list(range(n))
        for i in order:
            soft = np.exp([rewards[j] / temp for j in remaining])
            mix = weight * soft / soft.sum() + (1 - weight) / len(remaining)
            p *= mix[remaining.index(i)]
            remaining.remove(i)
        incl[list(order)] += p
    return incl


def sample_one_prompt(rewards, weight, temp, num_groups=4000, k=2, seed=0):
    buf = ReplayBuffer(100, recent_prob=0.0, reward_weight=weight, reward_temperature=temp)
    samples = [make(0, 0, r) for r in rewards]
    buf.add(samples)
    groups = buf.sample(num_groups, k, np.random.default_rng(seed)).groups
    index = {tag(s): i for i, s in enumerate(samples)}
    return [[index[tag(s)] for s in g] for g in groups]


# ------------------------------------------------------------------------------ MOP frequencies


@pytest.mark.parametrize("recent_prob", [0.0, 0.3, 0.95, 1.0])
def test_recent_fraction_matches_recent_prob(recent_prob):
    # 3000 fresh prompts never run out in a batch of 2000 groups: each group is fresh with
    # probability m, and a replay group drawn from a fresh prompt still counts as replay.
    buf = ReplayBuffer(10_000, recent_prob=recent_prob)
    buf.add([make(p, 0) for p in range(3000) for _ in range(2)])
    n = 2000
    fresh = buf.sample(n, 2, np.random.default_rng(123)).fresh
    tol = 4 * math.sqrt(n * recent_prob * (1 - recent_prob)) + 1
    assert abs(fresh - n * recent_prob) <= tol


# ---------------------------------------------------------------------------- replay mixture


def test_replay_uniform_when_reward_weight_zero():
    rewards = [0.0, 1.0, 2.0, 5.0]
    groups = sample_one_prompt(rewards, weight=0.0, temp=1.0)
    first = np.bincount([g[0] for g in groups], minlength=4)
    expected = len(groups) / 4
    chi2 = float(((first - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # chi-square, 3 dof, p = 0.001
    incl = np.bincount([i for g in groups for i in g], minlength=4) / len(groups)
    np.testing.assert_allclose(incl, 0.5, atol=4 * math.sqrt(0.25 / len(groups)))


def test_replay_reward_prioritised_at_low_temperature():
    rewards = [0.0, 1.0, 2.0, 3.0]
    groups = sample_one_prompt(rewards, weight=1.0, temp=0.05)
    top_two = sum(sorted(g) == [2, 3] for g in groups)
    assert top_two / len(groups) > 0.99
    assert sum(g[0] == 3 for g in groups) / len(groups) > 0.99


def test_replay_mixture_matches_exact_inclusion_and_lies_in_between():
    rewards = [0.0, 1.0, 2.0, 3.0]
    n = 4000
    observed = {}
    for weight in (0.0, 0.5, 1.0):
        groups = sample_one_prompt(rewards, weight=weight, temp=1.0, num_groups=n, seed=7)
        observed[weight] = np.bincount([i for g in groups for i in g], minlength=4) / n
        exact = inclusion_probs(rewards, 2, weight, 1.0)
        tol = 4 * np.sqrt(exact * (1 - exact) / n) + 1e-3
        assert np.all(np.abs(observed[weight] - exact) <= tol)
    # The highest-reward sample is included more often as the reward weight grows.
    assert observed[0.0][3] < observed[0.5][3] < observed[1.0][3]


def test_replay_softmax_is_numerically_stable():
    groups = sample_one_prompt([1e6, 2e6, 3e6], weight=1.0, temp=1e-3, num_groups=50)
    assert all(sorted(g) == [1, 2] for g in groups)


# ----------------------------------------------------------------------------- recent branch


def test_recent_group_is_k_newest_fresh_samples_then_the_next_newest():
    buf = ReplayBuffer(1000)
    old = [make(0, 1) for _ in range(3)]
    latest = [make(0, 3) for _ in range(5)]
    middle = make(0, 2)
    # Interleave versions so insertion order and version order disagree.
    buf.add([latest[0], old[0], latest[1], middle, latest[2], old[1], latest[3], latest[4]])
    buf.add([make(1, 2) for _ in range(6)])
    rng = np.random.default_rng(0)
    (group,) = buf.sample(1, 3, rng).groups
    assert [tag(s) for s in group] == [tag(s) for s in latest[:1:-1]]
    # Those are trained on now: the next recent group takes the next newest fresh samples.
    (group,) = buf.sample(1, 3, rng).groups
    assert [tag(s) for s in group] == [tag(latest[1]), tag(latest[0]), tag(middle)]


def test_recent_group_fills_with_newest_older_samples():
    buf = ReplayBuffer(1000)
    a, b, c, d = make(0, 1), make(0, 2), make(0, 1), make(0, 3)
    buf.add([a, b, c, d])
    (group,) = buf.sample(1, 3, np.random.default_rng(0)).groups
    assert [tag(s) for s in group] == [tag(d), tag(b), tag(c)]


def test_recent_prefers_prompts_whose_group_is_most_on_policy():
    buf = ReplayBuffer(1000)
    buf.add([make(0, 5)] + [make(0, 4) for _ in range(5)])  # its group: v5, v4, v4
    buf.add([make(1, 5) for _ in range(3)])  # its group: v5, v5, v5
    for seed in range(10):
        state = buf.state_dict()
        first, second = buf.sample(2, 3, np.random.default_rng(seed)).groups
        assert all(s.prompt_id == 1 and s.version == 5 for s in first)
        assert [s.version for s in second] == [5, 4, 4] and second[0].prompt_id == 0
        buf.load_state_dict(state)


def test_recent_prompts_are_cycled_without_replacement_across_steps():
    buf = ReplayBuffer(1000)
    buf.add([make(p, 1) for p in range(4) for _ in range(3)])
    buf.add([make(p, 2) for p in range(4, 8) for _ in range(3)])
    buf.add([make(9, 3) for _ in range(3)])  # the only prompt of the latest version
    rng = np.random.default_rng(0)
    assert buf.fresh_prompts(3) == 9
    batch = buf.sample(5, 3, rng)
    assert {s.prompt_id for s in batch.groups[0]} == {9}
    # Then the freshest prompts (version 2), each once, before any of version 1.
    assert sorted(g[0].prompt_id for g in batch.groups[1:]) == [4, 5, 6, 7]
    assert (batch.fresh, batch.reused, batch.repeated) == (5, 0, 0)
    # Next step: version 1's prompts, never trained on, rather than version 3's again.
    batch = buf.sample(4, 3, rng)
    assert sorted(g[0].prompt_id for g in batch.groups) == [0, 1, 2, 3]
    assert batch.fresh == 4 and buf.fresh_prompts(3) == 0
    # Nothing fresh is left: replay groups, every sample trained on before.
    batch = buf.sample(4, 3, rng)
    assert (batch.fresh, batch.reused) == (0, 4)


def test_a_batch_is_never_trained_twice_when_no_new_data_arrives():
    # One prompt per group, K samples each: with m = 1 the old sampler returned the same batch
    # again; now the recent branch has nothing fresh and replay is counted as such.
    buf = ReplayBuffer(1000)
    buf.add([make(p, 1) for p in range(2) for _ in range(2)])
    rng = np.random.default_rng(0)
    first = buf.sample(2, 2, rng)
    assert (first.fresh, first.repeated) == (2, 0)
    again = buf.sample(2, 2, rng)
    assert again.fresh == 0 and again.reused == 2 and again.repeated == 2  # counted, not hidden
    buf.add([make(p, 2) for p in range(2) for _ in range(2)])
    fresh = buf.sample(2, 2, rng)
    assert fresh.fresh == 2 and fresh.repeated == 0
    assert all(s.version == 2 for g in fresh.groups for s in g)


def test_a_prompt_with_fewer_than_k_fresh_samples_left_is_not_fresh():
    # S = 4 samples per visit, K = 3: the one left over is for replay, not a mostly-reused group.
    buf = ReplayBuffer(1000)
    buf.add([make(0, 1) for _ in range(4)])
    rng = np.random.default_rng(0)
    assert buf.sample(1, 3, rng).fresh == 1
    assert buf.fresh_prompts(3) == 0 and buf.sample(1, 3, rng).fresh == 0
    # A first visit that lost samples (all of them fresh) still makes a fresh group.
    buf.add([make(1, 2), make(1, 2)])
    assert buf.fresh_prompts(3) == 1


def test_evict_older_than_enforces_a_staleness_bound():
    buf = ReplayBuffer(100, per_prompt_capacity=2)
    buf.add([make(0, 1), make(0, 3), make(0, 4), make(1, 2), make(1, 5), make(2, 6)])
    assert len(buf) == 5  # prompt 0's v1 sample went to the per-prompt limit
    assert buf.evict_older_than(4) == 2  # v3 and v2; the trimmed v1 entry is skipped
    assert versions(buf) == [4, 5, 6]
    assert buf.evict_older_than(4) == 0
    assert buf.evict_older_than(7) == 3 and len(buf) == 0 and buf.state_dict()["prompts"] == []


# ---------------------------------------------------------------------------------- eviction


def versions(buf: ReplayBuffer) -> list[int]:
    """The weight versions of the samples in the buffer, sorted."""
    return sorted(s["version"] for _, entries in buf.state_dict()["prompts"] for _, s in entries)


def tags(buf: ReplayBuffer, prompt_id: int | None = None) -> set[int]:
    return {
        entry[1]["response_ids"][0]
        for pid, entries in buf.state_dict()["prompts"]
        if prompt_id is None or pid == prompt_id
        for entry in entries
    }


def test_eviction_oldest_version_then_oldest_insertion():
    buf = ReplayBuffer(4)
    s = [make(0, 2), make(1, 1), make(0, 1), make(2, 3), make(1, 2)]
    assert buf.add(s) == 1  # s[1] and s[2] share the oldest version; s[1] was inserted first
    assert len(buf) == 4
    assert tags(buf) == {tag(s[0]), tag(s[2]), tag(s[3]), tag(s[4])}
    new = [make(2, 4), make(1, 0)]
    assert buf.add(new) == 2  # the just-added v0 sample, then s[2] (v1)
    assert tags(buf) == {tag(s[0]), tag(s[3]), tag(s[4]), tag(new[0])}
    newest = make(3, 5)
    assert buf.add([newest]) == 1  # s[0] and s[4] are both v2; s[0] is older
    assert tags(buf) == {tag(s[3]), tag(s[4]), tag(new[0]), tag(newest)}
    assert (len(buf), len(buf.state_dict()["prompts"]), max(versions(buf))) == (4, 3, 5)


def test_per_prompt_capacity_evicts_oldest_within_prompt():
    buf = ReplayBuffer(100, per_prompt_capacity=3)
    p0 = [make(0, 1), make(0, 0), make(0, 2), make(0, 0)]
    other = [make(1, 0) for _ in range(3)]
    assert buf.add(p0 + other) == 1  # p0[1]: oldest version, inserted before p0[3]
    assert tags(buf, 0) == {tag(p0[0]), tag(p0[2]), tag(p0[3])}
    newest = make(0, 3)
    assert buf.add([newest]) == 1
    assert tags(buf, 0) == {tag(p0[0]), tag(p0[2]), tag(newest)}
    assert tags(buf, 1) == {tag(x) for x in other}
    assert len(buf) == 6


def test_add_is_fast_at_scale():
    samples = [make(i % 3000, i // 5000) for i in range(100_000)]
    buf = ReplayBuffer(20_000, per_prompt_capacity=16)
    start = time.perf_counter()
    evicted = sum(buf.add(samples[i : i + 500]) for i in range(0, len(samples), 500))
    elapsed = time.perf_counter() - start
    assert len(buf) <= 20_000 and evicted == 100_000 - len(buf)
    assert min(versions(buf)) == 16  # the oldest versions went first
    assert elapsed < 2.0


# -------------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("recent_prob", [0.0, 1.0])
def test_prompt_with_fewer_than_k_samples_is_filled(recent_prob):
    buf = ReplayBuffer(100)
    samples = [make(0, 0), make(0, 1), make(0, 1)]
    buf.add(samples)
    buf.recent_prob = recent_prob
    for group in buf.sample(50, 5, np.random.default_rng(1)).groups:
        assert len(group) == 5
        assert {tag(s) for s in group} == {tag(s) for s in samples}


def test_replay_prefers_prompts_with_k_samples():
    buf = ReplayBuffer(100, recent_prob=0.0)
    buf.add([make(0, 0) for _ in range(2)] + [make(1, 0) for _ in range(3)])
    groups = buf.sample(20, 3, np.random.default_rng(0)).groups
    assert {s.prompt_id for s in groups[0]} == {1}
    # More groups than prompts: prompt 0 once, and the repeats from the preferred prompt.
    assert sum(g[0].prompt_id == 0 for g in groups) == 1


def test_recent_prob_one_without_usable_latest_samples_falls_back_to_replay():
    buf = ReplayBuffer(100)
    buf.add([make(0, 0) for _ in range(4)])
    buf.add([make(1, 1)])  # only latest-version sample is a lone one
    for group in buf.sample(20, 2, np.random.default_rng(0)).groups:
        assert len({tag(s) for s in group}) == 2
        assert all(s.prompt_id == 0 for s in group)


def test_single_sample_prompts_only_when_nothing_better():
    buf = ReplayBuffer(100, recent_prob=0.5)
    buf.add([make(0, 0), make(1, 1)])
    for group in buf.sample(4, 3, np.random.default_rng(0)).groups:
        assert len(group) == 3 and len({tag(s) for s in group}) == 1


def test_empty_buffer_raises():
    with pytest.raises(ValueError, match="empty"):
        ReplayBuffer(10).sample(1, 2, np.random.default_rng(0))


def test_groups_never_repeat_samples_when_distinct_available():
    rng = np.random.default_rng(5)
    buf = ReplayBuffer(
        400, per_prompt_capacity=12, recent_prob=0.5, reward_weight=0.5, reward_temperature=0.5
    )
    for version in range(6):
        buf.add(
            make(int(p), version, float(rng.normal()))
            for p in rng.integers(0, 30, size=int(rng.integers(20, 80)))
        )
    sizes = {pid: len(es) for pid, es in buf.state_dict()["prompts"]}
    for k in (2, 4, 8):
        for _ in range(60):
            for g in buf.sample(8, k, rng).groups:
                assert len(g) == k and len({s.prompt_id for s in g}) == 1
                distinct = len({tag(s) for s in g})
                assert distinct == min(k, sizes[g[0].prompt_id])
                assert distinct >= 2


def test_distinct_prompts_across_groups_of_a_batch():
    buf = ReplayBuffer(1000, recent_prob=0.5)
    buf.add([make(p, 0) for p in range(10) for _ in range(4)])
    rng = np.random.default_rng(0)
    for _ in range(50):
        groups = buf.sample(10, 2, rng).groups
        assert len({g[0].prompt_id for g in groups}) == 10
    # More groups than prompts: every prompt is used before any repeats.
    assert len({g[0].prompt_id for g in buf.sample(13, 2, rng).groups}) == 10


# --------------------------------------------------------------------- one prompt, many groups


def test_a_single_prompt_gives_several_fresh_groups_when_it_has_the_samples():
    # Red-teaming has one prompt: a batch of B groups still takes B * K fresh samples.
    buf = ReplayBuffer(1000)
    buf.add([make(0, 1) for _ in range(12)])
    batch = buf.sample(3, 4, np.random.default_rng(0))
    assert batch.fresh == 3 and batch.reused == 0
    tags_drawn = [tag(s) for g in batch.groups for s in g]
    assert len(set(tags_drawn)) == 12  # no sample twice
    assert buf.fresh_prompts(4) == 0 and buf.sample(1, 4, np.random.default_rng(1)).fresh == 0


# ------------------------------------------------------------------------------ deduplication


def make_response(prompt_id: int, response: list[int], reward: float) -> Sample:
    return Sample(prompt_id, [1], response, reward=reward, ref_logp=-1.0, behaviour_logp=-1.0,
                  version=0)  # fmt: skip


@pytest.mark.parametrize(
    ("dedup", "duplicate"), [("exact", [5, 6, 7]), ("near", [7, 5, 6, 6])]
)
def test_a_duplicate_replaces_the_stored_one_only_with_a_higher_reward(dedup, duplicate):
    buf = ReplayBuffer(100, dedup=dedup)
    buf.add([make_response(0, [5, 6, 7], 0.5), make_response(1, [5, 6, 7], 0.1)])
    buf.add([make_response(0, duplicate, 0.2)])  # lower reward: turned away
    assert len(buf) == 2 and buf.duplicates == 1
    buf.add([make_response(0, duplicate, 0.9)])  # higher: replaces it
    assert len(buf) == 2 and buf.duplicates == 2
    stored = buf.state_dict()["prompts"]
    rewards = {pid: [sample["reward"] for _, sample in entries] for pid, entries in stored}
    assert rewards == {0: [0.9], 1: [0.1]}  # other prompts' responses are not duplicates


def test_near_duplicates_are_distinct_without_near_dedup():
    buf = ReplayBuffer(100, dedup="exact")
    buf.add([make_response(0, [5, 6, 7], 0.5), make_response(0, [7, 6, 5], 0.5)])
    assert len(buf) == 2 and buf.duplicates == 0
    loaded = ReplayBuffer(100, dedup="exact")
    loaded.load_state_dict(buf.state_dict())
    loaded.add([make_response(0, [7, 6, 5], 0.1)])
    assert len(loaded) == 2 and loaded.duplicates == 1


# ------------------------------------------------------------------------------- persistence


def test_state_round_trips_through_json():
    rng = np.random.default_rng(3)
    sampling = {"recent_prob": 0.4, "reward_weight": 0.7}
    buf = ReplayBuffer(60, per_prompt_capacity=9, **sampling)
    for version in range(5):
        batch = [make(int(p), version, float(rng.normal())) for p in rng.integers(0, 12, size=25)]
        batch[0].reward_parts = {"format": 0.5, "answer": 1.0}
        batch[1].truncated = True
        batch[2].created_at = 1712345678.123
        buf.add(batch)
    buf.sample(3, 3, np.random.default_rng(1))  # some samples trained on, a previous batch
    loaded = ReplayBuffer(1, **sampling)  # the capacities come with the state
    loaded.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert loaded.state_dict() == buf.state_dict() and len(loaded) == len(buf)
    assert loaded.state_dict()["fresh"] and loaded.state_dict()["last_batch"]

    def draw(b: ReplayBuffer) -> tuple:
        batch = b.sample(6, 3, np.random.default_rng(11))
        groups = [[s.to_dict() for s in g] for g in batch.groups]
        return groups, batch.fresh, batch.reused, batch.repeated

    assert draw(loaded) == draw(buf)
    # Both keep evolving identically after the round trip.
    extra = [make(int(p), 5) for p in range(15)]
    assert loaded.add([Sample.from_dict(s.to_dict()) for s in extra]) == buf.add(extra)
    assert draw(loaded) == draw(buf)
    assert loaded.state_dict() == buf.state_dict()


def test_sample_dict_round_trip():
    s = make(3, 2, 0.25)
    s.reward_parts = {"a": 1.0}
    assert Sample.from_dict(s.to_dict()) == s


# ---------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_groups": 0}, "num_groups"),
        ({"group_size": 0}, "group_size"),
        ({"recent_prob": -0.1}, "recent_prob"),
        ({"recent_prob": 1.5}, "recent_prob"),
        ({"recent_prob": float("nan")}, "recent_prob"),
        ({"reward_weight": 1.1}, "reward_weight"),
        ({"reward_weight": -0.5}, "reward_weight"),
        ({"reward_temperature": 0.0}, "reward_temperature"),
        ({"reward_temperature": -1.0}, "reward_temperature"),
    ],
)
def test_bad_sampling_arguments_raise(kwargs, name):
    args = {"num_groups": 1, "group_size": 2} | kwargs
    num_groups, group_size = args.pop("num_groups"), args.pop("group_size")
    with pytest.raises(ValueError, match=name):
        buf = ReplayBuffer(10, **args)
        buf.add([make(0, 0), make(0, 0)])
        buf.sample(num_groups, group_size, np.random.default_rng(0))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"capacity": 0}, "capacity"),
        ({"per_prompt_capacity": 0}, "per_prompt_capacity"),
        ({"max_staleness": -1}, "max_staleness"),
    ],
)
def test_bad_capacities_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ReplayBuffer(**({"capacity": 10} | kwargs))


def generation(
    prompt_id: int, size: int, version: int, at: float, searcher: int = 0
) -> list[Sample]:
    """`size` samples of one prompt made by one generation call."""
    samples = [make(prompt_id, version) for _ in range(size)]
    for s in samples:
        s.searcher_id, s.created_at = searcher, at
    return samples


def test_context_is_the_rest_of_the_groups_generation_and_none_for_replay():
    buf = ReplayBuffer(100, recent_prob=1.0)
    first = generation(0, 8, version=1, at=1.0)
    other_searcher = generation(0, 8, version=1, at=1.0, searcher=1)
    older = generation(0, 8, version=0, at=0.5)
    buf.add(older + first + other_searcher)
    rng = np.random.default_rng(0)
    for _ in range(2):  # the two halves of the newest generation, each with the other as context
        batch = buf.sample(1, 4, rng, context=True)
        (group,), (context,) = batch.groups, batch.context
        made_by = other_searcher if group[0] in other_searcher else first
        assert all(s in made_by for s in group)
        assert sorted(map(tag, group + context)) == sorted(map(tag, made_by))
        assert [tag(s) for s in context] == sorted(map(tag, context))  # insertion order
    replayed = ReplayBuffer(100, recent_prob=0.0)
    replayed.add(first)
    batch = replayed.sample(2, 4, rng, context=True)
    assert batch.context == [[], []]
    assert buf.sample(1, 4, rng).context == []  # only when asked for


def test_groups_of_one_draw_every_fresh_sample_once_with_its_generation_as_context():
    """group_size=1 (TRL's P * A sharing no factor with num_generations): a generation of 8
    serves 3 + 3 + 2 single samples, the last one too, each with the other 7 as context; a
    replayed single sample also takes its generation as context."""
    buf = ReplayBuffer(100, recent_prob=1.0)
    made = generation(0, 8, version=0, at=0.0) + generation(1, 8, version=0, at=0.0)
    buf.add(made)
    rng = np.random.default_rng(0)
    drawn = []
    for _ in range(5):
        batch = buf.sample(3, 1, rng, context=True)
        for (sample,), context in zip(batch.groups, batch.context):
            assert sorted(map(tag, [sample, *context])) == sorted(
                tag(s) for s in made if s.prompt_id == sample.prompt_id)  # fmt: skip
        drawn += [tag(s) for (s,) in batch.groups]
        assert batch.fresh == 3 and batch.reused == 0
    assert len(set(drawn)) == 15  # none twice; the 16th is left for the next step
    replayed = ReplayBuffer(100, recent_prob=0.0)
    replayed.add(made[:8])
    (context,) = replayed.sample(1, 1, rng, context=True).context
    assert len(context) == 7


def test_fresh_uses_serve_each_sample_that_many_times_least_used_first():
    """TRL's num_iterations = 2: a generation of 8 serves 4 steps of 4, each sample twice, in
    the order TRL cycles through its slices; and nothing twice in one batch."""
    buf = ReplayBuffer(100, recent_prob=1.0, fresh_uses=2)
    samples = generation(0, 8, version=0, at=0.0)
    buf.add(samples)
    rng = np.random.default_rng(0)
    halves = [sorted(map(tag, samples[4:])), sorted(map(tag, samples[:4]))]
    for step in range(4):
        assert buf.fresh_groups(4) == (2, 2, 2, 1)[step]  # groups one batch can draw
        batch = buf.sample(1, 4, rng)
        assert sorted(map(tag, batch.groups[0])) == halves[step % 2]
        assert (batch.fresh, batch.reused) == (1, int(step >= 2))
    assert buf.fresh_groups(4) == 0

    once = ReplayBuffer(100, recent_prob=1.0, fresh_uses=3)
    once.add(generation(0, 8, version=0, at=0.0))
    batch = once.sample(3, 4, rng)  # two fresh groups, then a replayed one
    assert batch.fresh == 2
    drawn = [tag(s) for group in batch.groups[:2] for s in group]
    assert len(set(drawn)) == 8


def test_fresh_uses_survive_a_state_round_trip():
    buf = ReplayBuffer(100, recent_prob=1.0, fresh_uses=2)
    buf.add(generation(0, 8, version=0, at=0.0))
    buf.sample(1, 4, np.random.default_rng(0))
    copy = ReplayBuffer(100, recent_prob=1.0, fresh_uses=2)
    copy.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    for _ in range(3):
        a, b = (x.sample(1, 4, np.random.default_rng(1)) for x in (buf, copy))
        assert [tag(s) for s in a.groups[0]] == [tag(s) for s in b.groups[0]]
    assert buf.fresh_groups(4) == copy.fresh_groups(4) == 0
