"""The peak memory of a stretch of work in this process, as the metrics report it.

- On a CUDA device: the most the caching allocator held for tensors at once
  (`torch.cuda.max_memory_allocated`), its peak reset at each `reset()`.
- On a CPU: the peak resident set size of the process (VmHWM), reset at each `reset()` by writing
  5 to `/proc/self/clear_refs` (Linux). Where that cannot be done, the process's lifetime peak.
"""

from __future__ import annotations

import contextlib
import resource
from pathlib import Path

import torch

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


class PeakMemory:
    """`reset()` at the start of a step, `peak_mib()` at its end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError):  # not Linux, or not allowed: the lifetime peak stands
            CLEAR_REFS.write_text("5")

    def peak_mib(self) -> float:
        """The most held at once since the last `reset()`."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        peak = _status_mib("VmHWM")
        if peak is None:  # the lifetime peak, in kB on Linux
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return peak

    def current_mib(self) -> float:
        """What is held now."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) / 2**20
        return _status_mib("VmRSS") or 0.0


def _status_mib(field: str) -> float | None:
    """A memory field of /proc/self/status (Linux), in MiB."""
    with contextlib.suppress(OSError):
        for line in STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024  # kB
    return None
