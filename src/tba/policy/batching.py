"""Turning lists of token ids into padded tensors."""

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
    return ids.to(device), mask.to(device), positions.to(device)


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
    return ids.to(device), mask.to(device)
