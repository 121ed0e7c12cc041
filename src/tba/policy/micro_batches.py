"""A batch's samples as the trainer's micro-batches, and as the tensors of one.

- `micro_batch_runs`: the micro-batches of a batch as runs of whole groups (a group's log Z or
  baseline needs all of it), at most so many groups and so many prompt and response tokens.
- `ForwardPositions`: the positions the policy's forward passes ran in a step, and how many
  held a real token (`padded_frac`).
- `padded_rows`, `stack_padded`: each sample's per-token values as right-padded (N, T) rows,
  like the policy's token log-probs; two such tensors as one.
- `distinct_context`: the samples that join a micro-batch's groups' statistics only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tba.core import Sample
from tba.policy.batching import packed_positions, padded_positions, real_positions


def micro_batch_runs(groups: list[list[Sample]], chunk: int | None,
                     token_budget: int | None = None) -> list[slice]:  # fmt: skip
    """The batch's micro-batches as consecutive runs of whole groups: at most `chunk` groups
    (None: any number), and at most `token_budget` prompt and response tokens (None: any
    number); a group over the budget alone is a micro-batch of its own."""
    runs, first, tokens = [], 0, 0
    for index, group in enumerate(groups):
        size = sum(len(s.prompt_ids) + len(s.response_ids) for s in group)
        full = chunk is not None and index - first == chunk
        over = token_budget is not None and index > first and tokens + size > token_budget
        if full or over:
            runs.append(slice(first, index))
            first, tokens = index, 0
        tokens += size
    return [*runs, slice(first, len(groups))] if groups else []


def micro_batch_split(groups: list[list[Sample]], chunk: int | None,
                      token_budget: int | None = None) -> list[list[Sample]]:  # fmt: skip
    """The micro-batches of `micro_batch_runs`, each flattened into one list of samples."""
    return [flattened(groups[run]) for run in micro_batch_runs(groups, chunk, token_budget)]


def flattened(groups: list[list[Sample]]) -> list[Sample]:
    return [s for group in groups for s in group]


def prompts_and_responses(samples: list[Sample]) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and the responses of `samples`."""
    return [s.prompt_ids for s in samples], [s.response_ids for s in samples]


def padded_width(samples: list[Sample]) -> int:
    """The length of a padded row of `samples`: the longest prompt and the longest response."""
    return max(len(s.prompt_ids) for s in samples) + max(len(s.response_ids) for s in samples)


@dataclass
class ForwardPositions:
    """The token positions the policy's forward passes ran in a step, and how many of them held
    a real token (not padding): `padded_frac` = 1 - real / run."""

    run: int = 0
    real: int = 0

    def add(self, prompts: list[list[int]], responses: list[list[int]], packed: bool,
            shared: bool) -> None:  # fmt: skip
        """One forward pass: packed rows, or padded ones (prompts `shared` or not)."""
        shared = shared and not packed
        self.run += (packed_positions(prompts, responses) if packed
                     else padded_positions(prompts, responses, shared))  # fmt: skip
        self.real += real_positions(prompts, responses, shared)


def distinct_context(context: list[Sample], trained: list[Sample]) -> list[Sample]:
    """Each context sample once, and none that the micro-batch trains on: groups of one prompt
    drawn from one generation in the same micro-batch (parts of a group split across steps)
    share their generation's other samples, and each enters the group's statistics once."""
    seen = {id(s) for s in trained}
    distinct = []
    for s in context:
        if id(s) not in seen:
            seen.add(id(s))
            distinct.append(s)
    return distinct


def stack_padded(top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
    """Rows of two right-padded (N, T) tensors as one, padded with zeros to the wider."""
    width = max(top.shape[1], bottom.shape[1])
    pad = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in (top, bottom)]
    return torch.cat(pad)


def padded_rows(rows: list[list[float] | None], width: int, device) -> torch.Tensor | None:
    """Per-token values of each sample (N, width), right-padded with zeros like the policy's
    token log-probs; None unless every sample has them (the objectives that need them say so)."""
    if any(row is None for row in rows):
        return None
    padded = torch.zeros(len(rows), width)
    for index, row in enumerate(rows):
        padded[index, : len(row)] = torch.tensor(row)
    return padded.to(device)
