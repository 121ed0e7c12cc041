"""The activation memory of a train step, from the model's shape and the micro-batch, and whether
`train.gradient_checkpointing=auto` turns gradient checkpointing on.

For a decoder of L layers of width h, MLP width f and a attention heads of which g carry keys
and values (head width d = h / a, kv = g d), its activations in a dtype of e bytes (2 for bf16,
4 for fp32), and a micro-batch of n = rows x tokens positions, the autograd graph of a train
step keeps per layer and position (counted with `torch.autograd.graph.saved_tensors_hooks` on
Llama and Qwen2, `tests/test_activation_memory.py`):

    layer   = 8 h + e (7 h + 2 kv + 4 f) + 4 a                                  bytes
              each RMS norm: its input in fp32 and its output in the weights'
              dtype (4 h + e h, twice); attention: its input, q, k, v, its output
              and the output projection's input (e (4 h + 2 kv)), the log-sum-exp
              of each head (4 a); the MLP: its input, the gate, its activation,
              the up projection and their product (e (h + 4 f))
    eager   = a tokens (4 + e)            eager attention only: each row's softmax of its
                                          scores, in fp32 and in the weights' dtype
    outside = 4 h + 2 e h + 8 d           the final norm, the states the output layer reads,
                                          the rotary angles
    logits  = 8 min(n, C / c) c           one block of logits and its gradient at a time
                                          (`tba.policy.chunked_logprobs`: C elements a block,
                                          c = min(V, its vocabulary chunk) for vocabulary V)

    without checkpointing:  n (L (layer + eager) + outside) + logits
    with checkpointing:     n (L e h + layer + eager + outside) + logits
                            (each layer keeps only its input; the backward pass recomputes
                            one layer at a time)

It counts every row as long as the micro-batch's longest prompt plus its longest response, so it
overstates a padded batch whose responses share their prompt's KV cache (the GPU suite's 0.5B
step without checkpointing: 33.3 GiB estimated with the weights, gradients and optimizer state,
29.1 measured; docs/results/memory.md). Models whose linear layers are frozen (LoRA) keep less:
the inputs of frozen layers are not kept. Gradients, the optimizer's state and the weights are
not activations: they are counted apart (`benchmarks.memory`).

`checkpointing_choice` reads `auto`: on a CUDA device, checkpointing goes on only where the
activations without it would not fit `MEMORY_SHARE` (0.6) of the memory free on the device
(`torch.cuda.mem_get_info`, plus what torch's allocator holds unused); the rest is for what the
step allocates besides (gradients, the optimizer's state at the first step) and fragmentation.
On a CPU it stays off (host memory is rarely the limit, and the recomputation costs a third of
the step); with several trainer ranks it is on on a GPU, as before, so that every rank runs the
same passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from tba.policy.chunked_logprobs import BLOCK_ELEMENTS, BLOCK_VOCAB
from tba.policy.model import resolve_device, unwrapped

MEMORY_SHARE = 0.6  # of the device's free memory that a step's activations may take
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the activation memory of a decoder depends on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocabulary: int
    dtype_bytes: int  # of the activations: the input embeddings' dtype
    eager: bool = False  # eager attention, which keeps each row's scores

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelShape:
        """The shape of `model` (a Hugging Face causal LM, with or without adapters); its
        activations' dtype is its input embeddings' (never quantized)."""
        base = unwrapped(model)
        return cls.of_config(base.config, base.get_input_embeddings().weight.element_size())

    @classmethod
    def of_config(cls, config: PreTrainedConfig, dtype_bytes: int) -> ModelShape:
        """The shape of a model of `config` whose activations take `dtype_bytes` each (GPT-2's
        names are mapped by transformers; its MLP is 4 h wide)."""
        hidden, heads = config.hidden_size, config.num_attention_heads
        intermediate = (getattr(config, "intermediate_size", None)
                        or getattr(config, "n_inner", None) or 4 * hidden)  # fmt: skip
        return cls(
            layers=config.num_hidden_layers, hidden=hidden, intermediate=intermediate,
            heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            vocabulary=config.vocab_size, dtype_bytes=dtype_bytes,
            eager=getattr(config, "_attn_implementation", None) == "eager",
        )  # fmt: skip


def activation_bytes(
    shape: ModelShape, rows: int, tokens: int, *, checkpointing: bool, device_type: str = "cuda"
) -> int:
    """The activation memory of a train step on `rows` rows of `tokens` positions each (the
    module docstring's formula), in bytes; `device_type` sets the size of the log-probs' blocks
    of logits ("cuda" or "cpu")."""
    h, f, a, e = shape.hidden, shape.intermediate, shape.heads, shape.dtype_bytes
    kv = shape.kv_heads * (h // a)
    layer = 8 * h + e * (7 * h + 2 * kv + 4 * f) + 4 * a
    if shape.eager:
        layer += a * tokens * (4 + e)
    outside = 4 * h + 2 * e * h + 8 * (h // a)
    positions = rows * tokens
    kept = shape.layers * (e * h if checkpointing else layer) + (layer if checkpointing else 0)
    return positions * (kept + outside) + logits_bytes(shape, positions, device_type)


def logits_bytes(shape: ModelShape, positions: int, device_type: str = "cuda") -> int:
    """The log-probs' block of logits and its gradient (fp32), for `positions` tokens at most
    (`tba.policy.chunked_logprobs`' block sizes on `device_type`)."""
    kind = "cuda" if device_type == "cuda" else "cpu"
    chunk_vocab = min(shape.vocabulary, BLOCK_VOCAB[kind])
    return 8 * min(positions, max(1, BLOCK_ELEMENTS[kind] // chunk_vocab)) * chunk_vocab


def available_bytes(device: torch.device | str) -> int:
    """Memory this process can still have on a CUDA `device` (`cuda` is `cuda:<current>`): what
    the device has free, and what torch's allocator holds without a tensor in it."""
    target = resolve_device(device)
    free, _ = torch.cuda.mem_get_info(target)
    return free + torch.cuda.memory_reserved(target) - torch.cuda.memory_allocated(target)


def checkpointing_choice(
    setting: bool | str, device: torch.device | str, shape: ModelShape, rows: int, tokens: int,
    *, ranks: int = 1, share: float = MEMORY_SHARE,
) -> tuple[bool, str]:  # fmt: skip
    """Whether a step on micro-batches of `rows` x `tokens` on `device` recomputes its
    activations, as `train.gradient_checkpointing` (`setting`) says, and why, as one line:
    `auto` is on only on a CUDA device whose free memory (`available_bytes`) the activations
    without it would not fit `share` of, or with several trainer `ranks` on a GPU."""
    target = resolve_device(device)
    without = activation_bytes(shape, rows, tokens, checkpointing=False,
                               device_type=target.type)  # fmt: skip
    extent = (f"micro-batches of {rows * tokens:,} token positions ({rows} rows x {tokens}) "
              f"take ~{without / GIB:.1f} GiB of activations without it")  # fmt: skip
    if setting != "auto":
        on = bool(setting)
        return on, (f"gradient checkpointing {'on' if on else 'off'} "
                    f"(train.gradient_checkpointing={str(on).lower()}); {extent}")  # fmt: skip
    head = "gradient checkpointing {} (train.gradient_checkpointing=auto): "
    if target.type != "cuda":
        return False, head.format("off") + f"{extent}, on a {target.type} device"
    if ranks > 1:
        return True, head.format("on") + f"{ranks} trainer ranks on GPUs recompute alike"
    free = available_bytes(target)
    on = without > share * free
    within = "more than" if on else "within"
    return on, head.format("on" if on else "off") + (
        f"{extent}, {within} {share:g} of the {free / GIB:.1f} GiB free on {target}")


def rows_for(positions: int, tokens: int) -> int:
    """Rows of `tokens` positions that hold `positions` (a token budget as rows x tokens)."""
    return math.ceil(positions / tokens)
