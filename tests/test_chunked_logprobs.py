"""Log-probs through the output layer in chunks (`tba.policy.chunked_logprobs`) and the
`token_logprobs` built on them, against the plain full-logits computation in float64."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tba.config import TrainConfig
from tba.core import Sample
from tba.policy import chunked_logprobs
from tba.policy.chunked_logprobs import linear_logprobs
from tba.policy.logprobs import (
    next_token_logprobs,
    output_layer,
    reference_token_logprobs,
    token_logprobs,
)
from tba.policy.model import disable_dropout, enable_checkpointing
from tba.trainer import Trainer

VOCAB = 103  # not a multiple of the chunks below

PROMPTS = [[1, 2, 3], [1, 2, 3], [4, 5], [6, 7, 8, 9], [4, 5]]  # repeated prompts, ragged
RESPONSES = [[10, 11, 12], [13], [14, 15, 16, 17, 18], [19, 20], [21, 22, 23, 24]]


def reference(hidden, weight, bias, targets, temperature):
    logits = hidden @ weight.T + (0 if bias is None else bias)
    log_probs = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_probs.gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunks", [(4, 10), (5, 103), (64, 7)])
def test_values_and_gradients_equal_the_full_computation(with_bias, chunks):
    """Any chunking: the same values and the same gradients in hidden, weight and bias under a
    non-uniform upstream gradient (as TB's squared loss gives), at a temperature != 1."""
    torch.manual_seed(0)
    hidden = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(VOCAB, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(VOCAB, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, VOCAB, (13,))
    upstream = torch.randn(13, dtype=torch.float64)
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    want = reference(hidden, weight, bias, targets, 0.7)
    got = linear_logprobs(hidden, weight, bias, targets, 0.7, chunk_tokens=chunks[0],
                          chunk_vocab=chunks[1])  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(torch.autograd.grad((got * upstream).sum(), inputs),
                    torch.autograd.grad((want * upstream).sum(), inputs)):  # fmt: skip
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_gradcheck():
    torch.manual_seed(1)
    hidden = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 10, 3, 3, 7, 5])
    assert torch.autograd.gradcheck(
        lambda h, w, b: linear_logprobs(h, w, b, targets, 1.3, chunk_tokens=4, chunk_vocab=3),
        (hidden, weight, bias),
    )


def test_bf16_inputs_give_fp32_log_probs_of_the_bf16_logits():
    """The logits are made in bf16 as the model's own output layer would; the log-sum-exp is in
    fp32, within 1e-5 of an fp32 log_softmax of the same bf16 logits."""
    torch.manual_seed(2)
    hidden = torch.randn(40, 16).bfloat16()
    weight = torch.randn(VOCAB, 16).bfloat16()
    targets = torch.randint(0, VOCAB, (40,))
    got = linear_logprobs(hidden, weight, None, targets, 0.9, chunk_tokens=16, chunk_vocab=32)
    want = torch.log_softmax((hidden @ weight.T).float() / 0.9, -1).gather(1, targets[:, None])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.squeeze(1), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- whole models


def llama(tied: bool = True):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=tied)  # fmt: skip
    return LlamaForCausalLM(config)


def qwen2():
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ))  # fmt: skip


def gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4))


def lora(model):
    config = PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                            init_lora_weights=False)  # nonzero adapters: they must count
    return get_peft_model(model, config)


MODELS = {
    "llama-tied": llama, "llama-untied": lambda: llama(tied=False), "qwen2-tied": qwen2,
    "gpt2": gpt2, "llama-lora": lambda: lora(llama()),
}  # fmt: skip


def squared_loss_gradients(model, logps, mask):
    """TB-shaped: a squared function of each sequence's log-prob, so each token's upstream
    gradient differs by row."""
    sequence = (logps * mask).sum(-1)
    loss = ((sequence - torch.arange(len(sequence), dtype=sequence.dtype)) ** 2).mean()
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_token_logprobs_equal_the_full_logits_computation(name, checkpointing):
    """Tied and untied output layers, LoRA, padded rows, repeated prompts, temperature != 1;
    with checkpointed layers each response runs with its own prompt."""
    torch.manual_seed(0)
    model = MODELS[name]().double().train()
    disable_dropout(model)  # GPT-2's, which would draw other masks in each computation
    if checkpointing:
        enable_checkpointing(model)
    assert output_layer(model) is not None  # the chunked path is taken
    got, mask = token_logprobs(model, PROMPTS, RESPONSES, pad_id=0, temperature=0.8)
    want, want_mask = reference_token_logprobs(model, PROMPTS, RESPONSES, pad_id=0,
                                               temperature=0.8)  # fmt: skip
    assert torch.equal(mask, want_mask)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert bool((got[mask == 0] == 0).all())  # padding stays 0
    for g, w in zip(squared_loss_gradients(model, got, mask),
                    squared_loss_gradients(model, want, want_mask)):  # fmt: skip
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_a_hooked_or_rescaled_output_layer_takes_the_full_computation():
    model = llama()
    model.lm_head.register_forward_hook(lambda module, inputs, output: output * 2)
    assert output_layer(model) is None
    rescaled = llama()
    rescaled.config.final_logit_softcapping = 30.0
    assert output_layer(rescaled) is None


def test_next_token_logprobs_for_sft_equal_the_full_logits():
    torch.manual_seed(3)
    model = llama().double()
    ids = torch.randint(1, VOCAB, (3, 7))
    attention = torch.ones_like(ids)
    attention[2, 5:] = 0
    where = torch.zeros(3, 6, dtype=torch.bool)
    where[0, 2:], where[1, 4:], where[2, 1:4] = True, True, True
    got = next_token_logprobs(model, ids, attention, where)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[where]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------- memory of a step


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation makes, forward and backward alike."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_tensor_of_tokens_times_vocabulary_in_a_train_step(monkeypatch):
    """A TB step on N responses of T tokens makes no tensor of N x T x V elements (the
    full-logits computation makes several)."""
    monkeypatch.setitem(chunked_logprobs.BLOCK_ELEMENTS, "cpu", 8 * 32)  # blocks of 8 x 32
    torch.manual_seed(0)
    model = llama()
    trainer = Trainer(model, TrainConfig(learning_rate=1e-3, max_grad_norm=1.0), pad_id=0,
                      temperature=1.0)  # fmt: skip
    group = [Sample(prompt_id=0, prompt_ids=[1, 2, 3], response_ids=list(range(10, 22)),
                    reward=float(k), ref_logp=-30.0, behaviour_logp=-30.0, version=0,
                    behaviour_token_logps=[-2.5] * 12)
             for k in range(4)]  # fmt: skip
    full = 4 * 12 * VOCAB
    with LargestTensor() as seen:
        trainer.step([group], beta=0.1)
    assert seen.largest < full
    with LargestTensor() as seen:  # what the test would catch
        logits, _ = reference_token_logprobs(model, [g.prompt_ids for g in group],
                                             [g.response_ids for g in group], pad_id=0)
    assert seen.largest >= full
