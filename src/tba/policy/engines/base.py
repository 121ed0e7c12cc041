"""What an engine is: the interface a searcher generates through (`Engine`).

Every engine returns, per response, its token ids (EOS included when it ended), the log-prob of
each sampled token under the distribution it was sampled from, and whether it was cut off at the
length limit (`tba.policy.sampling.Generation`). Those per-token log-probs are the behaviour
log-probs of TB's trust region and of the clipped baselines: `log_softmax(logits / T)[token]` at
the sampling temperature T, over the whole vocabulary (no top-p, top-k or penalties), the same
quantity the trainer computes (`tba.policy.logprobs`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tba.config import EngineSettings, PolicyConfig
from tba.policy.sampling import Generation


class Engine(ABC):
    """What a searcher generates with: one in each searcher, started in its process (`start`),
    given the weights of every version the searcher takes (`load_weights`)."""

    name: ClassVar[str]  # its `searchers.engine.type`
    # Seconds the engine took to start, where that is worth reporting (the `searcher_ready`
    # event's `engine_start_seconds`); None: no time to speak of.
    start_seconds: float | None = None

    @classmethod
    @abstractmethod
    def start(
        cls, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, seed: int,
        model_dir: str | None, policy: PolicyConfig, settings: EngineSettings,
    ) -> Engine:  # fmt: skip
        """The engine of a searcher whose copy of the policy is `model` (loaded from
        `model_dir`, None where it came from elsewhere), seeded with `seed`; `policy`: the
        policy's section (its dtype, its sampler), `settings`: `searchers.engine`, this engine's
        own class of settings."""

    @classmethod
    def check_available(cls) -> None:
        """Before a run starts: `ConfigError`, one line saying what to install, where software
        the engine needs is missing (none, by default)."""
        return None

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float
    ) -> Generation:
        """One response per prompt (repeat a prompt to get several)."""

    @abstractmethod
    def load_weights(self, model: PreTrainedModel) -> None:
        """Generate with the weights `model` now holds (the searcher's copy of the policy)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the engine (its random state), to resume exactly; by
        default nothing: a resumed run samples anew."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` kept (nothing, by default)."""
        return None
