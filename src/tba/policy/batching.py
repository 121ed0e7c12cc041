"""Turning lists of token ids into padded or packed tensors, and counting the positions each
layout makes a forward pass run.

They are built on the host and copied to the device without waiting for it (pinned memory, a
non-blocking copy): the host can queue the next kernels while the GPU still works on the last.

Padded: prompts left-padded and responses right-padded to the longest of the batch. Packed
(`pack_rows`): each row, prompt then response, laid end to end with others in rows as long as
the longest, with position ids that restart at 0 where each one starts; a model that builds its
attention mask from those position ids (transformers does, given no attention mask) keeps them
apart, and no position is padding but the tails of the packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device):
    """(input_ids, attention_mask, position_ids) for left-padded sequences."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq)
        mask[row, width - len(seq) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return to_device(ids, device), to_device(mask, device), to_device(positions, device)


def unique_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts, and for every row the index of its prompt among them."""
    index_of: dict[tuple[int, ...], int] = {}
    rows = [index_of.setdefault(tuple(p), len(index_of)) for p in prompts]
    return [list(p) for p in index_of], rows


def right_pad(sequences: list[list[int]], pad_id: int, device: torch.device):
    """(ids, mask) of right-padded sequences."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return to_device(ids, device), to_device(mask, device)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the host) on `device`, without a host synchronisation on CUDA."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class PackedRows:
    """Rows (prompt + response) packed into fewer, fuller ones, on the host: `ids` (B, W) and
    `position_ids` (B, W), the positions restarting at 0 where each packed row starts (the
    unfilled tail of a packed row, `pad_id`s, is a sequence of its own), and `predicting`: for
    every response token, row by row, its flat position in (B, W) of the state that predicts it
    (the one before it)."""

    ids: torch.Tensor
    position_ids: torch.Tensor
    predicting: torch.Tensor

    @property
    def positions(self) -> int:
        """Token positions the forward pass runs: every packed row, its tail included."""
        return self.ids.numel()


def pack_rows(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> PackedRows:
    """Each prompt + response as one row, packed first-fit by decreasing length into rows as
    long as the longest (`first_fit_decreasing`)."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    bins = first_fit_decreasing(lengths)
    width = max(lengths)
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(bins), width), dtype=torch.long)
    start = [0] * len(lengths)  # each row's flat offset in (B, W)
    for index, members in enumerate(bins):
        offset = 0
        for row in members:
            ids[index, offset : offset + lengths[row]] = torch.tensor(prompts[row] + responses[row])
            positions[index, offset : offset + lengths[row]] = torch.arange(lengths[row])
            start[row] = index * width + offset
            offset += lengths[row]
        positions[index, offset:] = torch.arange(width - offset)
    # The last prompt token predicts the first response token, and so on.
    predicting = [start[row] + len(prompts[row]) - 1 + t
                  for row in range(len(lengths)) for t in range(len(responses[row]))]  # fmt: skip
    return PackedRows(ids, positions, torch.tensor(predicting, dtype=torch.long))


def first_fit_decreasing(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` in bins as long as the longest: each, longest first, into the first
    bin with room for it (close to the fewest bins: never more than 11/9 of them, plus one)."""
    width = max(lengths)
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        target = next((b for b, free in enumerate(room) if free >= lengths[row]), len(bins))
        if target == len(bins):
            bins.append([])
            room.append(width)
        bins[target].append(row)
        room[target] -= lengths[row]
    return bins


def packed_positions(prompts: list[list[int]], responses: list[list[int]]) -> int:
    """Token positions `pack_rows` makes the forward pass run (without building the rows)."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    return len(first_fit_decreasing(lengths)) * max(lengths)


def padded_positions(prompts: list[list[int]], responses: list[list[int]],
                     share_prompts: bool) -> int:  # fmt: skip
    """Token positions the padded layout makes the forward pass run: each distinct prompt once,
    left-padded to the longest, then every response right-padded to the longest; or (prompts
    not shared) every row as its prompt and response, padded so."""
    longest_response = max(len(r) for r in responses)
    if not share_prompts:
        return len(prompts) * (max(len(p) for p in prompts) + longest_response)
    distinct, _ = unique_prompts(prompts)
    return len(distinct) * max(len(p) for p in distinct) + len(responses) * longest_response


def real_positions(prompts: list[list[int]], responses: list[list[int]],
                   share_prompts: bool) -> int:  # fmt: skip
    """The token positions of `padded_positions` or `packed_positions` that hold a real token:
    every response's, and each distinct prompt's once where prompts are shared, else every
    row's."""
    shown = unique_prompts(prompts)[0] if share_prompts else prompts
    return sum(len(p) for p in shown) + sum(len(r) for r in responses)
