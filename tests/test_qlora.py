"""QLoRA (`quantization.bits`, TRL's `quantization_config`): a base quantized by bitsandbytes
trains its adapters with the gradient of its dequantized twin, even after sampling; saves a plain
policy; checkpoints its adapters; runs synchronously and asynchronously from a TRL script."""

from __future__ import annotations

import json
import math
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from tba import TBAConfig, TBATrainer
from tba.buffer import ReplayBuffer
from tba.checkpoint import latest_checkpoint, save_checkpoint
from tba.config import LoraConfig, QuantizationConfig, TrainConfig, load_config
from tba.core import Sample
from tba.errors import ConfigError
from tba.policy.logprobs import token_logprobs
from tba.policy.model import load_policy, policy_state_dict, save_policy
from tba.policy.quantization import check_quantization, packed_layers
from tba.run_dir import read_metrics
from tba.trainer import Trainer

pytest.importorskip("bitsandbytes")

SETTINGS = {
    "nf4, double": QuantizationConfig(bits=4, quant_type="nf4", double_quant=True),
    "fp4": QuantizationConfig(bits=4, quant_type="fp4"),
    "int8": QuantizationConfig(bits=8),
}


def quantized_policy(policy_dir: Path, quantization: QuantizationConfig):
    """The policy with LoRA on a quantized base, its adapters moved off their zero start."""
    model = load_policy(str(policy_dir), "cpu", lora=LoraConfig(r=4), quantization=quantization)
    generator = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def twin(model, policy_dir: Path, tmp_path: Path):
    """The same policy on full weights: the quantized base dequantized, the same adapters."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.zero_()
    base = policy_state_dict(model)  # zero adapters: the dequantized base
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.copy_(saved[name])
    full = AutoModelForCausalLM.from_pretrained(policy_dir)
    full.load_state_dict(base)
    full.save_pretrained(tmp_path / "dequantized")
    other = load_policy(str(tmp_path / "dequantized"), "cpu", lora=LoraConfig(r=4))
    params = dict(other.named_parameters())
    for name, param in model.named_parameters():
        if "lora_" in name:
            params[name].data.copy_(param.data)
    return other


def adapter_gradients(model, prompts, responses) -> dict[str, torch.Tensor]:
    model.train()
    tokens, mask = token_logprobs(model, prompts, responses, pad_id=0)[:2]
    (tokens * mask).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_adapters_on_a_quantized_base_get_its_dequantized_twins_gradient(
    tmp_path, policy_dir, name
):
    """After the policy has sampled (eval mode, no gradient: where bitsandbytes on a CPU would
    repack 4-bit weights for a kernel that passes no gradient back), the adapters' gradient is
    that of the same adapters on the dequantized weights (8 bits: within its int8 activations'
    rounding)."""
    model = quantized_policy(policy_dir, SETTINGS[name])
    assert len(packed_layers(model)) == 2 * 7  # every linear layer of both blocks, not the head
    model.eval()
    with torch.no_grad():
        model(torch.tensor([[1, 5]]))  # one decoding step, as a searcher makes
    prompts, responses = [[1, 5, 6, 7], [1, 8]], [[9, 10, 2], [11, 12, 13, 14]]
    got = adapter_gradients(model, prompts, responses)
    expected = adapter_gradients(twin(model, policy_dir, tmp_path), prompts, responses)
    assert got.keys() == expected.keys() and len(got) == 2 * 7 * 2
    tolerance = 0.05 if SETTINGS[name].bits == 8 else 1e-4
    for key, gradient in expected.items():
        error = (got[key] - gradient).norm() / gradient.norm()
        assert error < tolerance, (key, float(error))


def test_a_saved_qlora_policy_is_the_plain_model_its_weights_make(tmp_path, policy_dir):
    model = quantized_policy(policy_dir, SETTINGS["nf4, double"])
    save_policy(model, tmp_path / "final")
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert "quantization_config" not in config
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not getattr(plain, "is_quantized", False)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    model.train()  # bitsandbytes' dequantize-then-multiply path, the one training takes
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, model(ids).logits, atol=1e-5)
    # The adapters alone, for peft on the quantized base.
    assert (tmp_path / "final" / "adapter" / "adapter_config.json").is_file()


def test_a_qlora_trainer_checkpoints_its_adapters_and_resumes_exactly(tmp_path, policy_dir,
                                                                      tokenizer):  # fmt: skip
    prompt = tokenizer("Q\n")["input_ids"]
    group = [Sample(0, prompt, tokenizer(t, add_special_tokens=False)["input_ids"], reward=r,
                    ref_logp=-2.0, behaviour_logp=-2.0, version=0,
                    behaviour_token_logps=[-2.0 / len(t)] * len(t))
             for t, r in [("1", 1.0), ("22", 0.0)]]  # fmt: skip

    def trainer() -> Trainer:
        model = quantized_policy(policy_dir, SETTINGS["nf4, double"])
        return Trainer(model, TrainConfig(learning_rate=1e-2, max_grad_norm=1.0),
                       pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip

    first = trainer()
    first.step([group], beta=0.1)
    state = first.state_dict()
    assert state["model"] and all(".lora_" in key for key in state["model"])
    save_checkpoint(tmp_path, 1, {"trainer": state, "buffer": ReplayBuffer(1).state_dict()},
                    keep=1)  # fmt: skip - the two trainers then share no tensor
    second = trainer()
    second.load_state_dict(latest_checkpoint(tmp_path).state["trainer"])
    a, b = first.step([group], beta=0.1), second.step([group], beta=0.1)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert policy_state_dict(first.model).keys() == policy_state_dict(second.model).keys()
    for key, value in policy_state_dict(first.model).items():
        assert torch.equal(value, policy_state_dict(second.model)[key]), key


def test_a_quantized_base_needs_adapters_and_bitsandbytes(monkeypatch):
    with pytest.raises(ConfigError, match="quantization.bits=4 freezes the base weights"):
        check_quantization(load_config(None, ["quantization.bits=4"]))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="quantization.bits=8 needs bitsandbytes: pip install"):
        check_quantization(load_config(None, ["quantization.bits=8", "lora.r=8"]))
    with pytest.raises(ConfigError, match="the searchers' vllm engine takes full weights"):
        load_config(None, ["quantization.bits=4", "lora.r=8", "searchers.engine=vllm"])


# ------------------------------------------------------------------------------ a TRL script


# A lambda: Ray's searcher processes receive it by value (a test module is not importable there).
# Every completion of a call gets a reward of its own: the rewards of a group always differ, so
# every step has a gradient whatever was sampled (with equal rewards, TB's gradient at the base
# policy is exactly zero).
reward_distinct = lambda completions, **kwargs: [  # noqa: E731
    i / len(completions) for i in range(len(completions))
]


ROWS = [{"prompt": f"Q{i}\n"} for i in range(8)]
QLORA = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_use_double_quant=True)  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trls_qlora_recipe_trains_its_adapters(tmp_path, policy_dir, mode):
    """TRL's QLoRA shape: the model by name with a BitsAndBytesConfig in model_init_kwargs and a
    peft_config; the searchers (here a Ray process, asynchronously) load the quantized base too
    and receive only the adapters."""
    args = TBAConfig(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=8,
        model_init_kwargs={"quantization_config": QLORA},
        train={"mode": mode}, searchers={"count": 0 if mode == "sync" else 1, "num_cpus": 1},
        policy={"num_threads": 1}, task={"num_eval": 4},
    )  # fmt: skip
    trainer = TBATrainer(str(policy_dir), reward_distinct, args=args, train_dataset=ROWS,
                         peft_config=peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    assert trainer.args.quantization.bits == 4 and trainer.args.lora.r == 4
    result = trainer.train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)
    steps = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert all(r["grad_norm"] > 0 for r in steps)
    final = tmp_path / "run" / "final"
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    AutoModelForCausalLM.from_pretrained(final)  # a plain model


def test_a_model_loaded_quantized_is_loaded_alike_by_the_run(tmp_path, policy_dir):
    model = AutoModelForCausalLM.from_pretrained(
        policy_dir, quantization_config=QLORA, device_map={"": "cpu"})  # fmt: skip
    trainer = TBATrainer(model, reward_distinct, args=TBAConfig(output_dir=str(tmp_path / "run")),
                         train_dataset=ROWS, peft_config=peft.LoraConfig(r=4))  # fmt: skip
    assert trainer.args.policy.model == str(policy_dir)
    assert trainer.args.quantization.model_dump() == {"bits": 4, "quant_type": "nf4",
                                                      "double_quant": True}  # fmt: skip
