"""`train.optimizer` (torch's AdamW, bitsandbytes' 8-bit AdamW) and `train.master_weights`
(fp32 masters, or bf16 weights updated in place with Kahan compensation): each trains the tiny
policy, checkpoints and resumes bit for bit; compensation keeps updates below bf16's
resolution; TRL's `optim` names map; what cannot run is refused in one line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tba import TBAConfig
from tba.buffer import ReplayBuffer
from tba.checkpoint import check_compatible, latest_checkpoint, save_checkpoint
from tba.config import TrainConfig, load_config
from tba.core import Sample
from tba.errors import CheckpointError, ConfigError
from tba.policy.model import frozen_copy
from tba.policy.optimizers import build_optimizer, check_optimizer
from tba.policy.precision import CompensatedWeights, compensated_add
from tba.trainer import Trainer

bnb = pytest.importorskip("bitsandbytes")


def groups(tokenizer) -> list[list[Sample]]:
    prompt = tokenizer("Q\n")["input_ids"]
    return [[Sample(0, prompt, tokenizer(t, add_special_tokens=False)["input_ids"], reward=r,
                    ref_logp=-2.0, behaviour_logp=-2.0, version=0,
                    behaviour_token_logps=[-2.0 / len(t)] * len(t))
             for t, r in [("1", 1.0), ("22", 0.0), ("333", 0.5)]]]  # fmt: skip


def trainer(model, optimizer: str, master_weights: str, learning_rate: float = 1e-2,
            weight_decay: float = 0.01) -> Trainer:  # fmt: skip
    settings = TrainConfig(learning_rate=learning_rate, max_grad_norm=1.0, warmup_steps=2,
                           weight_decay=weight_decay, optimizer=optimizer,
                           master_weights=master_weights)  # fmt: skip
    return Trainer(model, settings, pad_id=0, temperature=1.0)


def policy(tiny_model, dtype: torch.dtype):
    return frozen_copy(tiny_model).to(dtype).requires_grad_(True)


# --------------------------------------------------------------- compensation, the function


def test_compensation_keeps_updates_far_below_bf16s_resolution():
    """Weight 1.0, 100 updates of -1e-4: bf16 rounds each away (its neighbours below 1 are 2^-8
    apart); compensated, the weight ends at 0.99, as in fp32."""
    plain = torch.ones(4, dtype=torch.bfloat16)
    weight, compensation = torch.ones(4, dtype=torch.bfloat16), torch.zeros_like(plain)
    exact = torch.ones(4, dtype=torch.float64)
    for _ in range(100):
        plain.add_(-1e-4)
        compensated_add(weight, compensation, -1e-4)
        exact.add_(-1e-4)
    assert torch.equal(plain, torch.ones(4, dtype=torch.bfloat16))
    # 0.99 to within 2% of the 0.01 moved: the compensation, in bf16, is itself rounded.
    held = weight.double() + compensation.double()
    assert torch.allclose(held, exact, atol=2e-4)
    assert torch.all(weight != 1.0) and torch.allclose(weight.double(), exact, atol=2**-8)


def test_compensation_tracks_fp32_masters_in_training(tiny_model, tokenizer):
    """Three AdamW steps at a learning rate of 1e-4 on the bf16 policy: its weights, held as
    weight + compensation, follow fp32 masters' to ~bf16 squared; the weights alone lose the
    steps below their resolution."""
    batch = groups(tokenizer)
    masters = trainer(policy(tiny_model, torch.bfloat16), "adamw", "fp32", 1e-4)
    inplace = trainer(policy(tiny_model, torch.bfloat16), "adamw", "none", 1e-4)
    for _ in range(3):
        masters.step(batch, beta=0.1)
        inplace.step(batch, beta=0.1)
    assert isinstance(inplace.masters, CompensatedWeights)
    start = torch.cat([p.detach().float().flatten() for p in tiny_model.parameters()])
    master = torch.cat([m.detach().flatten() for m in masters.masters.params])
    held = torch.cat([(p.float() + c.float()).flatten() for p, c in
                      zip(inplace.model.parameters(), inplace.masters.compensation)])  # fmt: skip
    moved = (master - start.bfloat16().float()).abs().max()
    assert moved > 1e-4  # the masters moved, mostly below bf16's resolution
    assert (held - master).abs().max() < 1e-3 * moved + 1e-6
    assert any(c.abs().max() > 0 for c in inplace.masters.compensation)
    # Adam's moments of a bf16 weight are fp32, created on its fp32 view.
    states = list(inplace.optimizer.state.values())
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)


# ------------------------------------------------------------- train, checkpoint, resume


@pytest.mark.parametrize(("optimizer", "master_weights", "dtype"), [
    ("adamw_8bit", "fp32", torch.float32),
    ("adamw_8bit", "fp32", torch.bfloat16),
    ("adamw", "none", torch.bfloat16),
    ("adamw_8bit", "none", torch.bfloat16),
])  # fmt: skip
def test_training_resumes_bit_for_bit(tmp_path, tiny_model, tokenizer, optimizer,
                                      master_weights, dtype):  # fmt: skip
    """Two steps, a checkpoint (safetensors and JSON) read back into a fresh trainer, then two
    more steps on each: the resumed one is the uninterrupted one, bit for bit."""
    batch = groups(tokenizer)
    first = trainer(policy(tiny_model, dtype), optimizer, master_weights)
    if optimizer == "adamw_8bit":
        assert isinstance(first.optimizer, bnb.optim.AdamW8bit)
    for _ in range(2):
        first.step(batch, beta=0.1)
    if optimizer == "adamw_8bit":  # some moments in 8 bits (tensors of 4096 values and more)
        held = [v for s in first.optimizer.state.values() for v in s.values()
                if torch.is_tensor(v)]  # fmt: skip
        assert any(v.dtype == torch.uint8 for v in held)
    state = {"trainer": first.state_dict(), "buffer": ReplayBuffer(1).state_dict()}
    if master_weights == "none" and dtype == torch.bfloat16:
        assert any(key.startswith("kahan.") for key in state["trainer"]["optimizer"])
    save_checkpoint(tmp_path, 2, state, keep=1)
    second = trainer(policy(tiny_model, dtype), optimizer, master_weights)
    second.load_state_dict(latest_checkpoint(tmp_path).state["trainer"])
    for _ in range(2):
        a, b = first.step(batch, beta=0.1), second.step(batch, beta=0.1)
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    for p, q in zip(first.model.parameters(), second.model.parameters()):
        assert p.dtype == dtype and torch.equal(p, q)
    for p, q in zip(first.masters.state_tensors().values(),
                    second.masters.state_tensors().values()):  # fmt: skip
        assert torch.equal(p, q)
    held = [[t.optimizer.state[p] for group in t.optimizer.param_groups for p in group["params"]]
            for t in (first, second)]  # fmt: skip
    for p, q in zip(*held):
        assert p.keys() == q.keys()
        for name, value in p.items():
            other = q[name]
            assert (torch.equal(value, other) and value.dtype == other.dtype
                    if torch.is_tensor(value) else value == other), name  # fmt: skip
    moved = [not torch.equal(p, q) for p, q in zip(first.model.parameters(),
                                                   policy(tiny_model, dtype).parameters())]
    assert any(moved)


def test_master_weights_none_on_an_fp32_policy_changes_nothing(tiny_model, tokenizer):
    batch = groups(tokenizer)
    a = trainer(policy(tiny_model, torch.float32), "adamw", "fp32")
    b = trainer(policy(tiny_model, torch.float32), "adamw", "none")
    assert all(c is None for c in b.masters.compensation)
    for _ in range(2):
        assert a.step(batch, beta=0.1)["loss"] == b.step(batch, beta=0.1)["loss"]
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


# -------------------------------------------------------------------- refusals and notices


def test_paged_on_a_cpu_is_the_unpaged_one_with_a_notice(capsys):
    param = torch.nn.Parameter(torch.zeros(8))
    optimizer = build_optimizer("paged_adamw_8bit", [{"params": [param], "lr": 1e-3}], "cpu")
    assert type(optimizer) is bnb.optim.AdamW8bit
    assert "paged_adamw_8bit pages its state in CUDA memory" in capsys.readouterr().err


def test_missing_bitsandbytes_is_one_line(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else found(name, *a))
    check_optimizer("adamw")
    with pytest.raises(ConfigError) as error:
        check_optimizer("adamw_8bit")
    message = str(error.value)
    assert "train.optimizer=adamw_8bit needs bitsandbytes" in message and "tba[qlora]" in message
    assert "\n" not in message


def test_eight_bit_adam_trains_on_one_rank():
    with pytest.raises(ConfigError, match="train.optimizer=adamw_8bit trains on one rank"):
        load_config(None, ["train.optimizer=adamw_8bit", "trainer.world_size=2",
                           "train.num_prompts=8"])  # fmt: skip


def test_a_checkpoint_resumes_only_with_its_optimizers_form():
    saved = load_config(None, []).model_dump()
    older = {**saved, "train": {k: v for k, v in saved["train"].items()
                                if k not in ("optimizer", "master_weights")}}  # fmt: skip
    check_compatible(older, saved, Path("ckpt"))  # runs before the settings: adamw, fp32
    eight = load_config(None, ["train.optimizer=adamw_8bit"]).model_dump()
    paged = load_config(None, ["train.optimizer=paged_adamw_8bit"]).model_dump()
    check_compatible(eight, paged, Path("ckpt"))  # the same state, paged or not
    with pytest.raises(CheckpointError, match=r"train.optimizer='adamw_8bit' \(this run: "
                                              r"'adamw'\)"):  # fmt: skip
        check_compatible(eight, saved, Path("ckpt"))
    bf16 = load_config(None, ["policy.dtype=bfloat16"]).model_dump()
    none = load_config(None, ["policy.dtype=bfloat16", "train.master_weights=none"]).model_dump()
    with pytest.raises(CheckpointError, match=r"train.master_weights='none' \(this run: 'fp32'"):
        check_compatible(none, bf16, Path("ckpt"))
    # fp32 weights have neither master copies nor compensations: the same state either way.
    check_compatible(saved, load_config(None, ["train.master_weights=none"]).model_dump(),
                     Path("ckpt"))  # fmt: skip


# ----------------------------------------------------------------------------------- TRL


@pytest.mark.parametrize(("optim", "expected"), [
    ("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw"), ("adamw_hf", "adamw"),
    ("adamw_8bit", "adamw_8bit"), ("adamw_bnb_8bit", "adamw_8bit"),
    ("paged_adamw_8bit", "paged_adamw_8bit"),
])  # fmt: skip
def test_trls_optim_names_map(optim, expected):
    assert TBAConfig(optim=optim).train.optimizer == expected


@pytest.mark.parametrize("optim", ["adafactor", "adamw_torch_4bit", "lion_8bit", "sgd"])
def test_other_trl_optimizers_are_refused_in_one_line(optim):
    with pytest.raises(ConfigError) as error:
        TBAConfig(optim=optim)
    message = str(error.value)
    assert message.startswith(f"optim='{optim}': tba's optimizers are AdamW")
    assert "\n" not in message
