"""Log-probs of sampled tokens through the output layer without the (tokens x vocabulary) logits.

For hidden states h_i (M, H), an output layer (W (V, H), b (V)), targets y_i and a temperature T:

    z_i   = (W h_i + b) / T                          one row of logits, scaled per token
    lse_i = log sum_v exp(z_iv)                      an online log-sum-exp over vocabulary chunks
    out_i = z_i[y_i] - lse_i                         = log_softmax(z_i)[y_i]

The forward pass runs the tokens in chunks of `chunk_tokens` and the vocabulary in chunks of
`chunk_vocab`, so the largest tensor it makes is one (chunk_tokens, chunk_vocab) block of logits;
it keeps only lse (M,) for the backward. The backward recomputes each block:

    d out_i / d z_iv = [v = y_i] - softmax(z_i)_v = [v = y_i] - exp(z_iv - lse_i)
    grad z  = g_i * ([v = y_i] - p_iv)               g: the upstream gradient, one per token
    grad logits = grad z / T
    grad h_i += grad logits_i @ W_c,   grad W_c += grad logits_c^T @ h,   grad b_c += sum_i

so any upstream gradient (not only a uniform one, which TB's squared loss is not) is exact. The
logits are computed in the weights' dtype, as the model's own output layer would (bf16 stays
bf16), and everything after in fp32 at least (fp64 stays fp64). Chunk sizes come from shapes the
host knows: nothing inside waits for the device.
"""

from __future__ import annotations

import torch

# One block of logits, (tokens x vocabulary) elements: on a GPU large enough that the kernels
# are few and busy (256 MiB in fp32); on a CPU small enough (16 MiB) that the allocator reuses
# the same memory for every block instead of mapping fresh pages.
BLOCK_ELEMENTS = {"cuda": 2**26, "cpu": 2**22}
BLOCK_VOCAB = {"cuda": 2**16, "cpu": 2**13}


class _SampledLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens, chunk_vocab):
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        count, vocab = hidden.size(0), weight.size(0)
        lse = torch.empty(count, dtype=accumulate, device=hidden.device)
        target_z = torch.empty(count, dtype=accumulate, device=hidden.device)
        for first in range(0, count, chunk_tokens):
            rows = slice(first, first + chunk_tokens)
            running, picked = None, None
            for start in range(0, vocab, chunk_vocab):
                z = _scaled_logits(hidden[rows], weight, bias, start, chunk_vocab, temperature)
                local, inside = _local_targets(targets[rows], start, z.size(1))
                value = z.gather(1, local[:, None]).squeeze(1)
                picked = torch.where(inside, value, value if picked is None else picked)
                block_lse = _logsumexp_(z)
                running = block_lse if running is None else torch.logaddexp(running, block_lse)
            lse[rows], target_z[rows] = running, picked
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.settings = temperature, chunk_tokens, chunk_vocab
        return target_z - lse

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk_tokens, chunk_vocab = ctx.settings
        accumulate = lse.dtype
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros(hidden.shape, dtype=accumulate, device=hidden.device)
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        scale = grad_out.to(accumulate) / temperature  # g / T, one per token
        # Vocabulary chunks outside: each chunk of dW is summed in fp32 over every token and
        # written once, so no weight-sized fp32 buffer is needed.
        for start in range(0, weight.size(0), chunk_vocab):
            columns = slice(start, start + chunk_vocab)
            weight_block = torch.zeros(weight[columns].shape, dtype=accumulate,
                                       device=weight.device) if need_weight else None  # fmt: skip
            for first in range(0, hidden.size(0), chunk_tokens):
                rows = slice(first, first + chunk_tokens)
                z = _scaled_logits(hidden[rows], weight, bias, start, chunk_vocab, temperature)
                # grad logits = (g / T) * ([v = y] - softmax(z)), in place over the block.
                grad = z.sub_(lse[rows, None]).exp_().mul_(-scale[rows, None])
                local, inside = _local_targets(targets[rows], start, z.size(1))
                grad.scatter_add_(1, local[:, None], torch.where(inside, scale[rows], 0)[:, None])
                grad = grad.to(weight.dtype)
                if need_hidden:
                    grad_hidden[rows] += grad @ weight[columns]
                if need_weight:
                    weight_block += grad.T @ hidden[rows]
                if need_bias:
                    grad_bias[columns] += grad.sum(0).to(bias.dtype)
            if need_weight:
                grad_weight[columns] = weight_block.to(weight.dtype)
        grad_hidden = grad_hidden.to(hidden.dtype) if need_hidden else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _scaled_logits(hidden, weight, bias, start, width, temperature):
    """One block of logits, vocabulary columns [start, start + width), divided by the
    temperature, in fp32 at least (a new tensor: the callers work in place on it)."""
    columns = slice(start, start + width)
    if bias is None:
        logits = hidden @ weight[columns].T
    else:
        logits = torch.addmm(bias[columns], hidden, weight[columns].T)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1.0 else logits.mul_(1.0 / temperature)


def _logsumexp_(z):
    """log sum exp over the last dimension, overwriting `z` (no temporary of its size)."""
    top = z.amax(dim=-1, keepdim=True)
    return top.squeeze(-1) + z.sub_(top).exp_().sum(dim=-1).log()


def _local_targets(targets, start, width):
    """Each target's column inside the block [start, start + width) (clamped), and whether it
    is inside."""
    local = targets - start
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), inside


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> torch.Tensor:
    """log_softmax((hidden @ weight.T + bias) / temperature)[targets] for hidden (..., H) and
    targets (...), shape (...), in fp32 at least, differentiable in hidden, weight and bias.
    The chunks default to blocks of `BLOCK_VOCAB` columns and `BLOCK_ELEMENTS` elements for the
    device."""
    kind = "cuda" if hidden.device.type == "cuda" else "cpu"
    chunk_vocab = max(1, min(chunk_vocab or BLOCK_VOCAB[kind], weight.size(0)))
    chunk_tokens = chunk_tokens or max(1, BLOCK_ELEMENTS[kind] // chunk_vocab)
    flat_hidden = hidden.reshape(-1, hidden.size(-1))
    flat = _SampledLogProbs.apply(flat_hidden, weight, bias, targets.reshape(-1), temperature,
                                  chunk_tokens, chunk_vocab)  # fmt: skip
    return flat.reshape(targets.shape)
