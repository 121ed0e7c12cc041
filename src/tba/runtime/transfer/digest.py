"""Whether a searcher generates with the weights the trainer published: a cheap fingerprint of
the published tensors, computed by the trainer at each publish and by the searcher after it took
the version, and compared by the trainer (`tba.runtime.ray_pool`). A transport that drops a
publish, delivers part of it (adapters that never reach the model) or corrupts it looks like
staleness in every metric; the fingerprint tells it apart.

The fingerprint reads `SAMPLES` elements of each dtype's published weights, at positions spread
evenly over their flat layout (the manifest of `tba.runtime.transfer.buckets.plan`, the same in
every process that holds the model), as float64, and hashes their bytes (BLAKE2b, 8 bytes):

    positions of a dtype with n elements:  p_j = floor((j + 1/2) n / SAMPLES),  j < SAMPLES
    digest = blake2b(concat over dtypes, sorted, of float64(weights[p_j]))

Equal weights give equal digests on any device and in any process (bf16 and fp32 values are
exact in float64); weights of another version differ at nearly every position. A corruption that
spares every sampled position goes unseen: the price of reading a few hundred numbers rather than
the model (a copy of the model is the publish itself).
"""

from __future__ import annotations

import bisect
import hashlib

import torch

from tba.policy.model import published_state
from tba.runtime.transfer.buckets import plan

SAMPLES = 64  # per dtype


def positions(numel: int, samples: int = SAMPLES) -> list[int]:
    """`samples` positions spread evenly over `numel` elements (fewer where there are fewer)."""
    count = min(samples, numel)
    return [int((j + 0.5) * numel / count) for j in range(count)]


def _hash(values: list[torch.Tensor]) -> str:
    joined = torch.cat([v.detach().reshape(-1).to(torch.float64).cpu() for v in values])
    return hashlib.blake2b(joined.numpy().tobytes(), digest_size=8).hexdigest()


class Fingerprint:
    """The digest of a model's published weights (`published_state`), at the positions of its
    manifest: computed on the model itself (`__call__`), or on bucket sets laid out by the same
    manifest (`of_buckets`: one read per dtype, what the trainer does right after a publish)."""

    def __init__(self, model: torch.nn.Module, samples: int = SAMPLES) -> None:
        self.model = model
        entries, sizes = plan(published_state(model))
        self.flat = {dtype: positions(numel, samples) for dtype, numel in sorted(sizes.items())}
        self._flat_index = {dtype: torch.tensor(flat) for dtype, flat in self.flat.items()}
        # Each sampled flat position as (tensor name, indices within it), in digest order:
        # dtype by dtype, and within one, by position (the entries lie in offset order).
        self.picks: list[tuple[str, torch.Tensor]] = []
        for dtype, flat in self.flat.items():
            own = [e for e in entries if e.dtype == dtype and e.alias_of is None]
            starts = [e.offset for e in own]
            grouped: list[tuple[str, list[int]]] = []
            for position in flat:
                entry = own[bisect.bisect_right(starts, position) - 1]
                if not grouped or grouped[-1][0] != entry.name:
                    grouped.append((entry.name, []))
                grouped[-1][1].append(position - entry.offset)
            self.picks += [(name, torch.tensor(index)) for name, index in grouped]
        self._tensors: list[torch.Tensor] = []
        self._pointers: tuple[int, ...] = ()

    def __call__(self) -> str:
        """The digest of the model's weights as they are now."""
        pointers = tuple(p.data_ptr() for p in self.model.parameters())
        if pointers != self._pointers:  # found again only where parameters were replaced
            state = published_state(self.model)
            self._tensors = [state[name].detach().reshape(-1) for name, _ in self.picks]
            self._pointers = pointers
        return _hash([tensor[index.to(tensor.device)]
                      for tensor, (_, index) in zip(self._tensors, self.picks)])  # fmt: skip

    def of_buckets(self, buckets: dict[str, torch.Tensor]) -> str:
        """The digest of the version held in `buckets` (laid out by this model's manifest)."""
        return _hash([buckets[dtype][index.to(buckets[dtype].device)]
                      for dtype, index in self._flat_index.items()])  # fmt: skip
