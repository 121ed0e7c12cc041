"""The log-probs used everywhere: searcher (reference log-probs), trainer, evaluation and SFT.

    log pi(y_t | x, y_<t) = log_softmax(logits_t / temperature)[y_t]      (token_logprobs)
    log pi(y | x)         = sum_t log pi(y_t | x, y_<t)                    (sequence_logprobs)

over every response token, EOS included, with no length normalisation.

The decoder's final hidden states go through the output layer in chunks
(`tba.policy.chunked_logprobs`): no tensor of (tokens x vocabulary) logits exists at any time,
which at a real vocabulary (150k tokens) is most of a step's memory. Only the real response tokens
are scored, not the padding. A model whose logits are more than a linear map of its last hidden
state (logit soft-capping or scaling), or whose output layer is sharded, wrapped or hooked, takes
the plain computation (`reference_token_logprobs`: full logits, then log_softmax), which the
tests also use as the reference.

A batch usually holds K responses per prompt, so each distinct prompt runs through the model once
and its KV cache is shared by all of its responses (gradients flow through the shared prompt).
Packed (`packed=True`, the trainer's choice under a token budget), each response instead runs
with its own prompt, end to end with other rows in rows as long as the longest, so that no
position is padding but the packed rows' tails; the results are laid out as the padded ones.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from tba.policy.batching import left_pad, pack_rows, right_pad, to_device, unique_prompts
from tba.policy.chunked_logprobs import linear_logprobs
from tba.policy.kv_cache import cache_keyword, returned_cache
from tba.policy.model import is_checkpointing, unwrapped

# Config fields of models whose logits are not `output_layer(last hidden state)` (Gemma 2's
# soft-capping, Cohere's and Granite's scaling): they take the plain computation.
RESCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) over the vocabulary, in fp32 at least (bf16 logits would
    round the log-probs); fp64 stays fp64, for exact tests."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits / temperature, dim=-1)


def gather_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log pi(token) under `logits` (..., V) at `temperature`, for every entry of `tokens` (...)."""
    return log_softmax(logits, temperature).gather(-1, tokens[..., None]).squeeze(-1)


def sequence_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Summed response log-probs, shape (len(prompts),), float32, differentiable."""
    token_logps, mask = token_logprobs(
        model, prompts, responses, pad_id=pad_id, temperature=temperature
    )
    return (token_logps * mask).sum(-1)


def token_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token response log-probs (N, T), right-padded with zeros, float32 at least,
    differentiable, and the 0/1 float mask (N, T) of real response tokens."""
    token_logps, mask, _ = token_logprobs_and_states(model, prompts, responses, pad_id=pad_id,
                                                      temperature=temperature)  # fmt: skip
    return token_logps, mask


def token_logprobs_and_states(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`, and the decoder's last hidden states they were computed from (N, T, H):
    what a value head on the policy reads (None where the plain computation ran). `packed`: the
    rows run packed (`packed_token_logprobs_and_states`), laid out as padded ones after."""
    if packed:
        return packed_token_logprobs_and_states(model, prompts, responses, pad_id=pad_id,
                                                temperature=temperature)  # fmt: skip
    head = output_layer(model)
    if head is None:
        token_logps, mask = reference_token_logprobs(model, prompts, responses, pad_id=pad_id,
                                                     temperature=temperature)  # fmt: skip
        return token_logps, mask, None
    hidden, response_ids, response_mask = response_hidden(
        model, prompts, responses, pad_id=pad_id, share_prompts=shares_prompts(model)
    )
    # The flat positions of the real tokens, from the lengths the host already knows.
    width = response_ids.size(1)
    real = to_device(torch.tensor([row * width + t for row, r in enumerate(responses)
                                   for t in range(len(r))]), hidden.device)  # fmt: skip
    logps = linear_logprobs(hidden.flatten(0, 1)[real], head.weight, head.bias,
                            response_ids.flatten()[real], temperature)  # fmt: skip
    token_logps = logps.new_zeros(response_ids.numel()).index_copy(0, real, logps)
    return token_logps.view_as(response_ids), response_mask.to(logps.dtype), hidden


def packed_token_logprobs_and_states(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`token_logprobs_and_states` from rows packed end to end (`tba.policy.batching.pack_rows`:
    each response runs with its own prompt, position ids restart at 0 for each row, no attention
    mask), for a model that keeps packed rows apart (`packs_rows`). Only real tokens and the
    packed rows' tails run; the results come back in the padded layout (N, T), zero past each
    response, the hidden states too."""
    if any(len(r) == 0 for r in responses):
        raise ValueError("every response needs at least one token")
    device = next(model.parameters()).device
    rows = pack_rows(prompts, responses, pad_id)
    response_ids, response_mask = right_pad(responses, pad_id, device)
    width = response_ids.size(1)
    real = to_device(torch.tensor([row * width + t for row, r in enumerate(responses)
                                   for t in range(len(r))]), device)  # fmt: skip
    predicting = to_device(rows.predicting, device)
    targets = response_ids.flatten()[real]
    head = output_layer(model)
    net = model if head is None else decoder(model)
    out = net(input_ids=to_device(rows.ids, device), attention_mask=None, use_cache=False,
              position_ids=to_device(rows.position_ids, device))  # fmt: skip
    states = None
    if head is None:
        logps = gather_logprobs(out.logits.flatten(0, 1)[predicting], targets, temperature)
    else:
        hidden = out.last_hidden_state.flatten(0, 1)[predicting]
        logps = linear_logprobs(hidden, head.weight, head.bias, targets, temperature)
        states = hidden.new_zeros(response_ids.numel(), hidden.size(-1)).index_copy(0, real, hidden)
        states = states.view(*response_ids.shape, hidden.size(-1))
    token_logps = logps.new_zeros(response_ids.numel()).index_copy(0, real, logps)
    return token_logps.view_as(response_ids), response_mask.to(logps.dtype), states


# Two rows for `packs_rows`: a first of 7 tokens and a second of 3, packed into one.
PROBE_FIRST, PROBE_SECOND = 7, 3


@torch.no_grad()
def packs_rows(model: PreTrainedModel) -> bool:
    """Whether `model` keeps rows packed into one (`pack_rows`) apart, as transformers 5 does
    for the models that build their attention mask from position ids given no mask (Llama,
    Qwen2, GPT-2 and most others, with sdpa and eager attention alike): three tiny forward
    passes, without gradients. The second row's states must not change when the first row's
    tokens do (without a mask that keeps the rows apart, they would), and must be those of the
    second row run alone, within the rounding of the model's dtype (a model that ignored the
    restarted positions would shift an absolute position embedding). Dropout, which would draw
    other masks in each pass, also answers no: padded rows are the safe side."""
    vocab = unwrapped(model).config.vocab_size
    first = [(5 + 3 * t) % vocab for t in range(PROBE_FIRST)]
    other = [(11 + 7 * t) % vocab for t in range(PROBE_FIRST)]
    second = [(2 + 5 * t) % vocab for t in range(PROBE_SECOND)]
    device = next(model.parameters()).device
    net = decoder(model) if output_layer(model) is not None else model

    def states(rows: list[list[int]]) -> torch.Tensor:
        positions = [t for row in rows for t in range(len(row))]
        out = net(input_ids=torch.tensor([sum(rows, [])], device=device), attention_mask=None,
                  position_ids=torch.tensor([positions], device=device), use_cache=False)
        result = out.last_hidden_state if net is not model else out.logits
        return result[0, -PROBE_SECOND:].float()

    packed, changed, alone = states([first, second]), states([other, second]), states([second])
    scale = alone.norm()
    return bool((packed - changed).norm() <= 1e-4 * scale
                and (packed - alone).norm() <= 0.1 * scale)


def next_token_logprobs(
    model: PreTrainedModel, ids: torch.Tensor, attention_mask: torch.Tensor, where: torch.Tensor
) -> torch.Tensor:
    """log pi(ids[i, t + 1] | ids[i, :t + 1]) at temperature 1 for every (i, t) where `where`
    (N, L - 1, on the host) is set, flat (M,): what supervised fine-tuning trains on."""
    device = next(model.parameters()).device
    ids, attention_mask = ids.to(device), attention_mask.to(device)
    picked = to_device(where.flatten().nonzero().squeeze(1), device)  # found on the host
    targets = ids[:, 1:].flatten()[picked]
    head = output_layer(model)
    if head is None:
        logits = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
        return gather_logprobs(logits[:, :-1].flatten(0, 1)[picked], targets)
    hidden = decoder(model)(input_ids=ids, attention_mask=attention_mask,
                            use_cache=False).last_hidden_state  # fmt: skip
    return linear_logprobs(hidden[:, :-1].flatten(0, 1)[picked], head.weight, head.bias, targets)


def reference_token_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` from the full (N, T, V) logits: the plain computation."""
    logits, response_ids, response_mask = response_logits(
        model, prompts, responses, pad_id=pad_id, share_prompts=shares_prompts(model)
    )
    token_logps = gather_logprobs(logits, response_ids, temperature)
    mask = response_mask.to(token_logps.dtype)
    return token_logps * mask, mask


def output_layer(model: PreTrainedModel) -> torch.nn.Linear | None:
    """The output layer, when the logits are exactly `output_layer(decoder's last hidden state)`
    and it is a plain, unsharded linear layer; None otherwise (see the module docstring)."""
    base = unwrapped(model)
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or isinstance(head.weight, DTensor):
        return None
    if head._forward_hooks or head._forward_pre_hooks:  # they change what it computes
        return None
    if any(getattr(base.config, name, None) for name in RESCALED_LOGITS):
        return None
    has_decoder = isinstance(getattr(base, base.base_model_prefix, None), torch.nn.Module)
    return head if has_decoder else None


def decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The model without its output layer: input ids to final hidden states (adapters, if any,
    stay active in it)."""
    base = unwrapped(model)
    return getattr(base, base.base_model_prefix)


def shares_prompts(model: PreTrainedModel) -> bool:
    """Checkpointed layers run without a KV cache (transformers drops it), so each response then
    runs with its own copy of its prompt."""
    return not (model.training and is_checkpointing(model))


def response_hidden(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder's final hidden states that predict each response token (N, T, H), the
    right-padded response ids (N, T) and the 0/1 mask of real response tokens (N, T), laid out
    as in `response_logits`."""
    return _predicting_states(decoder(model), lambda out: out.last_hidden_state, model, prompts,
                              responses, pad_id, share_prompts)  # fmt: skip


def response_logits(
    model: PreTrainedModel,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    pad_id: int,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits that predict each response token (N, T, V), the right-padded response ids
    (N, T) and the 0/1 mask of real response tokens (N, T). Prompts are left-padded and
    responses right-padded, so that every response starts in the same column. `share_prompts`:
    each distinct prompt runs once and its KV cache serves all of its responses; otherwise each
    response runs with its prompt in front."""
    return _predicting_states(model, lambda out: out.logits, model, prompts, responses, pad_id,
                              share_prompts)  # fmt: skip


def _predicting_states(net, read, model, prompts, responses, pad_id, share_prompts):
    """`read(net(...))` at the positions that predict each response token (N, T, ...), the
    right-padded response ids and their 0/1 mask. Shared prompts: every distinct prompt runs once
    and its KV cache is copied to each of its responses."""
    if any(len(r) == 0 for r in responses):
        raise ValueError("every response needs at least one token")
    device = next(model.parameters()).device
    distinct, rows = unique_prompts(prompts)
    prompt_ids, prompt_mask, prompt_positions = left_pad(distinct, pad_id, device)
    index = to_device(torch.tensor(rows), device)  # the prompt of each response
    response_ids, response_mask = right_pad(responses, pad_id, device)
    if not share_prompts:
        ids = torch.cat([prompt_ids[index], response_ids], dim=1)
        mask = torch.cat([prompt_mask[index], response_mask], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        states = read(net(input_ids=ids, attention_mask=mask, position_ids=positions,
                          use_cache=False))  # fmt: skip
        # The last prompt column predicts the first response token, and so on.
        start = prompt_ids.size(1) - 1
        return states[:, start : start + response_ids.size(1)], response_ids, response_mask
    prompt_out = net(input_ids=prompt_ids, attention_mask=prompt_mask,
                     position_ids=prompt_positions, use_cache=True)  # fmt: skip
    cache = returned_cache(prompt_out)
    cache.batch_select_indices(index)  # each response gets its prompt's keys and values
    offsets = torch.arange(response_ids.size(1), device=device)
    response_out = net(
        input_ids=response_ids,
        attention_mask=torch.cat([prompt_mask[index], response_mask], dim=1),
        position_ids=prompt_positions[index, -1:] + 1 + offsets,
        use_cache=True,
        **{cache_keyword(net): cache},
    )
    # The prompt's last position predicts the first response token; each response position the
    # next.
    last_prompt = read(prompt_out)[index, -1:]
    return torch.cat([last_prompt, read(response_out)[:, :-1]], dim=1), response_ids, response_mask
