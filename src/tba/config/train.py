"""Training (`train`): the mode, the objective, its steps, limits and batches, and the settings
of one objective alone in a section of their own (`train.tb`, `train.ppo`, `train.vineppo`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from tba.config.aliases import (
    OBJECTIVE_SECTIONS,
    TRAIN_ATTRIBUTES,
    drop_inert,
    notice_renamed,
    rename_old_keys,
)
from tba.config.base import Section
from tba.objectives import BASELINE_KLS, OBJECTIVES, ROW_MEAN_GROUP_OBJECTIVES, TRUST_REGIONS

# train.optimizer and train.master_weights (`tba.policy.optimizers`, `tba.policy.precision`).
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
MASTER_WEIGHTS = ("fp32", "none")


class TBSettings(Section):
    """Trajectory balance's own settings (`train.loss=tb`)."""

    trust_region: Literal[TRUST_REGIONS] = Field(  # type: ignore[valid-type]
        "sequence", description="tb: clip the importance ratio to the behaviour policy per "
        "`sequence` or per `token` (TBA'), or `none` (the paper's plain TB)",
    )
    log_z: Literal["vargrad", "learned"] = Field(
        "vargrad", description="tb: log Z(x) estimated per group (VarGrad, needs K >= 2) or "
        "learned with the policy (a linear head on the prompt's mean input embedding)",
    )
    log_z_lr: float = Field(1e-2, gt=0, description="Adam learning rate of a learned log Z")


class PPOSettings(Section):
    """PPO's critic and value loss (`train.loss=ppo`)."""

    value_model: Literal["head", "critic"] = Field(
        "head", description="ppo: the critic is a linear head on the policy's last hidden "
        "state (the value loss also trains the policy's layers) or on a separate `critic` LM, "
        "a trainable copy of the starting policy (trained at train.ppo.critic_lr)",
    )
    value_lr: float = Field(1e-3, gt=0, description="ppo: Adam learning rate of the value head")
    critic_lr: float | None = Field(
        None, gt=0, description="ppo: Adam learning rate of the separate critic LM "
        "(value_model=critic; null: train.learning_rate). On the built-in math task a critic "
        "at 3e-4 learned faster than at the policy's rate (docs/objective.md)",
    )
    gae_lambda: float = Field(
        0.95, ge=0, le=1, description="ppo: lambda of GAE (gamma is 1; 1: Monte Carlo returns)"
    )
    value_clip: float = Field(
        0.2, gt=0, description="ppo: the value loss's clip around V_old, the critic's values at "
        "the sample's first use in training (binds on its later uses: buffer.fresh_uses > 1, "
        "replay)",
    )
    value_coef: float = Field(0.1, ge=0, description="ppo: weight of the value loss")


class VinePPOSettings(Section):
    """VinePPO's Monte Carlo values of step prefixes (`train.loss=vineppo`)."""

    rollouts: int = Field(
        9, ge=1, description="vineppo: continuations sampled per step prefix to estimate its value"
    )
    max_states: int = Field(
        25, ge=1, description="vineppo: step prefixes per response at most, the prompt included "
        "(more steps: evenly spaced step ends kept)",
    )
    delimiter: str = Field(
        "\n", min_length=1, description="vineppo: a step ends with the token whose text holds this",
    )


class TrainConfig(Section):
    """How the policy trains. The settings of one objective alone are in its section
    (`train.tb`, `train.ppo`, `train.vineppo`): one set while `train.loss` is another objective
    is an error (a value equal to its default is not, so that a dumped configuration, which
    lists every setting, loads again). A task preset sets them only where `train.loss` is their
    objective."""

    mode: Literal["async", "sync"] = Field(
        "async",
        description="async: searchers never stop, the trainer never waits; "
        "sync: generate with the latest weights, then train on exactly that",
    )
    loss: Literal[tuple(OBJECTIVES)] = Field(  # type: ignore[valid-type]
        "tb", description="objective: `tb` (VarGrad trajectory balance) or a baseline "
        f"({', '.join(name for name in OBJECTIVES if name != 'tb')})",
    )
    tb: TBSettings = TBSettings()
    clip_eps: float = Field(
        0.2, gt=0, description="ratio clip of tb's trust region, dr_grpo, grpo, proximal_rloo, "
        "ppo and vineppo"
    )
    baseline_kl: Literal[BASELINE_KLS] = Field(  # type: ignore[valid-type]
        "current", description="log-probs in the baselines' KL-shaped reward r - beta KL: the "
        "`current` policy's (every baseline then targets TB's distribution off-policy too, and "
        "RLOO's gradient is TB's) or the `behaviour` policy's, fixed at sampling (TRL's RLOO)",
    )
    ppo: PPOSettings = PPOSettings()
    vineppo: VinePPOSettings = VinePPOSettings()
    max_steps: int | None = Field(
        None, ge=1, description="optimizer steps (null: no step limit); when given, it wins "
        "over num_epochs (as TRL's max_steps over num_train_epochs); the run ends at the first "
        "limit reached: this step limit, max_minutes or Ctrl-C (the run's start says which)",
    )
    num_epochs: float | None = Field(
        None, gt=0, description="passes over the training prompts: where max_steps is not "
        "given, the step limit is num_epochs * (training prompts) / num_prompts",
    )
    max_minutes: float | None = Field(
        10.0, gt=0, description="wall-clock limit of training (null: none); what ends the "
        "default job, on a CPU or a GPU alike",
    )
    learning_rate: float = Field(5e-5, gt=0, description="Adam learning rate of the policy")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warmup, the learning rate stays (`constant`) or "
        "decays to 0 at the run's last step (`linear`, `cosine`; needs a step limit: max_steps "
        "or num_epochs)",
    )
    warmup_steps: int = Field(
        0, ge=0, description="linear learning-rate warmup, in optimizer steps: step t of the "
        "first N updates at (t + 1) / (N + 1) of the rate"
    )
    warmup_ratio: float = Field(
        0.0, ge=0, lt=1, description="the warmup as a share of the run's step limit, where "
        "warmup_steps is 0 (rounded up, as transformers does)",
    )
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW's decoupled weight decay: each update also shrinks the "
        "matrices (not biases, norm weights nor a learned log Z) by learning rate * this",
    )
    max_grad_norm: float = Field(1.0, gt=0, description="gradient norm clip")
    optimizer: Literal[OPTIMIZERS] = Field(  # type: ignore[valid-type]
        "adamw", description="`adamw`: torch's AdamW (fp32 moments with fp32 masters: 8 bytes a "
        "weight); `adamw_8bit`: bitsandbytes' AdamW8bit, the moments in 8 bits, block-wise (2 "
        "bytes a weight; tensors under 4096 values keep fp32 ones); `paged_adamw_8bit`: the same, "
        "paged to the host under CUDA memory pressure (unpaged on a CPU). The 8-bit ones need "
        "bitsandbytes and one trainer rank",
    )
    master_weights: Literal[MASTER_WEIGHTS] = Field(  # type: ignore[valid-type]
        "fp32", description="16-bit (bf16) weights: the optimizer updates `fp32` master copies "
        "(4 bytes a weight, and an fp32 gradient), or `none`: the weights themselves, each with a "
        "bf16 Kahan compensation (2 bytes a weight) that keeps the updates below bf16's "
        "resolution; deterministic, resumes exactly. No effect on fp32 weights (an fp32 policy, "
        "LoRA adapters)",
    )
    num_prompts: int = Field(8, ge=1, description="B: prompts (groups) per batch")
    group_size: int = Field(
        16, ge=1, description="K: responses per prompt in a batch (1 only with "
        "group_baseline=generation: a group's statistics then come from its generation)",
    )
    samples_per_prompt: int | None = Field(
        None, ge=2, description="S >= K: responses generated per prompt visit (default: K)"
    )
    group_baseline: Literal["trained", "generation"] = Field(
        "trained", description="where S > K (samples_per_prompt > group_size): a fresh group's "
        "log Z (tb) or baseline (grpo, dr_grpo, rloo, proximal_rloo) comes from its K trained "
        "samples, or from all the samples of the prompt that the same generation made, those "
        "not trained at this step entering without gradient (TRL's advantages over "
        "num_generations; costs a forward pass over them; the loss logged is then the mean over "
        "all of them)",
    )
    beta: float = Field(0.05, gt=0, description="KL coefficient; the start value when annealed")
    beta_end: float | None = Field(None, gt=0, description="anneal beta linearly to this value")
    beta_start_frac: float = Field(0.0, ge=0, le=1, description="anneal starts at this fraction")
    beta_end_frac: float = Field(1.0, ge=0, le=1, description="anneal ends at this fraction")
    sync_every: int = Field(1, ge=1, description="k: optimizer steps between weight syncs")
    sync_generate: Literal["every_step", "when_needed"] = Field(
        "every_step", description="sync: a generation (searchers.prompts_per_batch prompts) at "
        "every step, or `when_needed`: only while the buffer holds fewer groups of fresh samples "
        "than a batch takes (buffer.recent_prob * num_prompts), so that one generation serves "
        "several steps and no step replays groups it was not asked to (TRL's "
        "generation_batch_size)",
    )
    initial_buffer_samples: int | None = Field(
        None, ge=1, description="async: the trainer starts once the buffer holds this many "
        "samples (default: four batches, 4*B*K)",
    )
    fresh_wait_s: float = Field(
        0.0, ge=0, description="async: when fewer than m*B prompts with fresh samples are in the "
        "buffer, wait up to this long for more before filling the batch from replay",
    )
    truncated: Literal["score", "penalize", "drop"] = Field(
        "score", description="responses without EOS: scored by the reward functions like any "
        "other (as TRL does), rewarded `truncation_penalty`, or dropped (TRL's "
        "`mask_truncated_completions`)",
    )
    truncation_penalty: float = Field(-1.0, description="reward of a response without EOS")
    max_nonfinite_steps: int = Field(
        10, ge=1, description="steps with a non-finite loss or gradient are skipped; this many "
        "in a row stop the run (after a checkpoint of the last good state)",
    )
    micro_batch_groups: int | None = Field(
        None, ge=1, description="groups per forward/backward pass, gradients accumulated over "
        "the batch; groups stay whole (default: the whole batch at once)",
    )
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="prompt and response tokens per forward/backward pass at most "
        "(with micro_batch_groups, both bounds hold); groups stay whole, one over the budget "
        "alone is a pass of its own. Its rows run packed end to end where that runs fewer "
        "positions than padding and the model keeps packed rows apart (transformers' Llama, "
        "Qwen2, GPT-2, ...; padded otherwise): the same losses without the padding (the "
        "step's `padded_frac`). Null: padded micro-batches of micro_batch_groups",
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute activations in the backward pass: less memory, ~30% "
        "more compute (each response then runs with its prompt instead of sharing its KV "
        "cache); `auto`: decided at the first step, on only on a GPU where the step's "
        "activations, estimated from the model's shape and the micro-batch (with "
        "micro_batch_tokens, the budget), would not fit 0.6 of its free memory "
        "(tba/policy/activation_memory.py), off on a CPU",
    )


    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """Settings given by their old names (`aliases.ALIASES`) go to their sections, with a
        notice; those of another objective than the loss's are dropped (they never had an
        effect there)."""
        if not isinstance(data, dict) or not any(name in data for name in TRAIN_ATTRIBUTES):
            return data
        data = dict(data)
        for section in OBJECTIVE_SECTIONS:  # copies, to move settings into
            if isinstance(data.get(section), BaseModel):
                data[section] = data[section].model_dump(exclude_unset=True)
            elif isinstance(data.get(section), dict):
                data[section] = dict(data[section])
        renamed = rename_old_keys(data, prefix="train.")
        drop_inert(data, renamed, data.get("loss", cls.model_fields["loss"].default), "train.")
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        for rule in TRAIN_RULES:
            rule(self)
        return self

    # The old names of the settings now in an objective's section, as attributes: read and
    # assigned through to the section, with the notice (a TRL script may set them).
    def __getattr__(self, name: str) -> Any:
        if name in TRAIN_ATTRIBUTES:
            notice_renamed(f"train.{name}")
            section, field = TRAIN_ATTRIBUTES[name]
            return getattr(getattr(self, section), field)
        return super().__getattr__(name)  # type: ignore[misc]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in TRAIN_ATTRIBUTES:
            notice_renamed(f"train.{name}")
            section, field = TRAIN_ATTRIBUTES[name]
            setattr(getattr(self, section), field, value)
            return
        super().__setattr__(name, value)


def _samples_per_prompt_at_least_group_size(train: TrainConfig) -> None:
    """S >= K: a batch's K responses of a prompt are among the S generated for it."""
    if train.samples_per_prompt is not None and train.samples_per_prompt < train.group_size:
        raise ValueError(
            f"samples_per_prompt ({train.samples_per_prompt}) must be >= group_size "
            f"({train.group_size})"
        )


def _group_of_one_needs_generation_baseline(train: TrainConfig) -> None:
    """K = 1 only where the group's statistics come from its generation's other responses."""
    if train.group_size == 1 and (train.group_baseline != "generation"
                                  or (train.samples_per_prompt or 1) < 2
                                  or train.loss not in ROW_MEAN_GROUP_OBJECTIVES):  # fmt: skip
        raise ValueError("train.group_size=1 compares a response with nothing: use 2 or "
                         "more, or train.samples_per_prompt >= 2 with "
                         "train.group_baseline=generation and a loss with group statistics ("
                         + ", ".join(ROW_MEAN_GROUP_OBJECTIVES) + "): its generation's other "
                         "responses then make the group's statistics")  # fmt: skip


def _beta_anneal_starts_before_it_ends(train: TrainConfig) -> None:
    """beta_start_frac <= beta_end_frac."""
    if train.beta_start_frac > train.beta_end_frac:
        raise ValueError("beta_start_frac must be <= beta_end_frac")


def _run_needs_a_limit(train: TrainConfig) -> None:
    """A run ends: max_minutes, max_steps or num_epochs is set."""
    if train.max_steps is None and train.num_epochs is None and train.max_minutes is None:
        raise ValueError("a run needs a limit: set train.max_minutes, train.max_steps or "
                         "train.num_epochs")  # fmt: skip


def _decay_needs_a_step_limit(train: TrainConfig) -> None:
    """A decaying learning rate reaches 0 at the run's last step: it needs a step limit."""
    if train.max_steps is None and train.num_epochs is None and train.lr_schedule != "constant":
        raise ValueError(f"train.lr_schedule={train.lr_schedule} decays over the run's "
                         "steps: set train.max_steps or train.num_epochs")  # fmt: skip


def _warmup_ratio_needs_a_step_limit(train: TrainConfig) -> None:
    """train.warmup_ratio is a share of the run's steps: it needs a step limit (or
    train.warmup_steps, which it yields to)."""
    if (train.max_steps is None and train.num_epochs is None and train.warmup_ratio > 0
            and train.warmup_steps == 0):  # fmt: skip
        raise ValueError("train.warmup_ratio is a share of the run's steps: set "
                         "train.max_steps or train.num_epochs, or train.warmup_steps")


def _objective_settings_match_the_loss(train: TrainConfig) -> None:
    """A setting of one objective's section (`train.ppo.value_coef`) is set only while
    `train.loss` is that objective. Only settings given count (the section's
    `model_fields_set`), and only where they differ from their default: a dumped configuration
    (config.yaml) lists every setting."""
    for section, objective in OBJECTIVE_SECTIONS.items():
        if objective == train.loss:
            continue
        settings: Section = getattr(train, section)
        for name, field in type(settings).model_fields.items():
            if name in settings.model_fields_set and getattr(settings, name) != field.default:
                raise ValueError(f"train.{section}.{name} applies to train.loss={objective}, "
                                 f"not train.loss={train.loss}")  # fmt: skip


# TrainConfig's cross-setting rules, checked in this order.
TRAIN_RULES = (
    _samples_per_prompt_at_least_group_size,
    _group_of_one_needs_generation_baseline,
    _beta_anneal_starts_before_it_ends,
    _run_needs_a_limit,
    _decay_needs_a_step_limit,
    _warmup_ratio_needs_a_step_limit,
    _objective_settings_match_the_loss,
)
