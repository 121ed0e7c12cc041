"""The learning rate's warmup and decay (`tba.lr_schedule.lr_factor`) against float64
references and transformers' own schedules, and AdamW's decoupled weight decay: matrices decay,
biases and norm weights do not, as in transformers' Trainer."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from tba.config import TrainConfig
from tba.lr_schedule import lr_factor, warmup_steps_for
from tba.trainer import Trainer, decay_groups


def reference(step: int, schedule: str, warmup: int, total: int) -> float:
    """The formula of `lr_factor`'s docstring, in float64."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(max((step - warmup) / max(1, total - warmup), 0.0), 1.0)
    return {"constant": 1.0, "linear": 1.0 - progress,
            "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[schedule]  # fmt: skip


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_the_schedule_is_its_formula(schedule, warmup):
    total = 20
    for step in range(total + 2):
        assert lr_factor(step, schedule, warmup, total) == pytest.approx(
            reference(step, schedule, warmup, total), abs=1e-12)  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "theirs"),
    [("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)],
)
def test_after_the_warmup_the_decay_is_transformers(schedule, theirs):
    total, warmup = 17, 4
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = theirs(optimizer, warmup, total)
    for step in range(warmup, total):
        assert lr_factor(step, schedule, warmup, total) == pytest.approx(
            scheduler.lr_lambdas[0](step), abs=1e-12)  # fmt: skip
    assert lr_factor(total, schedule, warmup, total) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(0, schedule, warmup, total) == 1 / 5  # tba's first step is not a no-op


def test_warmup_steps_from_a_ratio_round_up_and_steps_win():
    assert warmup_steps_for(95, 0, 0.1) == 10  # ceil(9.5), as transformers rounds it
    assert warmup_steps_for(95, 4, 0.1) == 4
    assert warmup_steps_for(None, 0, 0.1) == 0
    with pytest.raises(ValueError, match="needs a step limit"):
        lr_factor(5, "linear", 0, None)
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'"):
        lr_factor(0, "step", 0, 10)


def test_the_trainer_follows_its_schedule(tiny_model):
    trainer = Trainer(tiny_model, TrainConfig(learning_rate=1e-2, max_grad_norm=1.0,
                                              lr_schedule="linear", warmup_steps=2, max_steps=6),
                      pad_id=0, temperature=1.0, total_steps=6)  # fmt: skip
    rates = []
    for _ in range(6):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.schedule.step()
    expected = [1e-2 * reference(step, "linear", 2, 6) for step in range(6)]
    assert rates == pytest.approx(expected, rel=1e-12)


def test_weight_decay_is_decoupled_and_spares_biases_and_norms(tiny_model):
    decay, learning_rate = 0.1, 0.01
    settings = TrainConfig(learning_rate=learning_rate, max_grad_norm=1.0, weight_decay=decay)
    trainer = Trainer(tiny_model, settings, pad_id=0, temperature=1.0)
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    matrices, vectors = trainer.optimizer.param_groups
    assert (matrices["weight_decay"], vectors["weight_decay"]) == (decay, 0.0)
    assert all(p.ndim >= 2 for p in matrices["params"])
    norms = {name for name, p in tiny_model.named_parameters() if "norm" in name}
    assert norms and all(p.ndim == 1 for name, p in tiny_model.named_parameters()
                         if name in norms)  # fmt: skip
    before = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    for p in tiny_model.parameters():  # no gradient: Adam moves nothing, only the decay acts
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    for name, p in tiny_model.named_parameters():
        shrink = 1 - learning_rate * decay if p.ndim >= 2 else 1.0
        assert torch.allclose(p, before[name] * shrink, rtol=0, atol=1e-7), name
    # Without decay: one group, as before.
    assert len(decay_groups(list(tiny_model.parameters()), 1e-3, 0.0)) == 1
