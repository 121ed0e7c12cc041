"""Tests for the baseline objectives (Dr. GRPO, GRPO, RLOO, proximal RLOO, online DPO)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tba.objectives import (
    TokenBatch,
    dr_grpo_loss,
    grpo_loss,
    online_dpo_loss,
    proximal_rloo_loss,
    rloo_loss,
    tb_loss,
)

BETA = 0.1
EPS = 0.2
T_MAX = 6
GROUP_SIZES = {7: 3, 3: 5, 100: 2, 42: 4}


class Batch(NamedTuple):
    token_logp: Tensor  # (N, T), NaN in the padding: it must never leak into a loss
    behaviour: Tensor  # (N, T)
    mask: Tensor  # (N, T) bool
    rewards: Tensor  # (N,)
    ref_logp: Tensor  # (N,)
    group_ids: Tensor  # (N,)

    def tokens(self) -> TokenBatch:
        """The batch as the losses take it."""
        return TokenBatch(self.token_logp, self.mask, self.rewards, self.behaviour, self.ref_logp,
                          self.group_ids)  # fmt: skip


def make_batch(seed: int = 0, on_policy: bool = False) -> Batch:
    """Random float64 batch: unequal, shuffled, non-contiguous groups and random lengths >= 1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([g for g, size in GROUP_SIZES.items() for _ in range(size)])
    group_ids = ids[torch.randperm(ids.numel(), generator=gen)]
    n = group_ids.numel()
    lengths = torch.randint(1, T_MAX + 1, (n,), generator=gen)
    mask = torch.arange(T_MAX) < lengths[:, None]
    token_logp = -3.0 * torch.rand(n, T_MAX, generator=gen, dtype=torch.float64)
    noise = 0.3 * torch.randn(n, T_MAX, generator=gen, dtype=torch.float64)
    behaviour = token_logp if on_policy else token_logp + noise
    ref_logp = -10.0 * torch.rand(n, generator=gen, dtype=torch.float64)
    rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    token_logp = token_logp.masked_fill(~mask, math.nan).requires_grad_(True)
    behaviour = behaviour.detach().masked_fill(~mask, math.nan)
    return Batch(token_logp, behaviour, mask, rewards, ref_logp, group_ids)


# Every loss called on a Batch, so that tests can be parametrised over them.
LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "dr_grpo": lambda b, **kw: dr_grpo_loss(b.tokens(), **kw),
    "grpo": lambda b, **kw: grpo_loss(b.tokens(), **kw),
    "rloo": lambda b, **kw: rloo_loss(b.tokens(), **kw),
    "proximal_rloo": lambda b, **kw: proximal_rloo_loss(b.tokens(), **kw),
    "online_dpo": lambda b, **kw: online_dpo_loss(b.tokens(), **kw),
}


# ----------------------------------------------------------------------------- float64 references


def members_of(group_ids: Tensor) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        members.setdefault(g, []).append(i)
    return members


def tokens(values: Tensor, mask: Tensor, i: int) -> list[float]:
    """The real-token entries of row i."""
    return [v for v, m in zip(values[i].tolist(), mask[i].tolist()) if m]


def ref_shaped(b: Batch, beta: float) -> tuple[list[float], list[float], list[float]]:
    """(logp, behaviour_logp, r_tilde) per sequence, by plain Python loops."""
    n = b.mask.shape[0]
    logp = [sum(tokens(b.token_logp.detach(), b.mask, i)) for i in range(n)]
    behaviour_logp = [sum(tokens(b.behaviour, b.mask, i)) for i in range(n)]
    r_tilde = [b.rewards[i].item() - beta * (logp[i] - b.ref_logp[i].item()) for i in range(n)]
    return logp, behaviour_logp, r_tilde


def ref_advantage(b: Batch, beta: float, kind: str) -> list[float]:
    """Group-relative advantages: 'mean' (Dr. GRPO), 'std' (GRPO) or 'loo' (RLOO)."""
    _, _, r = ref_shaped(b, beta)
    adv = [0.0] * len(r)
    for members in members_of(b.group_ids).values():
        mean = sum(r[i] for i in members) / len(members)
        std = math.sqrt(sum((r[i] - mean) ** 2 for i in members) / len(members))
        for i in members:
            others = [r[j] for j in members if j != i]
            adv[i] = {
                "mean": r[i] - mean,
                "std": (r[i] - mean) / (std + 1e-4),
                "loo": r[i] - sum(others) / len(others),
            }[kind]
    return adv


def clipped_objective(rho: float, adv: float) -> tuple[float, bool]:
    clipped = min(max(rho, 1 - EPS), 1 + EPS) * adv
    return min(rho * adv, clipped), clipped < rho * adv


def ref_token_ppo(b: Batch, beta: float, length_normalise: bool) -> tuple[float, float]:
    """(loss, clip_frac) of Dr. GRPO (False) or GRPO (True), looping over tokens."""
    adv = ref_advantage(b, beta, "std" if length_normalise else "mean")
    n = b.mask.shape[0]
    total, n_clipped, n_tokens = 0.0, 0, 0
    for i in range(n):
        cur, old = tokens(b.token_logp.detach(), b.mask, i), tokens(b.behaviour, b.mask, i)
        seq = 0.0
        for lp, blp in zip(cur, old):
            o, clipped = clipped_objective(math.exp(lp - blp), adv[i])
            seq += o
            n_clipped += clipped
            n_tokens += 1
        total += seq / len(cur) if length_normalise else seq
    loss = -total / n
    return loss, n_clipped / n_tokens


def ref_loss(name: str, b: Batch) -> float:
    logp, behaviour_logp, _ = ref_shaped(b, BETA)
    n = len(logp)
    if name in ("dr_grpo", "grpo"):
        return ref_token_ppo(b, BETA, length_normalise=name == "grpo")[0]
    adv = ref_advantage(b, BETA, "loo")
    if name == "rloo":
        return -sum(a * lp for a, lp in zip(adv, logp)) / n
    if name == "proximal_rloo":
        rhos = [math.exp(lp - blp) for lp, blp in zip(logp, behaviour_logp)]
        return -sum(clipped_objective(rho, a)[0] for rho, a in zip(rhos, adv)) / n
    assert name == "online_dpo"
    terms = []
    for members in members_of(b.group_ids).values():
        best = worst = members[0]
        for i in members:  # strict comparisons keep the first among equals
            best = i if b.rewards[i] > b.rewards[best] else best
            worst = i if b.rewards[i] < b.rewards[worst] else worst
        if b.rewards[best] == b.rewards[worst]:
            continue
        margin = (logp[best] - b.ref_logp[best].item()) - (logp[worst] - b.ref_logp[worst].item())
        terms.append(math.log1p(math.exp(-BETA * margin)))  # -log sigmoid(beta * margin)
    return sum(terms) / len(terms)


def per_token(values: list[float], mask: Tensor) -> Tensor:
    """Broadcast per-sequence values onto the real tokens (0 on padding)."""
    return torch.tensor(values, dtype=torch.float64)[:, None] * mask


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("name", LOSSES)
def test_matches_float64_loop_reference(name: str) -> None:
    b = make_batch(seed=1)
    loss, stats = LOSSES[name](b, beta=BETA)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and loss.requires_grad
    assert loss.item() == pytest.approx(ref_loss(name, b), rel=1e-5, abs=1e-6)
    assert all(not v.requires_grad and v.is_floating_point() for v in stats.values())
    if name in ("dr_grpo", "grpo"):
        clip_frac = ref_token_ppo(b, BETA, length_normalise=name == "grpo")[1]
        assert 0.0 < clip_frac < 1.0  # the off-policy batch exercises both branches
        assert stats["clip_frac"].item() == pytest.approx(clip_frac)


@pytest.mark.parametrize("name", LOSSES)
def test_permutation_invariance(name: str) -> None:
    b = make_batch(seed=2)
    perm = torch.randperm(b.mask.shape[0], generator=torch.Generator().manual_seed(3))
    permuted = Batch(*(t.detach()[perm] for t in b))._replace(
        token_logp=b.token_logp.detach()[perm].requires_grad_(True)
    )
    loss, _ = LOSSES[name](b, beta=BETA)
    loss_p, _ = LOSSES[name](permuted, beta=BETA)
    assert loss_p.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    ("name", "kind"),
    [("dr_grpo", "mean"), ("grpo", "std"), ("rloo", "loo"), ("proximal_rloo", "loo")],
)
def test_on_policy_gradient_is_closed_form(name: str, kind: str) -> None:
    b = make_batch(seed=4, on_policy=True)
    loss, stats = LOSSES[name](b, beta=BETA)
    loss.backward()
    n = b.mask.shape[0]
    scale = {"grpo": n * b.mask.sum(dim=1, keepdim=True).double()}.get(
        name, torch.full((n, 1), float(n), dtype=torch.float64)
    )
    expected = -per_token(ref_advantage(b, BETA, kind), b.mask) / scale
    assert torch.allclose(b.token_logp.grad, expected, rtol=1e-5, atol=1e-7)
    assert stats.get("clip_frac", torch.tensor(0.0)).item() == 0.0


@pytest.mark.parametrize("name", ["dr_grpo", "grpo"])
def test_clipped_tokens_get_no_gradient(name: str) -> None:
    b = make_batch(seed=5, on_policy=True)
    gen = torch.Generator().manual_seed(6)
    rho = torch.tensor([0.5, 0.9, 1.1, 1.5], dtype=torch.float64)[
        torch.randint(0, 4, b.mask.shape, generator=gen)
    ]
    b = b._replace(behaviour=b.behaviour - rho.log())
    loss, stats = LOSSES[name](b, beta=BETA)
    loss.backward()

    adv = per_token(ref_advantage(b, BETA, "std" if name == "grpo" else "mean"), b.mask)
    clipped = b.mask & (((adv > 0) & (rho > 1 + EPS)) | ((adv < 0) & (rho < 1 - EPS)))
    outside_unclipped = b.mask & ~clipped & ((rho > 1 + EPS) | (rho < 1 - EPS))
    assert clipped.any() and outside_unclipped.any()
    n = b.mask.shape[0]
    scale = n * (b.mask.sum(dim=1, keepdim=True) if name == "grpo" else 1)
    expected = torch.where(clipped, 0.0, -rho * adv / scale)
    assert torch.allclose(b.token_logp.grad, expected, rtol=1e-5, atol=1e-7)
    assert (b.token_logp.grad[clipped] == 0).all()
    assert stats["clip_frac"].item() == pytest.approx(clipped.sum().item() / b.mask.sum().item())


def test_proximal_rloo_clips_sequence_ratio() -> None:
    b = make_batch(seed=7, on_policy=True)
    gen = torch.Generator().manual_seed(8)
    rho = torch.tensor([0.5, 0.9, 1.1, 1.5], dtype=torch.float64)[
        torch.randint(0, 4, (b.mask.shape[0],), generator=gen)
    ]
    behaviour = b.behaviour.clone()
    behaviour[:, 0] -= rho.log()  # the whole sequence log-ratio sits on the first token
    b = b._replace(behaviour=behaviour)
    loss, stats = LOSSES["proximal_rloo"](b, beta=BETA)
    loss.backward()

    adv = torch.tensor(ref_advantage(b, BETA, "loo"), dtype=torch.float64)
    clipped = ((adv > 0) & (rho > 1 + EPS)) | ((adv < 0) & (rho < 1 - EPS))
    assert clipped.any() and not clipped.all()
    weight = torch.where(clipped, 0.0, -rho * adv / len(adv))
    assert torch.allclose(b.token_logp.grad, weight[:, None] * b.mask, rtol=1e-5, atol=1e-7)
    assert stats["clip_frac"].item() == pytest.approx(clipped.double().mean().item())
    assert loss.item() == pytest.approx(ref_loss("proximal_rloo", b), rel=1e-5, abs=1e-6)


def test_proximal_rloo_on_policy_equals_rloo() -> None:
    """Same gradient as RLOO; the value of a ratio surrogate is -(1/N) sum_i A_i = 0 instead."""
    b = make_batch(seed=9, on_policy=True)
    b2 = b._replace(token_logp=b.token_logp.detach().clone().requires_grad_(True))
    loss, stats = LOSSES["proximal_rloo"](b, beta=BETA)
    loss_rloo, stats_rloo = LOSSES["rloo"](b2, beta=BETA)
    loss.backward()
    loss_rloo.backward()
    assert torch.allclose(b.token_logp.grad, b2.token_logp.grad, rtol=1e-5, atol=1e-7)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # LOO advantages sum to 0 per group
    for key in ("advantage_abs_mean", "kl"):
        assert torch.allclose(stats[key], stats_rloo[key])


def test_proximal_rloo_stale_sample_does_not_overflow() -> None:
    b = make_batch(seed=10)
    b = b._replace(behaviour=b.behaviour - 500.0)  # sequence log-ratio >= 500: exp overflows
    loss, stats = LOSSES["proximal_rloo"](b, beta=BETA)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(b.token_logp.grad).all()


@pytest.mark.parametrize("name", ["dr_grpo", "grpo", "rloo", "proximal_rloo"])
def test_a_kl_term_fixed_at_sampling_shifts_each_reward_by_beta_times_the_drift(name: str) -> None:
    """r - beta (kl_logp - ref) = [r - beta (kl_logp - logp)] - beta (logp - ref): the same loss
    and gradient as the default on rewards shifted by the policy's drift since sampling."""
    b = make_batch(seed=17)
    logp = (b.token_logp.detach().nan_to_num() * b.mask).sum(dim=1)
    behaviour_logp = (b.behaviour.nan_to_num() * b.mask).sum(dim=1)
    shifted = b._replace(
        token_logp=b.token_logp.detach().clone().requires_grad_(True),
        rewards=b.rewards - BETA * (behaviour_logp - logp),
    )
    loss, stats = LOSSES[name](b, beta=BETA, kl_logp=behaviour_logp)
    loss_shifted, stats_shifted = LOSSES[name](shifted, beta=BETA)
    loss.backward()
    loss_shifted.backward()
    assert loss.item() == pytest.approx(loss_shifted.item(), rel=1e-5, abs=1e-6)
    assert b.token_logp.grad.abs().max() > 1e-3
    assert torch.allclose(b.token_logp.grad, shifted.token_logp.grad, rtol=1e-5, atol=1e-7)
    assert stats["kl"].item() == pytest.approx(stats_shifted["kl"].item())  # the current KL
    current, _ = LOSSES[name](b, beta=BETA, kl_logp=logp)
    assert current.item() == pytest.approx(LOSSES[name](b, beta=BETA)[0].item(), rel=1e-5)


def test_rloo_gradient_is_vargrad_tb_gradient_times_k_over_k_minus_1_off_policy_too() -> None:
    """With the current policy's KL in its reward, RLOO is TB (reward units) on any batch."""
    b = make_batch(seed=18)
    loss, _ = LOSSES["rloo"](b, beta=BETA)
    loss.backward()
    logp = (b.token_logp.detach().nan_to_num() * b.mask).sum(dim=1).requires_grad_(True)
    (grad_tb,) = torch.autograd.grad(
        tb_loss(logp, b.ref_logp, b.rewards, b.group_ids, beta=BETA)[0], logp
    )
    size = torch.tensor([GROUP_SIZES[g] for g in b.group_ids.tolist()], dtype=torch.float64)
    expected = (size / (size - 1) * grad_tb.double())[:, None] * b.mask
    assert torch.allclose(b.token_logp.grad, expected, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- online DPO


def test_online_dpo_picks_best_and_worst_with_ties() -> None:
    b = make_batch(seed=11)
    # group 5: rewards 1, 3, 0, 3, 0 -> best = index 2 (first 3), worst = index 4 (first 0);
    # groups 9 and 7 are all-equal (skipped); group 11: best = 10, worst = 9.
    group_ids = torch.tensor([5, 9, 5, 7, 5, 9, 5, 7, 5, 11, 11, 11, 11, 7])
    rewards = torch.tensor([1, 2, 3, 4, 0, 2, 3, 4, 0, -1, 5, 5, -1, 4], dtype=torch.float64)
    b = b._replace(group_ids=group_ids, rewards=rewards)
    loss, stats = LOSSES["online_dpo"](b, beta=BETA)
    loss.backward()
    assert stats["pairs"].item() == 2
    assert loss.item() == pytest.approx(ref_loss("online_dpo", b), rel=1e-5)
    row_grad = b.token_logp.grad.sum(dim=1)
    assert row_grad.nonzero().flatten().tolist() == [2, 4, 9, 10]
    assert (row_grad[[2, 10]] < 0).all() and (row_grad[[4, 9]] > 0).all()


def test_online_dpo_all_equal_rewards_gives_connected_zero() -> None:
    b = make_batch(seed=12)
    b = b._replace(rewards=b.group_ids.double())  # equal within each group
    loss, stats = LOSSES["online_dpo"](b, beta=BETA)
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert (b.token_logp.grad == 0).all()
    assert stats["pairs"].item() == 0 and stats["margin"].item() == 0.0


# ----------------------------------------------------------------------------- validation


def _invalid(case: str, b: Batch) -> Batch:
    n = b.mask.shape[0]
    if case == "token shape":
        return b._replace(token_logp=torch.zeros(n, T_MAX + 1), behaviour=torch.zeros(n, T_MAX + 1))
    if case == "sequence shape":
        return b._replace(rewards=b.rewards[:-1])
    if case == "singleton":
        return b._replace(group_ids=torch.cat([b.group_ids[:-1], torch.tensor([12345])]))
    if case == "integer":
        return b._replace(group_ids=b.group_ids.double())
    if case == "real token":
        mask = b.mask.clone()
        mask[3] = False
        return b._replace(mask=mask)
    if case == "0 and 1":
        return b._replace(mask=b.mask.double() * 2)
    assert case == "2-D"
    return b._replace(mask=b.mask[:, 0])


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("token shape", "shape of mask"),
        ("sequence shape", r"rewards must have shape \(N,\)"),
        ("singleton", "singleton group ids: \\[12345\\]"),
        ("integer", "integer"),
        ("real token", "empty rows: \\[3\\]"),
        ("0 and 1", "0 and 1"),
        ("2-D", "2-D"),
    ],
)
def test_invalid_inputs_raise(name: str, case: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LOSSES[name](_invalid(case, make_batch(seed=13)), beta=BETA)


@pytest.mark.parametrize("name", LOSSES)
def test_invalid_hyperparameters_raise(name: str) -> None:
    b = make_batch(seed=14)
    with pytest.raises(ValueError, match="beta"):
        LOSSES[name](b, beta=-1.0)
    if name in ("dr_grpo", "grpo", "proximal_rloo"):
        with pytest.raises(ValueError, match="clip_eps"):
            LOSSES[name](b, beta=BETA, clip_eps=0.0)


def test_behaviour_shape_mismatch_raises() -> None:
    b = make_batch(seed=15)
    for name in ("dr_grpo", "grpo", "proximal_rloo"):
        with pytest.raises(ValueError, match="behaviour_token_logp"):
            LOSSES[name](b._replace(behaviour=b.behaviour[:, :-1]), beta=BETA)


# ----------------------------------------------------------------------------- TB vs REINFORCE


def reinforce_mean_baseline(
    logp: Tensor, ref_logp: Tensor, rewards: Tensor, group_ids: Tensor, beta: float
) -> Tensor:
    """-(1/N) sum_i (r_tilde_i - mean_g r_tilde) logp_i with r_tilde = r - beta stopgrad(KL)."""
    r_tilde = rewards - beta * (logp - ref_logp).detach()
    members = members_of(group_ids)
    baseline = torch.stack([r_tilde[members[g]].mean() for g in group_ids.tolist()])
    return -((r_tilde - baseline) * logp).mean()


def test_tb_gradient_is_reinforce_with_mean_baseline() -> None:
    """SPEC: on-policy, the paper's TB gradient is (2/beta) grad REINFORCE(mean baseline,
    KL-shaped reward); in reward units (beta/2 times the paper's loss) it is exactly REINFORCE's.

    TB's gradient w.r.t. logp_i is -(1/N)[(r_i - r_bar) - beta (KL_i - KL_bar)]
    = -(1/N)(r_tilde_i - mean_g r_tilde). Checked w.r.t. logp directly and w.r.t. the parameters
    of a tiny embedding + linear bigram policy; also against dr_grpo_loss on on-policy data
    (rho = 1, so clipping never activates), whose gradient is REINFORCE's too.
    """
    torch.manual_seed(16)
    b = make_batch(seed=16)
    n, t_max = b.mask.shape
    vocab, bos = 5, 0
    embed = torch.nn.Embedding(vocab, 8, dtype=torch.float64)
    head = torch.nn.Linear(8, vocab, dtype=torch.float64)
    params = [*embed.parameters(), *head.parameters()]
    ids = torch.randint(1, vocab, (n, t_max))
    prev = torch.cat([torch.full((n, 1), bos), ids[:, :-1]], dim=1)
    token_logp = F.log_softmax(head(embed(prev)), dim=-1).gather(-1, ids[:, :, None])[..., 0]
    logp = (token_logp * b.mask).sum(dim=1)
    args = (b.ref_logp, b.rewards, b.group_ids)

    # w.r.t. logp directly
    leaf = logp.detach().requires_grad_(True)
    (grad_tb,) = torch.autograd.grad(tb_loss(leaf, *args, beta=BETA)[0], leaf)
    (grad_rf,) = torch.autograd.grad(
        reinforce_mean_baseline(leaf, b.ref_logp, b.rewards, b.group_ids, BETA), leaf
    )
    assert grad_rf.abs().max() > 1e-3
    assert torch.allclose(grad_tb.double(), grad_rf, rtol=1e-5, atol=1e-7)

    # w.r.t. the policy parameters
    tb = torch.autograd.grad(tb_loss(logp, *args, beta=BETA)[0], params, retain_graph=True)
    rf = torch.autograd.grad(
        reinforce_mean_baseline(logp, b.ref_logp, b.rewards, b.group_ids, BETA),
        params,
        retain_graph=True,
    )
    on_policy = b._replace(token_logp=token_logp, behaviour=token_logp.detach())
    dr, _ = dr_grpo_loss(on_policy.tokens(), beta=BETA)
    dr_grads = torch.autograd.grad(dr, params)
    for g_tb, g_rf, g_dr in zip(tb, rf, dr_grads):
        assert g_rf.abs().max() > 1e-4
        assert torch.allclose(g_tb, g_rf, rtol=1e-4, atol=1e-7)
        assert torch.allclose(g_dr, g_rf, rtol=1e-4, atol=1e-7)
