"""The activation memory estimate (`tba.policy.activation_memory`) against what autograd keeps,
and `train.gradient_checkpointing=auto`'s decision on faked CUDA devices and in the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tba import trainer as trainer_module
from tba.config import TrainConfig
from tba.core import Sample
from tba.policy import logprobs as logprobs_module
from tba.policy.activation_memory import (
    GIB,
    MEMORY_SHARE,
    ModelShape,
    activation_bytes,
    checkpointing_choice,
    logits_bytes,
)
from tba.policy.logprobs import token_logprobs_and_states
from tba.policy.model import build_tiny_llama, is_checkpointing, load_policy
from tba.trainer import Trainer

# Qwen2.5-0.5B's shape (benchmarks/shapes.py), bf16: the GPU memory suite's model.
QWEN_05B = ModelShape(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2,
                      vocabulary=151936, dtype_bytes=2)  # fmt: skip


def saved_bytes(work) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass of `work()`."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        work()
    return sum(storages.values())


def decoder(arch: str, attention: str, dtype: torch.dtype):
    torch.manual_seed(0)
    shape = dict(vocab_size=300, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model_class, config_class = {"llama": (LlamaForCausalLM, LlamaConfig),
                                 "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[arch]  # fmt: skip
    model = model_class(config_class(**shape)).to(dtype).train()
    model.set_attn_implementation(attention)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_estimate_is_what_autograd_keeps(arch, attention, dtype, monkeypatch):
    """Rows of one length, each with its own prompt (as the estimate counts them): the formula
    within 10% of the bytes autograd saves (the log-probs' block of logits is made and freed
    within the pass, not kept)."""
    monkeypatch.setattr(logprobs_module, "shares_prompts", lambda model: False)
    model = decoder(arch, attention, dtype)
    rows, prompt, response = 12, 20, 44
    prompts = [[3 + row] * prompt for row in range(rows)]
    responses = [[5 + row % 7] * response for row in range(rows)]
    kept = saved_bytes(lambda: token_logprobs_and_states(model, prompts, responses, pad_id=0))
    shape = ModelShape.of(model)
    assert shape.dtype_bytes == dtype.itemsize and shape.eager == (attention == "eager")
    estimate = activation_bytes(shape, rows, prompt + response, checkpointing=False,
                                device_type="cpu") - logits_bytes(shape, rows * 64, "cpu")
    assert estimate == pytest.approx(kept, rel=0.1)


def test_checkpointing_keeps_each_layers_input_and_one_layer():
    without = activation_bytes(QWEN_05B, 64, 320, checkpointing=False)
    with_it = activation_bytes(QWEN_05B, 64, 320, checkpointing=True)
    logits = logits_bytes(QWEN_05B, 64 * 320)
    assert logits == 8 * 2**26  # one block on a GPU, and its gradient
    # The GPU suite's 0.5B micro-batch (4 groups of 16 rows of 64 + 256 tokens).
    assert 25 * GIB < without < 30 * GIB and 2 * GIB < with_it < 3 * GIB
    assert (with_it - logits) < (without - logits) / 10


# ------------------------------------------------------------------- the decision, faked


@dataclass
class FakeCuda:
    """A CUDA device with `free` bytes free; `asked`: the device each query named."""

    free: int = 0
    asked: list = field(default_factory=list)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.asked.append(device)
        return self.free, 141 * GIB


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    """A CUDA machine, as far as the decision looks."""
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", cuda.mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    return cuda


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), "auto"])
def test_auto_is_on_on_a_small_card_and_off_on_a_large_one(fake_cuda, device):
    """The 0.5B step's ~27 GiB of activations: on a card with 24 GiB free checkpointing goes on,
    with 139 GiB free it stays off; `cuda`, `cuda:0` and `auto` are the same device."""
    fake_cuda.free = 24 * GIB
    on, note = checkpointing_choice("auto", device, QWEN_05B, 64, 320)
    assert on and "more than 0.6 of the 24.0 GiB free on cuda:0" in note
    fake_cuda.free = 139 * GIB
    on, note = checkpointing_choice("auto", device, QWEN_05B, 64, 320)
    assert not on and "within 0.6 of the 139.0 GiB free on cuda:0" in note
    assert "20,480 token positions (64 rows x 320)" in note
    assert fake_cuda.asked == [torch.device("cuda", 0)] * 2


def test_the_share_decides_at_its_edge(fake_cuda):
    needed = activation_bytes(QWEN_05B, 64, 320, checkpointing=False)
    fake_cuda.free = int(needed / MEMORY_SHARE) + 1
    assert not checkpointing_choice("auto", "cuda:0", QWEN_05B, 64, 320)[0]
    fake_cuda.free = int(needed / MEMORY_SHARE) - 1
    assert checkpointing_choice("auto", "cuda:0", QWEN_05B, 64, 320)[0]


def test_what_auto_does_beside_one_gpu(fake_cuda):
    """Off on a CPU whatever it holds; on with several ranks on GPUs (every rank must run the
    same passes); a setting of true or false is what it says, on any device."""
    fake_cuda.free = 1000 * GIB
    on, note = checkpointing_choice("auto", "cpu", QWEN_05B, 64, 320)
    assert not on and note.endswith("on a cpu device")
    on, note = checkpointing_choice("auto", "cuda", QWEN_05B, 64, 320, ranks=2)
    assert on and "2 trainer ranks" in note
    assert checkpointing_choice(True, "cpu", QWEN_05B, 1, 1)[0]
    assert not checkpointing_choice(False, "cuda", QWEN_05B, 10**4, 10**4)[0]
    assert fake_cuda.asked == []  # none of these needed the device's memory


# ------------------------------------------------------------------------------ the trainer


def group(length: int) -> list[Sample]:
    return [Sample(0, [1, 4, 5], [6 + k] * length, reward=float(k), ref_logp=-9.0,
                   behaviour_logp=-9.0, version=0, behaviour_token_logps=[-1.0] * length)
            for k in range(3)]  # fmt: skip


def trainer(tokenizer, model, **settings) -> Trainer:
    return Trainer(model.train(), TrainConfig(learning_rate=1e-3, **settings),
                   pad_id=tokenizer.pad_token_id, temperature=1.0)  # fmt: skip


def test_auto_stays_off_on_a_cpu_and_says_why(tiny_model, tokenizer):
    auto = trainer(tokenizer, tiny_model)
    stats = auto.step([group(4)], beta=0.1)
    assert stats["checkpointing"] == 0.0 and not is_checkpointing(auto.model)
    assert auto.checkpointing_note.startswith("gradient checkpointing off "
                                              "(train.gradient_checkpointing=auto)")
    assert "21 token positions (3 rows x 7)" in auto.checkpointing_note


def test_policies_load_without_checkpointing_unless_it_is_true(policy_dir):
    assert not is_checkpointing(load_policy(str(policy_dir), "cpu", gradient_checkpointing="auto"))
    assert is_checkpointing(load_policy(str(policy_dir), "cpu", gradient_checkpointing=True))


def test_true_turns_it_on_in_a_trainer_whose_policy_was_loaded_without(tokenizer):
    model = build_tiny_llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, hidden_size=32,
                             num_layers=2, num_heads=2)  # fmt: skip
    on = trainer(tokenizer, model, gradient_checkpointing=True)
    assert on.step([group(4)], beta=0.1)["checkpointing"] == 1.0
    assert on.checkpointing_note.startswith("gradient checkpointing on "
                                            "(train.gradient_checkpointing=true)")


def test_a_longer_batch_later_turns_it_on_for_good(tiny_model, tokenizer, monkeypatch):
    """`auto` decides again at each step while off: a batch that would not fit turns it on, and
    it stays on."""
    asked = []

    def choice(setting, device, shape, rows, tokens, **kwargs):
        asked.append((rows, tokens))
        return rows * tokens > 30, f"decided for {rows} x {tokens}"

    monkeypatch.setattr(trainer_module, "checkpointing_choice", choice)
    auto = trainer(tokenizer, tiny_model)
    steps = [auto.step([group(length)], beta=0.1)["checkpointing"] for length in (4, 9, 2)]
    assert steps == [0.0, 1.0, 1.0] and asked == [(3, 7), (3, 12)]
    assert auto.checkpointing_note == "decided for 3 x 12"


def test_with_a_budget_the_estimate_is_of_the_budget(tiny_model, tokenizer, monkeypatch):
    asked = []
    monkeypatch.setattr(trainer_module, "checkpointing_choice",
                        lambda setting, device, shape, rows, tokens, **kwargs:
                        (asked.append((rows, tokens)), (False, "off"))[1])  # fmt: skip
    trainer(tokenizer, tiny_model, micro_batch_tokens=100).step([group(4)], beta=0.1)
    assert asked == [(15, 7)]  # rows as long as the longest (3 + 4) that hold the 100 tokens
