"""The nouns every stage shares: what a task is, what a sample is, what a batch is.

Data flows prompts -> searchers -> buffer -> trainer -> weights -> searchers. A `Task` holds the
prompts (rows) and the reward functions; a searcher turns prompts into `Sample`s; the replay
buffer stores them and draws `Batch`es of per-prompt groups for the trainer.

This module imports nothing of tba, so any module can use these names without pulling in the
modules that make or consume them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# A reward function, TRL's contract: `fn(prompts, completions, **columns) -> list[float]`.
RewardFn = Callable[..., list[float]]
# A prompt is a text or a conversation: `{"role": "system" | "user" | "assistant", "content"}`
# messages, rendered by the policy's chat template.
Prompt = str | list[dict[str, str]]
# evaluate(model, tokenizer, settings: tba.evaluation.EvalSettings) -> {metric: value}
Evaluator = Callable[..., dict[str, float]]
# log_event(kind, **fields): a notable event of the run (events.jsonl, and the console)
EventLogger = Callable[..., None]


@dataclass
class Task:
    name: str
    train_rows: list[dict]  # each row: {"prompt": Prompt, **columns}
    eval_rows: list[dict]
    reward_fns: list[RewardFn]
    correct_fn: RewardFn | None = None  # 1.0 / 0.0 per completion: what pass@k counts
    evaluate: Evaluator | None = None  # the task's own held-out metrics instead of pass@k
    metrics: tuple[str, ...] = ("eval_pass@1",)  # headline metrics: progress bar and plots
    # A file in the run directory where every distinct completion the searchers made is written
    # once, with its reward, reward parts and extras, and `annotate(completion)`'s fields.
    export_samples: str | None = None
    annotate: Callable[[str], dict] | None = None
    conversational: bool = False  # some prompts are conversations: needs a chat template


@dataclass
class Sample:
    """One generated response together with everything the TB loss needs about it."""

    prompt_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    ref_logp: float
    behaviour_logp: float
    version: int
    searcher_id: int = 0
    created_at: float = 0.0
    truncated: bool = False
    reward_parts: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # logged by reward functions
    # Scalars reward functions logged with `log_metric` in the call that scored this sample.
    reward_metrics: dict[str, float] = field(default_factory=dict)
    # Per response token; the clipped-ratio baselines need them, TB does not.
    behaviour_token_logps: list[float] | None = None
    # Per response token, for a per-token KL penalty, where the objective's needs ask for them
    # (`tba.objectives.Needs.token_ref_logp`: PPO, VinePPO; None otherwise).
    ref_token_logps: list[float] | None = None
    # Where the objective's needs ask for them (`Needs.step_values`: VinePPO): the response split
    # into steps (each step's end, exclusive; the last is the response's length), the Monte Carlo
    # value of the state before each step, and the extra rollouts generated for those states
    # that no earlier sample of the batch shared.
    step_ends: list[int] | None = None
    step_values: list[float] | None = None
    rollouts: int = 0
    # Per response token, where the objective's needs ask for a critic (`Needs.critic`: PPO):
    # the critic's values V(s_t) at the sample's first use in training (PPO's V_old), set by the
    # trainer and reused by every later use (`buffer.fresh_uses` > 1, replay); None until then,
    # and in checkpoints written before the field existed.
    old_values: list[float] | None = None
    # (searcher_id, incarnation, seq) names a sample uniquely within a run: the trainer checks
    # that every searcher process hands over 0, 1, 2, ... exactly once.
    incarnation: int = 0
    seq: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        return cls(**d)


@dataclass
class Batch:
    """A batch drawn from the buffer: its groups (each the samples of one prompt), and what they
    are made of."""

    groups: list[list[Sample]]
    # Per group (when asked for): the other samples its generation made of the prompt, which
    # enter the group's log Z or baseline without being trained on ([] for a replayed group).
    context: list[list[Sample]] = field(default_factory=list)
    fresh: int = 0  # groups of fresh samples (the recent branch)
    reused: int = 0  # groups in which every sample had been trained on before
    repeated: int = 0  # groups identical to one of the previous batch (same samples)
