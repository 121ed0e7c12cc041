"""Tests for the VarGrad Trajectory Balance loss and the beta schedule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tba.objectives import BetaSchedule, group_mean, tb_loss

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
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
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
    expected = 2.0 / logp.numel() * (f64(ref_log_z) + f64(delta))
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
    weights = 2.0 / n * (log_z.double() + delta)
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
