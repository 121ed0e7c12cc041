"""Turning lists of token ids into padded tensors.

They are built on the host and copied to the device without waiting for it (pinned memory, a
non-blocking copy): the host can queue the next kernels while the GPU still works on the last.
"""

from __future__ import annotations

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
