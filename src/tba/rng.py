"""The random generators of the training process, seeded from the run's seed, and their state as
JSON values: a checkpoint keeps it, so a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RandomState:
    """The batch sampler's own generator (`sampler`) and the process-wide Python, NumPy and torch
    generators (model initialisation, dropout, anything else that draws from them)."""

    def __init__(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.sampler = np.random.default_rng(seed)

    def state_dict(self) -> dict[str, Any]:
        legacy = np.random.get_state(legacy=False)
        legacy["state"] = {"key": legacy["state"]["key"].tolist(), "pos": legacy["state"]["pos"]}
        return {
            "sampler": self.sampler.bit_generator.state,
            "python": random.getstate(),
            "numpy": legacy,
            "torch": torch.get_rng_state().tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.bit_generator.state = state["sampler"]
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        legacy = state["numpy"]
        key = np.asarray(legacy["state"]["key"], dtype=np.uint32)
        np.random.set_state(legacy | {"state": legacy["state"] | {"key": key}})
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
