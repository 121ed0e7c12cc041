"""PPO and VinePPO: GAE, the clipped value loss and the PPO loss against float64 references;
VinePPO's step advantages, steps and Monte Carlo values; both objectives on searcher samples,
through a checkpoint, and end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_async_e2e import TINY
from test_train_e2e import FAST
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tba import needs as needs_module
from tba.buffer import ReplayBuffer
from tba.checkpoint import latest_checkpoint, save_checkpoint
from tba.cli import main
from tba.config import RunConfig, TrainConfig, VinePPOSettings
from tba.core import Sample
from tba.objectives import OBJECTIVES, TokenBatch, gae, ppo_loss, vine_advantages, vineppo_loss
from tba.objectives.ppo import clipped_value_loss, explained_variance, token_rewards, whiten
from tba.objectives.vineppo import reward_to_go, step_index
from tba.policy.model import frozen_copy
from tba.policy.sampling import Generation
from tba.policy.values import Critic
from tba.run_dir import read_metrics, samples_consumed
from tba.searcher import Searcher
from tba.tasks.math import world
from tba.trainer import Trainer
from tba.vine_values import StepSplitter, ValueEstimator, evenly_spaced

LENGTHS = [5, 1, 3, 7, 2]
T_MAX = 7


def ragged(seed: int = 0, width: int = T_MAX) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token rewards and values (float64, NaN in the padding) and the right-padded mask."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(width) < torch.tensor(LENGTHS)[:, None]
    rewards = torch.randn(len(LENGTHS), width, generator=gen, dtype=torch.float64)
    values = torch.randn(len(LENGTHS), width, generator=gen, dtype=torch.float64)
    return rewards.masked_fill(~mask, math.nan), values.masked_fill(~mask, math.nan), mask


def brute_force_gae(rewards, values, gamma: float, lam: float) -> list[list[float]]:
    """A_t = sum_l (gamma lam)^l delta_{t+l}, each delta written out, row by row."""
    out = []
    for i, length in enumerate(LENGTHS):
        r, v = rewards[i, :length].tolist(), values[i, :length].tolist() + [0.0]
        deltas = [r[t] + gamma * v[t + 1] - v[t] for t in range(length)]
        out.append([sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t))
                    for t in range(length)])  # fmt: skip
    return out


# ----------------------------------------------------------------------------- GAE


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (1.0, 0.5), (0.9, 0.8)])
def test_gae_equals_the_discounted_sum_of_td_errors(gamma, lam):
    rewards, values, mask = ragged()
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    expected = brute_force_gae(rewards, values, gamma, lam)
    for i, length in enumerate(LENGTHS):
        assert advantages[i, :length].tolist() == pytest.approx(expected[i], rel=1e-12)
        assert returns[i, :length].tolist() == pytest.approx(
            [a + v for a, v in zip(expected[i], values[i, :length].tolist())], rel=1e-12
        )
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()


def test_gae_lambda_one_is_the_reward_to_go_and_lambda_zero_the_td_error():
    rewards, values, mask = ragged(seed=1)
    to_go, _ = gae(rewards, torch.zeros_like(values), mask, 1.0, 1.0)
    for i, length in enumerate(LENGTHS):
        r = rewards[i, :length].tolist()
        assert to_go[i, :length].tolist() == pytest.approx([sum(r[t:]) for t in range(length)])
    td, _ = gae(rewards, values, mask, 1.0, 0.0)
    for i, length in enumerate(LENGTHS):
        r, v = rewards[i, :length].tolist(), values[i, :length].tolist() + [0.0]
        assert td[i, :length].tolist() == pytest.approx([r[t] + v[t + 1] - v[t]
                                                         for t in range(length)])  # fmt: skip


def test_task_reward_lands_on_the_last_token_and_kl_on_every_one():
    mask = torch.arange(4) < torch.tensor([2, 4])[:, None]
    kl = torch.tensor([[0.5, 1.0, 9.0, 9.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    r = token_rewards(torch.tensor([1.0, -1.0], dtype=torch.float64), kl, mask, beta=0.1)
    assert r.flatten().tolist() == pytest.approx([-0.05, 0.9, 0.0, 0.0, -0.1, -0.2, -0.3, -1.4])
    assert reward_to_go(kl, mask).tolist() == [[1.5, 1.0, 0.0, 0.0], [10.0, 9.0, 7.0, 4.0]]


# ----------------------------------------------------------------------------- the value loss


def test_value_clipping_takes_each_branch_where_it_should():
    # inside the band | outside, the clip moves away from the target | outside, towards it
    values = torch.tensor([[0.1, 1.0, 1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[0.5, -1.0, 2.0, -3.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, clipped = clipped_value_loss(values, old, returns, mask, clip=0.2)
    # unclipped 0.5 (V - G)^2 unless the clipped value, old + clamp(V - old), is further off.
    assert loss[0].tolist() == pytest.approx([0.08, 2.0, 0.5 * 1.8**2, 0.5 * 2.8**2])
    assert clipped.tolist() == [[False, False, True, True]]
    loss.sum().backward()
    # The clipped branch passes no gradient: the value already moved past the clip.
    assert values.grad[0].tolist() == pytest.approx([-0.4, 2.0, 0.0, 0.0])


def test_whitening_is_over_every_real_token_of_the_batch():
    _, values, mask = ragged(seed=2)
    white = whiten(values, mask)
    assert white[mask].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert white[mask].std(unbiased=False).item() == pytest.approx(1.0, rel=1e-6)
    assert (white[~mask] == 0).all()


def ppo_batch(seed: int = 0, width: int = T_MAX) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = len(LENGTHS)
    mask = torch.arange(width) < torch.tensor(LENGTHS)[:, None]
    token_logp = -2.0 * torch.rand(n, width, generator=gen, dtype=torch.float64)
    behaviour = token_logp + 0.3 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    ref = token_logp + 0.2 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    values = torch.randn(n, width, generator=gen, dtype=torch.float64)
    rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    return {
        "token_logp": token_logp.masked_fill(~mask, math.nan).requires_grad_(True),
        "behaviour_token_logp": behaviour.masked_fill(~mask, math.nan),
        "mask": mask,
        "rewards": rewards,
        "ref_token_logp": ref.masked_fill(~mask, -math.inf),
        "values": values.masked_fill(~mask, math.nan).requires_grad_(True),
    }


def ppo_args(b: dict[str, torch.Tensor]) -> tuple[TokenBatch, torch.Tensor]:
    """`ppo_batch`'s tensors as `ppo_loss` takes them: the batch, and the critic's values."""
    batch = TokenBatch(b["token_logp"], b["mask"], b["rewards"],
                       behaviour_token_logp=b["behaviour_token_logp"],
                       ref_token_logp=b["ref_token_logp"])  # fmt: skip
    return batch, b["values"]


def reference_ppo(b, beta: float, lam: float, clip_eps: float, coef: float) -> float:
    """The PPO loss, token by token in Python floats."""
    n = len(LENGTHS)
    rows = []
    for i, length in enumerate(LENGTHS):
        lp = b["token_logp"][i, :length].tolist()
        kl = [a - r for a, r in zip(lp, b["ref_token_logp"][i, :length].tolist())]
        r = [-beta * k for k in kl]
        r[-1] += b["rewards"][i].item()
        v = b["values"][i, :length].tolist() + [0.0]
        deltas = [r[t] + v[t + 1] - v[t] for t in range(length)]
        adv = [sum(lam**k * deltas[t + k] for k in range(length - t)) for t in range(length)]
        rows.append((lp, b["behaviour_token_logp"][i, :length].tolist(), adv, v))
    flat = [a for _, _, adv, _ in rows for a in adv]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / len(flat) + 1e-8)
    policy = value = 0.0
    for lp, blp, adv, v in rows:
        for t, a in enumerate(adv):
            w, rho = (a - mean) / std, math.exp(lp[t] - blp[t])
            policy -= min(rho * w, min(max(rho, 1 - clip_eps), 1 + clip_eps) * w)
            value += 0.5 * (v[t] - (a + v[t])) ** 2  # V_old = V: the clip is inactive
    return (policy + coef * value) / n


def test_ppo_loss_matches_a_float64_loop_and_ignores_padding_columns():
    kwargs = dict(beta=0.1, clip_eps=0.2, gae_lambda=0.9, value_clip=0.2, value_coef=0.5)
    b = ppo_batch()
    loss, stats = ppo_loss(*ppo_args(b), **kwargs)
    assert loss.item() == pytest.approx(reference_ppo(b, 0.1, 0.9, 0.2, 0.5), rel=1e-5)
    assert 0 < stats["clip_frac"] < 1 and stats["value_clip_frac"] == 0
    loss.backward()
    wide = {  # the same batch with three more columns of padding
        name: torch.cat([tensor.detach(), tensor.new_full((len(LENGTHS), 3), math.nan)], dim=1)
        if tensor.dim() == 2 else tensor for name, tensor in b.items()
    }  # fmt: skip
    wide["mask"] = torch.cat([b["mask"], torch.zeros(len(LENGTHS), 3, dtype=torch.bool)], 1)
    for name in ("token_logp", "values"):
        wide[name].requires_grad_(True)
    wide_loss, _ = ppo_loss(*ppo_args(wide), **kwargs)
    wide_loss.backward()
    assert wide_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    for name in ("token_logp", "values"):
        got, expected = wide[name].grad[:, :T_MAX], b[name].grad
        assert torch.allclose(got.nan_to_num(), expected.nan_to_num(), atol=1e-6)
        assert (wide[name].grad[:, T_MAX:] == 0).all()


def test_ppo_gradients_on_policy_are_the_whitened_advantages_and_the_value_error():
    b = ppo_batch(seed=3)
    b["behaviour_token_logp"] = b["token_logp"].detach().clone()
    mask, n = b["mask"], len(LENGTHS)
    loss, stats = ppo_loss(*ppo_args(b), beta=0.05, gae_lambda=0.95, value_coef=0.25)
    loss.backward()
    kl = (b["token_logp"].detach() - b["ref_token_logp"]).masked_fill(~mask, 0.0)
    rewards = token_rewards(b["rewards"], kl, mask, 0.05)
    advantages, returns = gae(rewards, b["values"].detach(), mask, 1.0, 0.95)
    expected = -whiten(advantages, mask) / n
    assert torch.allclose(b["token_logp"].grad[mask].double(), expected[mask], atol=1e-6)
    value_error = 0.25 * (b["values"].detach() - returns) / n
    assert torch.allclose(b["values"].grad[mask].double(), value_error[mask], atol=1e-6)
    assert stats["advantage_mean"].item() == pytest.approx(advantages[mask].mean().item(), 1e-5)


# ----------------------------------------------------------------------------- VinePPO advantages


def test_gae_and_the_value_clip_use_the_stored_old_values():
    b = ppo_batch(seed=4)
    mask, n = b["mask"], len(LENGTHS)
    kwargs = dict(beta=0.05, gae_lambda=0.95, value_clip=0.2, value_coef=0.5)
    # A first use (V_old = V, detached): the same as no stored values, and the clip cannot bind.
    plain, plain_stats = ppo_loss(*ppo_args(b), **kwargs)
    first, first_stats = ppo_loss(*ppo_args(b), **kwargs,
                                  old_values=b["values"].detach().clone())  # fmt: skip
    assert first.item() == plain.item() and first_stats["value_clip_frac"] == 0
    # A later use: the critic moved by 1 since V_old, five times the clip.
    old = (b["values"].detach() + 1.0).masked_fill(~mask, 7.0)  # padding ignored
    loss, stats = ppo_loss(*ppo_args(b), **kwargs, old_values=old)
    assert stats["value_clip_frac"] > 0
    kl = (b["token_logp"].detach() - b["ref_token_logp"]).masked_fill(~mask, 0.0)
    advantages, returns = gae(token_rewards(b["rewards"], kl, mask, 0.05), old, mask, 1.0, 0.95)
    assert stats["advantage_mean"].item() == pytest.approx(advantages[mask].mean().item(), 1e-6)
    assert stats["value_mean"].item() == pytest.approx(old[mask].mean().item(), 1e-6)
    terms, clipped = clipped_value_loss(b["values"].nan_to_num(), old, returns, mask, 0.2)
    share = clipped.sum().item() / mask.sum().item()
    assert stats["value_clip_frac"].item() == pytest.approx(share)
    assert stats["value_loss"].item() == pytest.approx(terms.sum().item() / n, rel=1e-6)
    loss.backward()
    assert (b["values"].grad[clipped] == 0).all() and (b["values"].grad[mask & ~clipped] != 0).any()


def test_explained_variance_is_nan_when_every_return_is_the_same():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    values = torch.tensor([[0.1, 0.2, 5.0], [0.3, -0.1, 0.4]])
    assert math.isnan(explained_variance(values, torch.full((2, 3), 0.5), mask).item())
    assert math.isnan(explained_variance(torch.zeros(2, 3), torch.zeros(2, 3), mask).item())
    returns = torch.tensor([[1.0, 0.0, 9.0], [1.0, 0.0, 1.0]])
    assert explained_variance(returns, returns, mask).item() == 1.0
    assert explained_variance(torch.zeros(2, 3), returns, mask).item() == pytest.approx(0.0)


def test_vine_step_advantages_add_up_to_the_return_minus_the_first_value():
    gen = torch.Generator().manual_seed(4)
    num_steps = torch.tensor([3, 1, 5, 2])
    # Dyadic values, so that float64 sums are exact.
    values = torch.randint(-8, 9, (4, 6), generator=gen).double() / 8
    rewards = torch.tensor([1.0, 0.0, 1.0, -1.0], dtype=torch.float64)
    ends = [[2, 3, 6], [4], [1, 2, 3, 5, 8], [1, 7]]
    mask = torch.arange(8) < torch.tensor([e[-1] for e in ends])[:, None]
    steps = step_index(ends, 8)
    token_advantages, step_advantages = vine_advantages(values, steps, num_steps, rewards, mask)
    for i, n in enumerate(num_steps.tolist()):
        assert step_advantages[i].sum().item() == rewards[i].item() - values[i, 0].item()
        assert (step_advantages[i, n:] == 0).all()
        for t in range(ends[i][-1]):
            k = sum(t >= end for end in ends[i])  # the step token t belongs to
            assert token_advantages[i, t] == step_advantages[i, k]
    assert (token_advantages[~mask] == 0).all()


def test_vineppo_loss_gives_each_token_its_step_advantage_and_the_kl_to_go():
    b = ppo_batch(seed=5)
    mask = b["mask"]
    b["behaviour_token_logp"] = b["token_logp"].detach().clone()
    step_advantages = torch.randn(mask.shape, dtype=torch.float64).masked_fill(~mask, math.nan)
    batch, _ = ppo_args(b)
    loss, _ = vineppo_loss(batch, step_advantages, beta=0.1)
    loss.backward()
    kl = (b["token_logp"].detach() - b["ref_token_logp"]).masked_fill(~mask, 0.0)
    expected = -(step_advantages - 0.1 * reward_to_go(kl, mask)) / len(LENGTHS)
    assert torch.allclose(b["token_logp"].grad[mask].double(), expected[mask], atol=1e-6)


# ----------------------------------------------------------------------------- steps


def crossing_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on worked solutions without splitting at whitespace, so that its
    tokens run across line ends ("=12\\n5" and the like)."""
    solutions = [p.solution for p in world.problems("train", 400, seed=0)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator(solutions, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>")


def test_every_response_token_gets_exactly_one_step_with_a_real_tokenizer():
    tokenizer = crossing_tokenizer()
    splitter = StepSplitter(tokenizer, "\n")
    inside = 0
    for problem in world.problems("test", 30, seed=1):
        response = tokenizer(problem.solution)["input_ids"] + [tokenizer.eos_token_id]
        ends = splitter.step_ends(response, max_states=25)
        assert ends == sorted(set(ends)) and ends[-1] == len(response) and ends[0] > 0
        steps = step_index([ends], len(response))[0].tolist()
        # Each token in one step, the steps in order, each ending where a delimiter is.
        assert steps == sorted(steps) and set(steps) == set(range(len(ends)))
        assert all(steps.count(k) == end - start
                   for k, (start, end) in enumerate(zip([0, *ends], ends)))  # fmt: skip
        for end in ends[:-1]:
            text = tokenizer.decode(response[end - 1])
            assert "\n" in text
            inside += not text.endswith("\n")
        # A step's text runs from one line end to the next, whatever the tokens.
        lines = problem.solution.count("\n") + 1
        assert len(ends) == lines
    assert inside > 0, "no step ended inside a token: the test tokenizer lost its point"


def test_long_responses_keep_evenly_spaced_steps():
    assert evenly_spaced([3, 5, 8, 13, 21], 3) == [3, 8, 21]
    assert evenly_spaced([3, 5], 4) == [3, 5] and evenly_spaced([3, 5], 0) == []

    class Lines:
        def decode(self, ids):
            return "\n" if ids == [1] else "x"

    ends = StepSplitter(Lines(), "\n").step_ends([0, 1] * 40, max_states=25)
    assert len(ends) == 25 and ends[-1] == 80


# ----------------------------------------------------------------------------- Monte Carlo values


class CoinEngine:
    """A toy policy: the next token is 1 with probability p, else 2, then EOS (0). Records every
    context it was asked to continue."""

    def __init__(self, p: float, seed: int = 0) -> None:
        self.p, self.rng, self.contexts = p, np.random.default_rng(seed), []

    def generate(self, prompts, *, max_new_tokens, temperature):
        self.contexts += [tuple(p) for p in prompts]
        heads = self.rng.random(len(prompts)) < self.p
        responses = [[1 if h else 2, 0][:max_new_tokens] for h in heads]
        return Generation(response_ids=responses, logps=[0.0] * len(prompts),
                          token_logps=[[0.0] * len(r) for r in responses],
                          truncated=[len(r) < 2 for r in responses])  # fmt: skip


class Digits:
    def decode(self, ids):
        return "\n" if ids == [9] else str(ids[0])


def heads_reward(rows, responses, truncated):
    """1 when the response holds a 1 (a head)."""
    return [float(1 in response) for response in responses]


def test_identical_prefixes_are_generated_once_and_every_rollout_is_counted():
    engine = CoinEngine(0.5)
    estimator = ValueEstimator(engine, Digits(), VinePPOSettings(rollouts=3), max_new_tokens=6,
                               temperature=1.0, score=heads_reward)  # fmt: skip
    # Two prompts; responses of prompt 7 share their first step; a repeated response.
    rows = [7, 7, 7, 8]
    prompts = [[100], [100], [100], [101]]
    responses = [[3, 9, 4, 0], [3, 9, 5, 9, 0], [3, 9, 4, 0], [3, 9, 0]]
    estimates, stats = estimator.estimate(rows, prompts, responses)
    # States: (7, []), (7, [3, 9]), (7, [3, 9, 5, 9]), (8, []), (8, [3, 9])
    assert stats["vine_states"] == 5 and stats["vine_rollouts"] == 15
    assert len(engine.contexts) == 15 and len(set(engine.contexts)) == 5
    assert [e.rollouts for e in estimates] == [6, 3, 0, 6]
    assert sum(e.rollouts for e in estimates) == stats["vine_rollouts"]
    assert estimates[0].ends == [2, 4] and estimates[1].ends == [2, 4, 5]
    assert estimates[0].values == estimates[2].values  # the same states, the same estimates
    assert stats["vine_tokens"] == 15 * 2


def test_continuations_stay_within_the_response_length_limit():
    engine = CoinEngine(1.0)
    seen = []

    def score(rows, responses, truncated):
        seen.extend(zip(map(tuple, responses), truncated))
        return [0.0] * len(responses)

    estimator = ValueEstimator(engine, Digits(), VinePPOSettings(rollouts=1), max_new_tokens=3,
                               temperature=1.0, score=score)  # fmt: skip
    estimator.estimate([0], [[100]], [[3, 9, 1]])
    # s_0 continues with "1, EOS" (room 3); s_1 = [3, 9] has room for one token only.
    assert seen == [((1, 0), False), ((3, 9, 1), True)]


def test_monte_carlo_values_estimate_the_known_value_of_a_toy_policy():
    p, rollouts = 0.3, 400
    engine = CoinEngine(p, seed=1)
    estimator = ValueEstimator(engine, Digits(), VinePPOSettings(rollouts=rollouts),
                               max_new_tokens=6, temperature=1.0, score=heads_reward)  # fmt: skip
    estimates, _ = estimator.estimate([0, 1, 2], [[100], [101], [102]], [[3, 9, 0]] * 3)
    standard_error = math.sqrt(p * (1 - p) / rollouts)
    for estimate in estimates:
        # V(s_0) = p; the first step (3) holds no head, so V(s_1) = p too.
        assert all(abs(v - p) < 3 * standard_error for v in estimate.values)


def test_a_state_without_any_scored_rollout_drops_its_responses():
    def failing(rows, responses, truncated):
        return [math.nan if 9 in r else 1.0 for r in responses]

    estimator = ValueEstimator(CoinEngine(0.5), Digits(), VinePPOSettings(rollouts=2),
                               max_new_tokens=6, temperature=1.0, score=failing)  # fmt: skip
    estimates, _ = estimator.estimate([0, 1], [[100], [101]], [[3, 9, 4, 0], [3, 0]])
    assert estimates[0] is None and estimates[1].values == [1.0]


# ----------------------------------------------------------------------------- on searcher samples

ROWS = [{"prompt": f"{a}+{a}=\n", "answer": str(2 * a)} for a in range(6)]


def ends_with_answer(prompts, completions, answer, **columns):
    return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]


def searcher_config(loss: str = "ppo", **vineppo) -> RunConfig:
    """Groups of 4 responses of up to 8 tokens for `loss`: PPO's and VinePPO's searchers keep
    each token's reference log-prob, VinePPO's also estimate step values (`vineppo`: its
    settings)."""
    return RunConfig(policy={"max_new_tokens": 8}, train={"group_size": 4, "truncated": "score",
                                                          "loss": loss, "vineppo": vineppo})


def test_vineppo_searcher_samples_carry_values_and_their_cost(tiny_model, tokenizer):
    config = searcher_config("vineppo", rollouts=3, delimiter="1")
    searcher = Searcher(tiny_model, tokenizer, ROWS, [ends_with_answer], config, seed=0)
    samples, stats = searcher.generate(num_prompts=2)
    assert samples and all(s.step_values is not None for s in samples)
    for s in samples:
        assert len(s.step_values) == len(s.step_ends) and s.step_ends[-1] == len(s.response_ids)
        assert len(s.ref_token_logps) == len(s.response_ids)
        assert sum(s.ref_token_logps) == pytest.approx(s.ref_logp, abs=1e-5)
    assert sum(s.rollouts for s in samples) == stats["vine_rollouts"] == 3 * stats["vine_states"]
    response_tokens = sum(len(s.response_ids) for s in samples)
    assert stats["gen_tokens"] == response_tokens + stats["vine_tokens"] > response_tokens


def trainer(model, tokenizer, **settings) -> Trainer:
    return Trainer(frozen_copy(model).requires_grad_(True),
                   TrainConfig(learning_rate=1e-2, max_grad_norm=1.0, **settings),
                   pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip


def critic(trainer: Trainer) -> Critic:
    """The critic a PPO trainer learns (its provider of `Needs.critic`)."""
    return trainer.providers["critic"].critic


@pytest.mark.parametrize(("loss", "value_model"),
                         [("ppo", "head"), ("ppo", "critic"), ("vineppo", "head")])  # fmt: skip
def test_a_step_then_a_checkpoint_continues_exactly(tmp_path, tiny_model, tokenizer, loss,
                                                    value_model):  # fmt: skip
    vine = {"rollouts": 2, "delimiter": "1"} if loss == "vineppo" else {}
    searcher = Searcher(frozen_copy(tiny_model), tokenizer, ROWS, [ends_with_answer],
                        searcher_config(loss, **vine), seed=0)  # fmt: skip
    samples, _ = searcher.generate(num_prompts=2)
    for s in samples[::3]:  # rewards of both kinds, for advantages that are not all zero
        s.reward = 1.0
    groups = [[s for s in samples if s.prompt_id == p] for p in dict.fromkeys(
        s.prompt_id for s in samples)]  # fmt: skip
    buffer = ReplayBuffer(64)
    buffer.add(samples)
    first = trainer(tiny_model, tokenizer, loss=loss, ppo={"value_model": value_model})
    before = first.step(groups, beta=0.1)
    expected = {"ppo": {"value_loss", "explained_variance", "value_grad_norm", "advantage_std"},
                "vineppo": {"advantage_mean", "advantage_std", "clip_frac"}}[loss]
    assert expected <= set(before) and all(math.isfinite(before[k]) for k in expected
                                           if k != "explained_variance")  # fmt: skip
    assert before["grad_norm"] > 0
    if loss == "ppo":  # the head learned from the value loss
        assert critic(first).head.weight.abs().sum() > 0
    # PPO's V_old, stored with each sample at its first use, travels with the buffer.
    assert all((s.old_values is not None) == (loss == "ppo") for s in samples)
    state = {"trainer": first.state_dict(), "buffer": buffer.state_dict()}
    save_checkpoint(tmp_path, 1, state, keep=1)
    loaded = latest_checkpoint(tmp_path).state
    second = trainer(tiny_model, tokenizer, loss=loss, ppo={"value_model": value_model})
    second.load_state_dict(loaded["trainer"])
    restored = ReplayBuffer(1)
    restored.load_state_dict(loaded["buffer"])
    copies = {(c.prompt_id, c.seq, tuple(c.response_ids)): c
              for p in restored._prompts.values() for c in p.values()}  # fmt: skip
    assert [copies[(s.prompt_id, s.seq, tuple(s.response_ids))].old_values
            for s in samples] == [s.old_values for s in samples]  # fmt: skip
    copied = [[copies[(s.prompt_id, s.seq, tuple(s.response_ids))] for s in group]
              for group in groups]  # fmt: skip
    a, b = first.step(groups, beta=0.1), second.step(copied, beta=0.1)
    for key in ("loss", "grad_norm", "value_loss", "value_grad_norm"):
        assert a.get(key) == b.get(key), key
    for p, q in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(p, q)
    if loss == "ppo":
        for p, q in zip(critic(first).parameters(), critic(second).parameters()):
            assert torch.equal(p, q)


def searcher_groups(model, tokenizer, seed: int = 0) -> tuple[list, list[list]]:
    """Two prompts' samples from a searcher on `model`, rewards of both kinds, and their groups."""
    searcher = Searcher(frozen_copy(model), tokenizer, ROWS, [ends_with_answer],
                        searcher_config(), seed=seed)  # fmt: skip
    samples, _ = searcher.generate(num_prompts=2)
    for s in samples[seed % 3 :: 3]:
        s.reward = 1.0
    prompts = dict.fromkeys(s.prompt_id for s in samples)
    return samples, [[s for s in samples if s.prompt_id == p] for p in prompts]


def test_a_sample_trained_again_keeps_the_old_values_of_its_first_use(tiny_model, tokenizer):
    samples, _ = searcher_groups(tiny_model, tokenizer)
    buffer = ReplayBuffer(64, fresh_uses=2)  # TRL's num_iterations = 2
    buffer.add(samples)
    ppo = trainer(tiny_model, tokenizer, loss="ppo")
    with torch.no_grad():  # a critic whose values are not all 0 from the start
        critic(ppo).head.bias.fill_(0.3)
    rng = np.random.default_rng(0)
    uses: dict[int, list] = {}  # id(sample) -> the old values each use saw
    value_means = []
    for _ in range(4):  # 2 prompts of 4 samples, each used twice: 4 batches of 1 x 4
        batch = buffer.sample(1, 4, rng)
        assert batch.fresh == 1
        first_use = [s.old_values is None for s in batch.groups[0]]
        stats = ppo.step(batch.groups, beta=0.1)
        value_means.append(stats["value_mean"])
        for s, first in zip(batch.groups[0], first_use):
            assert len(s.old_values) == len(s.response_ids)
            uses.setdefault(id(s), []).append(list(s.old_values))
            assert first == (len(uses[id(s)]) == 1)
        tokens = sum(len(s.old_values) for s in batch.groups[0])
        mean = sum(sum(s.old_values) for s in batch.groups[0]) / tokens
        assert stats["value_mean"] == pytest.approx(mean, rel=1e-5)  # GAE ran on V_old
    assert len(uses) == len(samples) and all(len(seen) == 2 for seen in uses.values())
    assert all(seen[0] == seen[1] for seen in uses.values())  # the same V_old both times
    # The critic moved in between: a fresh copy of a sample now gets other values.
    fresh = [Sample.from_dict({**s.to_dict(), "old_values": None}) for s in samples[:4]]
    ppo.step([fresh], beta=0.1)
    assert [s.old_values for s in fresh] != [s.old_values for s in samples[:4]]


def test_a_first_use_trains_exactly_as_without_stored_values(tiny_model, tokenizer, monkeypatch):
    """Two synchronous steps on fresh samples (fresh_uses=1): the same metrics and weights as a
    trainer that never stores V_old (V_old = V detached, as before the field existed)."""
    batches = [searcher_groups(tiny_model, tokenizer, seed=seed)[1] for seed in (0, 1)]
    copies = [[[Sample.from_dict(s.to_dict()) for s in g] for g in groups] for groups in batches]
    stored = trainer(tiny_model, tokenizer, loss="ppo")
    with_stored = [stored.step(groups, beta=0.1) for groups in batches]
    monkeypatch.setattr(needs_module, "store_old_values", lambda samples, values: None)
    plain = trainer(tiny_model, tokenizer, loss="ppo")
    without = [plain.step(groups, beta=0.1) for groups in copies]
    assert all(s.old_values is None for groups in copies for g in groups for s in g)
    for a, b in zip(with_stored, without):
        for key in a.keys() - {"train_seconds", "train_tokens_per_s"}:
            assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), key
    for p, q in zip([*stored.model.parameters(), *critic(stored).parameters()],
                    [*plain.model.parameters(), *critic(plain).parameters()]):  # fmt: skip
        assert torch.equal(p, q)


def test_a_separate_critic_trains_at_its_own_rate(tiny_model, tokenizer):
    rates = {}
    for critic_lr in (None, 3e-4):
        ppo = trainer(tiny_model, tokenizer, loss="ppo",
                      ppo={"value_model": "critic", "critic_lr": critic_lr})  # fmt: skip
        rates[critic_lr] = [group["lr"] for group in critic(ppo).groups]
    assert rates == {None: [1e-2, 1e-3], 3e-4: [3e-4, 1e-3]}  # [critic LM, head]


def test_ppo_and_vineppo_are_in_the_registry():
    assert {"ppo", "vineppo"} <= set(OBJECTIVES)


# ----------------------------------------------------------------------------- end to end

COMPARED = ("loss", "reward_mean", "grad_norm", "kl", "value_loss", "value_grad_norm",
            "explained_variance", "advantage_mean", "advantage_std", "rollouts_in",
            "gen_tokens", "buffer_size")  # fmt: skip


def step_records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def stored_old_values(run_dir) -> dict[tuple, list[float] | None]:
    """The old values (PPO's V_old) of every sample in the run's last checkpoint's buffer."""
    buffer = latest_checkpoint(run_dir).state["buffer"]
    return {(d["prompt_id"], d["searcher_id"], d["incarnation"], d["seq"]): d.get("old_values")
            for _, entries in buffer["prompts"] for _, d in entries}  # fmt: skip


@pytest.fixture(scope="module")
def policy_cache(tmp_path_factory):
    """One built-in base policy for the end-to-end runs of this module."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("loss", ["ppo", "vineppo"])
def test_sync_run_trains_and_a_continued_run_matches_an_uninterrupted_one(
    tmp_path, policy_cache, loss
):
    common = [*FAST, f"pretrain.cache_dir={policy_cache}", f"train.loss={loss}",
              "train.max_minutes=null", "eval.every=1000",
              *(["train.vineppo.rollouts=3"] if loss == "vineppo" else [])]  # fmt: skip
    reference, continued = tmp_path / "reference", tmp_path / "continued"
    assert main(["train", *common, "train.max_steps=4", f"output_dir={reference}"]) == 0
    assert main(["train", *common, "train.max_steps=2", f"output_dir={continued}"]) == 0
    assert main(["train", "--resume", str(continued), "train.max_steps=4"]) == 0
    expected, got = step_records(reference), step_records(continued)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in COMPARED:
            if key in expected[step]:
                assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6,
                                                       abs=1e-7), (step, key)  # fmt: skip
    if loss == "ppo":
        assert {"value_loss", "explained_variance", "value_grad_norm"} <= set(expected[4])
        head = latest_checkpoint(continued).state["trainer"]["optimizer"]["value.head.weight"]
        assert head.abs().sum() > 0  # the value head was trained, and saved
        # V_old of every sample trained on, kept in the buffer, the same after the resume.
        kept, resumed = stored_old_values(reference), stored_old_values(continued)
        assert kept.keys() == resumed.keys() and any(v is not None for v in kept.values())
        for key, values in kept.items():
            assert (values is None) == (resumed[key] is None), key
            if values is not None:
                assert resumed[key] == pytest.approx(values, rel=1e-6, abs=1e-7), key
    else:  # the rollouts are generated samples: counted with the samples
        assert all(r["rollouts_in"] > 0 for r in expected.values())
        summary = json.loads((reference / "eval.json").read_text())
        assert summary["rollouts_generated"] == sum(r["rollouts_in"] for r in expected.values())
        samples = samples_consumed(read_metrics(reference / "metrics.jsonl"))[-1]
        assert samples == summary["samples_merged"] + summary["rollouts_generated"]


@pytest.mark.slow
def test_async_ppo_trains_and_checkpoints_its_critic(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", *TINY, f"pretrain.cache_dir={tmp_path / 'cache'}",
                 f"output_dir={run_dir}", "train.mode=async", "searchers.count=1",
                 "train.loss=ppo", "train.sync_every=2", "train.max_minutes=null",
                 "train.max_steps=4", "train.initial_buffer_samples=16"]) == 0  # fmt: skip
    records = step_records(run_dir)
    assert sorted(records) == [1, 2, 3, 4]
    assert all(math.isfinite(r["value_loss"]) for r in records.values())
    assert latest_checkpoint(run_dir).state["trainer"]["optimizer"]["value.head.weight"].any()
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["samples_lost"] == summary["samples_duplicated"] == 0


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.ppo.value_model=critic", "lora.r=4"],
     "train.ppo.value_model=critic copies the whole policy"),
    (["trainer.world_size=2"], "train.loss=ppo trains on one rank"),
    (["train.ppo.gae_lambda=1.5"], "train.ppo.gae_lambda"),
])  # fmt: skip
def test_settings_ppo_cannot_run_are_refused_in_one_line(capsys, overrides, message):
    assert main(["config", "train.loss=ppo", *overrides]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1
