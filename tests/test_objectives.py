"""Tests for the VarGrad Trajectory Balance loss (plain and with its trust region) and the beta
schedule. The float64 references write the paper's loss in nats; `tb_loss` is that times beta/2."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tba.objectives import BetaSchedule, TokenBatch, group_mean, tb_loss, tb_trust_region_loss

BETA = 0.5
GROUP_SIZES = {7: 3, 3: 5, 100: 2, 42: 4}


def make_batch(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random float64 batch with unequal, shuffled, non-contiguous groups."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([g for g, size in GROUP_SIZES.items() for _ in range(size)])
    group_ids = ids[torch.randperm(ids.numel(), generator=gen)]
    n = group_ids.numel()
    logp = -5.0 * torch.rand(n, generator=gen, dtype=torch.float64)
    ref_logp = -5.0 * torch.rand(n, generator=gen, dtype=torch.float64)
    rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    return logp, ref_logp, rewards, group_ids


def reference(
    logp: Tensor, ref_logp: Tensor, rewards: Tensor, group_ids: Tensor, beta: float
) -> tuple[float, list[float], list[float]]:
    """Straightforward float64 TB loss with a Python loop over groups: (loss, log_z, delta)."""
    ids = group_ids.tolist()
    delta = [
        lp - rl - r / beta
        for lp, rl, r in zip(logp.tolist(), ref_logp.tolist(), rewards.tolist(), strict=True)
    ]
    log_z_of = {}
    for g in set(ids):
        members = [i for i, gi in enumerate(ids) if gi == g]
        log_z_of[g] = sum(-delta[i] for i in members) / len(members)
    log_z = [log_z_of[g] for g in ids]
    loss = sum((z + d) ** 2 for z, d in zip(log_z, delta, strict=True)) / len(ids)
    return loss, log_z, delta


def f64(values: list[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_matches_float64_loop_reference() -> None:
    batch = make_batch()
    loss, log_z = tb_loss(*batch, beta=BETA)
    ref_loss, ref_log_z, _ = reference(*batch, beta=BETA)
    assert loss.item() == pytest.approx(BETA / 2 * ref_loss, rel=1e-5, abs=1e-6)
    assert torch.allclose(log_z.double(), f64(ref_log_z), rtol=1e-5, atol=1e-5)
    assert log_z.shape == batch[0].shape and not log_z.requires_grad


def test_group_mean_matches_loop() -> None:
    values, _, _, group_ids = make_batch(seed=1)
    expected = [values[group_ids == g].mean().item() for g in group_ids.tolist()]
    assert torch.allclose(group_mean(values, group_ids), f64(expected))


def test_logp_gradient_is_closed_form() -> None:
    logp, ref_logp, rewards, group_ids = make_batch(seed=2)
    logp.requires_grad_(True)
    loss, _ = tb_loss(logp, ref_logp, rewards, group_ids, beta=BETA)
    loss.backward()
    _, ref_log_z, delta = reference(logp.detach(), ref_logp, rewards, group_ids, beta=BETA)
    # In reward units: beta/2 times the paper's gradient 2/N (log Z_hat + delta).
    expected = BETA / logp.numel() * (f64(ref_log_z) + f64(delta))
    assert torch.allclose(logp.grad, expected, rtol=1e-5, atol=1e-6)


def test_parameter_gradient_through_linear_policy() -> None:
    torch.manual_seed(3)
    _, ref_logp, rewards, group_ids = make_batch(seed=3)
    n = group_ids.numel()
    features = torch.randn(n, 4, dtype=torch.float64)
    policy = torch.nn.Linear(4, 1, dtype=torch.float64)
    params = list(policy.parameters())
    logp = -F.softplus(policy(features)).squeeze(-1)

    loss, log_z = tb_loss(logp, ref_logp, rewards, group_ids, beta=BETA)
    grads = torch.autograd.grad(loss, params, retain_graph=True)

    delta = logp.detach() - ref_logp - rewards / BETA
    weights = BETA / n * (log_z.double() + delta)
    expected = [torch.zeros_like(p) for p in params]
    for i in range(n):
        per_sample = torch.autograd.grad(logp[i], params, retain_graph=True)
        for acc, g in zip(expected, per_sample, strict=True):
            acc += weights[i] * g
    for got, want in zip(grads, expected, strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_permutation_invariance() -> None:
    batch = make_batch(seed=4)
    perm = torch.randperm(batch[0].numel(), generator=torch.Generator().manual_seed(5))
    loss, log_z = tb_loss(*batch, beta=BETA)
    loss_p, log_z_p = tb_loss(*(t[perm] for t in batch), beta=BETA)
    assert torch.allclose(loss, loss_p, rtol=1e-6, atol=1e-7)
    assert torch.allclose(log_z[perm], log_z_p, rtol=1e-6, atol=1e-6)


def test_zero_loss_iff_delta_constant_within_groups() -> None:
    _, ref_logp, rewards, group_ids = make_batch(seed=6)
    constant = {g: 3.0 * k - 4.0 for k, g in enumerate(GROUP_SIZES)}
    offsets = f64([constant[g] for g in group_ids.tolist()])
    logp = ref_logp + rewards / BETA + offsets
    loss, log_z = tb_loss(logp, ref_logp, rewards, group_ids, beta=BETA)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(log_z.double(), -offsets, atol=1e-5)

    noisy = logp + 0.1 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(7))
    loss_noisy, _ = tb_loss(noisy, ref_logp, rewards, group_ids, beta=BETA)
    assert loss_noisy.item() > 1e-4


def test_gradient_is_advantage_weighted_policy_gradient() -> None:
    logp, ref_logp, rewards, group_ids = make_batch(seed=8)
    loss, log_z = tb_loss(logp, ref_logp, rewards, group_ids, beta=BETA)
    delta = logp - ref_logp - rewards / BETA
    kl = logp - ref_logp
    ids = group_ids.tolist()
    r_bar = f64([rewards[group_ids == g].mean().item() for g in ids])
    kl_bar = f64([kl[group_ids == g].mean().item() for g in ids])
    advantage = (rewards - r_bar) / BETA - (kl - kl_bar)
    assert torch.allclose(-(log_z.double() + delta), advantage, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("lengths", "group_ids", "beta", "match"),
    [
        ((4, 4, 4), [1, 1, 2, 3], 0.5, "singleton"),
        ((4, 3, 4), [1, 1, 2, 2], 0.5, "same length"),
        ((4, 4, 4), [1, 1, 2, 2], 0.0, "beta"),
        ((4, 4, 4), [1, 1, 2, 2], -1.0, "beta"),
    ],
)
def test_invalid_inputs_raise(
    lengths: tuple[int, int, int], group_ids: list[int], beta: float, match: str
) -> None:
    logp, ref_logp, rewards = (torch.zeros(n) for n in lengths)
    with pytest.raises(ValueError, match=match):
        tb_loss(logp, ref_logp, rewards, torch.tensor(group_ids), beta=beta)


def test_non_1d_input_raises() -> None:
    with pytest.raises(ValueError, match="1-D"):
        tb_loss(
            torch.zeros(2, 2), torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.long), 1.0
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_computes_in_float32(dtype: torch.dtype) -> None:
    logp, ref_logp, rewards, group_ids = make_batch(seed=9)
    loss, log_z = tb_loss(
        logp.to(dtype), ref_logp.to(dtype), rewards.to(dtype), group_ids, beta=BETA
    )
    assert loss.dtype == torch.float32 and log_z.dtype == torch.float32


# ----------------------------------------------------------------------------- trust region

T_MAX = 5


def make_token_batch(seed: int, on_policy: bool) -> tuple[Tensor, ...]:
    """(token_logp (N, T) leaf, behaviour (N, T), mask (N, T), rewards, ref_logp, group_ids),
    float64, random lengths >= 1, NaN in the padding (it must never leak into the loss)."""
    gen = torch.Generator().manual_seed(seed)
    _, ref_logp, rewards, group_ids = make_batch(seed)
    n = group_ids.numel()
    mask = torch.arange(T_MAX) < torch.randint(1, T_MAX + 1, (n, 1), generator=gen)
    token_logp = -2.0 * torch.rand(n, T_MAX, generator=gen, dtype=torch.float64)
    noise = 0.15 * torch.randn(n, T_MAX, generator=gen, dtype=torch.float64)
    behaviour = token_logp.clone() if on_policy else token_logp + noise
    token_logp = token_logp.masked_fill(~mask, math.nan).requires_grad_(True)
    behaviour = behaviour.masked_fill(~mask, math.nan)
    return token_logp, behaviour, mask, rewards, ref_logp, group_ids


def tokens(token_logp: Tensor, behaviour: Tensor, mask: Tensor, rewards: Tensor,
           ref_logp: Tensor, group_ids: Tensor) -> TokenBatch:  # fmt: skip
    """A batch of `make_token_batch`'s tensors as the losses take it."""
    return TokenBatch(token_logp, mask, rewards, behaviour_token_logp=behaviour,
                      ref_logp=ref_logp, group_ids=group_ids)  # fmt: skip


def reference_trust_region(
    batch: tuple[Tensor, ...], level: str, eps: float
) -> tuple[float, float]:
    """(loss, clip_frac) by loops in float64: A_i = -beta (log Z_hat + delta_i), PPO-clipped."""
    token_logp, behaviour, mask, rewards, ref_logp, group_ids = batch
    n = group_ids.numel()
    tokens = [[(token_logp[i, t].item(), behaviour[i, t].item()) for t in range(T_MAX)
               if mask[i, t]] for i in range(n)]  # fmt: skip
    logp = f64([sum(lp for lp, _ in row) for row in tokens])
    _, log_z, delta = reference(logp, ref_logp, rewards, group_ids, beta=BETA)
    advantage = [-BETA * (z + d) for z, d in zip(log_z, delta, strict=True)]

    def clipped(rho: float, a: float) -> tuple[float, bool]:
        low = min(rho * a, min(max(rho, 1 - eps), 1 + eps) * a)
        return low, low < rho * a

    total, n_clipped, n_units = 0.0, 0, 0
    for row, a in zip(tokens, advantage, strict=True):
        ratios = [math.exp(sum(lp - blp for lp, blp in row))] if level == "sequence" else [
            math.exp(lp - blp) for lp, blp in row
        ]
        for rho in ratios:
            value, was_clipped = clipped(rho, a)
            total += value
            n_clipped += was_clipped
            n_units += 1
    return -total / n, n_clipped / n_units


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_trust_region_matches_float64_loop_reference(level: str) -> None:
    batch = make_token_batch(seed=11, on_policy=False)
    loss, stats = tb_trust_region_loss(tokens(*batch), beta=BETA, clip_eps=0.1, level=level)
    ref_loss, ref_clip_frac = reference_trust_region(batch, level, eps=0.1)
    assert loss.dtype == torch.float32 and loss.requires_grad
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert 0.0 < ref_clip_frac < 1.0  # both branches are exercised
    assert stats["clip_frac"].item() == pytest.approx(ref_clip_frac)


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_trust_region_on_policy_gives_the_plain_tb_gradient(level: str) -> None:
    token_logp, behaviour, mask, rewards, ref_logp, group_ids = make_token_batch(12, True)
    loss, stats = tb_trust_region_loss(
        tokens(token_logp, behaviour, mask, rewards, ref_logp, group_ids), beta=BETA, level=level
    )
    loss.backward()
    leaf = token_logp.detach().nan_to_num(0.0).requires_grad_(True)
    plain, _ = tb_loss((leaf * mask).sum(dim=1), ref_logp, rewards, group_ids, beta=BETA)
    plain.backward()
    assert torch.allclose(token_logp.grad, leaf.grad * mask, rtol=1e-5, atol=1e-7)
    assert token_logp.grad.abs().max() > 1e-3
    assert stats["clip_frac"].item() == 0.0


def test_sequences_pushed_out_of_the_band_get_no_gradient() -> None:
    token_logp, behaviour, mask, rewards, ref_logp, group_ids = make_token_batch(13, True)
    n = group_ids.numel()
    pick = torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(14))
    rho = f64([0.5, 0.9, 1.1, 1.5])[pick]
    behaviour = behaviour.clone()
    behaviour[:, 0] -= rho.log()  # the whole sequence log-ratio sits on the first token
    loss, stats = tb_trust_region_loss(
        tokens(token_logp, behaviour, mask, rewards, ref_logp, group_ids), beta=BETA, clip_eps=0.2
    )
    loss.backward()
    logp = (token_logp.detach().nan_to_num(0.0) * mask).sum(dim=1)
    _, log_z, delta = reference(logp, ref_logp, rewards, group_ids, beta=BETA)
    advantage = -BETA * (f64(log_z) + f64(delta))
    clipped = ((advantage > 0) & (rho > 1.2)) | ((advantage < 0) & (rho < 0.8))
    assert clipped.any() and (~clipped & ((rho > 1.2) | (rho < 0.8))).any()
    expected = torch.where(clipped, 0.0, -rho * advantage / n)[:, None] * mask
    assert torch.allclose(token_logp.grad, expected, rtol=1e-5, atol=1e-7)
    assert stats["clip_frac"].item() == pytest.approx(clipped.double().mean().item())


def test_trust_region_level_is_checked() -> None:
    batch = make_token_batch(seed=15, on_policy=True)
    with pytest.raises(ValueError, match="level"):
        tb_trust_region_loss(tokens(*batch), beta=BETA, level="batch")


def test_learned_log_z_gets_the_residual_as_gradient_and_allows_groups_of_one() -> None:
    logp, ref_logp, rewards, _ = make_batch(seed=16)
    group_ids = torch.arange(logp.numel())  # every sequence a prompt of its own
    logp.requires_grad_(True)
    log_z = torch.linspace(-3, 3, logp.numel(), dtype=torch.float64, requires_grad=True)
    loss, returned = tb_loss(logp, ref_logp, rewards, group_ids, beta=BETA, log_z=log_z)
    loss.backward()
    delta = logp.detach() - ref_logp - rewards / BETA
    expected = BETA / logp.numel() * (log_z.detach() + delta)
    assert torch.allclose(log_z.grad, expected, rtol=1e-5, atol=1e-6)
    assert torch.allclose(logp.grad, expected, rtol=1e-5, atol=1e-6)
    assert not returned.requires_grad and torch.allclose(returned.double(), log_z.detach())


def test_trust_region_trains_a_learned_log_z_without_moving_the_advantage() -> None:
    token_logp, behaviour, mask, rewards, ref_logp, group_ids = make_token_batch(17, True)
    log_z = torch.zeros(group_ids.numel(), dtype=torch.float64, requires_grad=True)
    loss, stats = tb_trust_region_loss(
        tokens(token_logp, behaviour, mask, rewards, ref_logp, group_ids), beta=BETA, log_z=log_z
    )
    loss.backward()
    logp = (token_logp.detach().nan_to_num(0.0) * mask).sum(dim=1)
    delta = logp - ref_logp - rewards / BETA
    n = group_ids.numel()
    assert torch.allclose(log_z.grad, BETA / n * (log_z.detach() + delta), rtol=1e-5, atol=1e-6)
    # On-policy, each token's gradient is -A_i / N with A_i = -beta (log_z_i + delta_i).
    expected = (BETA * delta / n)[:, None] * mask
    assert torch.allclose(token_logp.grad, expected, rtol=1e-5, atol=1e-6)
    assert stats["log_z"].item() == 0.0


def test_beta_schedule_constant() -> None:
    schedule = BetaSchedule(0.05)
    assert [schedule(p) for p in (-1.0, 0.0, 0.3, 1.0, 2.0)] == [0.05] * 5


def test_beta_schedule_linear_anneal() -> None:
    schedule = BetaSchedule(0.012, 0.004, start_frac=0.1, end_frac=0.9)
    assert schedule(-0.5) == 0.012
    assert schedule(0.0) == 0.012
    assert schedule(0.1) == 0.012
    assert schedule(0.5) == pytest.approx(0.008)
    assert schedule(0.3) == pytest.approx(0.010)
    assert schedule(0.9) == pytest.approx(0.004)
    assert schedule(1.0) == 0.004
    assert schedule(1.5) == 0.004


@pytest.mark.parametrize(
    "kwargs",
    [
        {"start": 0.0},
        {"start": -0.1},
        {"start": 0.1, "end": 0.0},
        {"start": 0.1, "end": 0.05, "start_frac": -0.1},
        {"start": 0.1, "end": 0.05, "start_frac": 0.6, "end_frac": 0.4},
        {"start": 0.1, "end": 0.05, "end_frac": 1.1},
    ],
)
def test_beta_schedule_invalid_args_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BetaSchedule(**kwargs)
