"""The built-in engine (`searchers.engine=builtin`, the default): the KV-cache sampler of
`tba.policy.sampling` over the Hugging Face model the searcher holds, by the loop or the static
path (`policy.sampler`; `auto`: the compiled static path on CUDA, the loop on a CPU). On a CPU and
a tiny model it is the faster engine."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.config import EngineSettings, PolicyConfig
from tba.policy.engines.base import Engine
from tba.policy.sampling import Generation, SamplerKind, sampler_for


class BuiltinEngine(Engine):
    """The KV-cache sampler over the searcher's own model, with a seeded generator (saved in
    checkpoints: a resumed run draws the same samples, on either path)."""

    name = "builtin"

    def __init__(
        self, model: PreTrainedModel, eos_id: int, pad_id: int, seed: int,
        sampler: SamplerKind = "auto",
    ) -> None:  # fmt: skip
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.sampler = sampler_for(model, sampler)
        self.generator = torch.Generator(device=next(model.parameters()).device)
        self.generator.manual_seed(seed)

    @classmethod
    def start(
        cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, seed: int,
        model_dir: str | None, policy: PolicyConfig, settings: EngineSettings,
    ) -> BuiltinEngine:  # fmt: skip
        """It samples with `model` itself, by the path `policy.sampler` chooses."""
        return cls(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed, policy.sampler)

    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> Generation:
        return self.sampler.generate(prompts, eos_id=self.eos_id, pad_id=self.pad_id,
                                     max_new_tokens=max_new_tokens, temperature=temperature,
                                     generator=self.generator)  # fmt: skip

    def load_weights(self, model: PreTrainedModel) -> None:
        """Nothing to do: it samples with `model` itself."""

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
