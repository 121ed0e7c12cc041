"""Training (`train`): the mode, the objective, its steps, limits and batches, and the settings
of one objective alone in a section of their own (`train.tb`, `train.ppo`, `train.vineppo`).

The objectives' sections come from their registry (`tba.objectives.OBJECTIVES`, an entry's
`settings`): `TrainConfig` is `TrainSettings` with a section `train.<name>` of each objective that
names a settings class. An objective entered in the registry after this module was imported
(by a script, or a test) has its section too: validated against its class as it is given, kept
beside the fields, and dumped with them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tba.config.aliases import TRAIN_ATTRIBUTES, drop_inert, notice_renamed, rename_old_keys
from tba.config.base import Section
from tba.objectives import (
    BASELINE_KLS,
    CLIP_EPS,
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    objective_settings,
)

# train.optimizer and train.master_weights (`tba.policy.optimizers`, `tba.policy.precision`).
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
MASTER_WEIGHTS = ("fp32", "none")


class TrainSettings(Section):
    """How the policy trains. The settings of one objective alone are in its section
    (`train.tb`, `train.ppo`, `train.vineppo`): one set while `train.loss` is another objective
    is an error (a value equal to its default is not, so that a dumped configuration, which
    lists every setting, loads again). A task preset sets them only where `train.loss` is their
    objective."""

    # The sections of objectives entered in the registry since `TrainConfig` was made (it has
    # fields for the others), by name.
    _entered_sections: dict[str, Section] = PrivateAttr(default_factory=dict)

    mode: Literal["auto", "async", "sync"] = Field(
        "auto",
        description="async: searchers never stop, the trainer never waits; "
        "sync: generate with the latest weights, then train on exactly that; "
        "`auto`: decided as the run starts, said in one line (config.yaml has the mode decided; "
        "a resumed run keeps its own): sync where the run computes on the CPU alone, with fewer "
        "than 4 cores and a model of 50M parameters or more (a searchers.count of 1, its "
        "default, then becomes 0: the searcher in the trainer's process), or where "
        "searchers.count=0; else async (docs/asynchrony.md)",
    )
    loss: str = Field(
        DEFAULT_OBJECTIVE, description="objective: `tb` (VarGrad trajectory balance) or a "
        f"baseline ({', '.join(name for name in OBJECTIVES if name != 'tb')})",
    )
    clip_eps: float = Field(
        CLIP_EPS, gt=0, description="ratio clip of tb's trust region, dr_grpo, grpo, "
        "proximal_rloo, ppo and vineppo"
    )
    baseline_kl: Literal[BASELINE_KLS] = Field(  # type: ignore[valid-type]
        "current", description="log-probs in the baselines' KL-shaped reward r - beta KL: the "
        "`current` policy's (every baseline then targets TB's distribution off-policy too, and "
        "RLOO's gradient is TB's) or the `behaviour` policy's, fixed at sampling (TRL's RLOO)",
    )
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


    @field_validator("loss")
    @classmethod
    def _registered(cls, loss: str) -> str:
        """An objective of the registry as it is now (one entered since included)."""
        if loss not in OBJECTIVES:
            names = [repr(name) for name in OBJECTIVES]
            raise PydanticCustomError("literal_error", "Input should be {expected}",
                                      {"expected": f"{', '.join(names[:-1])} or {names[-1]}"})
        return loss

    @model_validator(mode="wrap")
    @classmethod
    def _entered_since(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """The sections of objectives entered in the registry since this class was made, taken
        out of `data` before the fields are validated, validated against their own classes, then
        kept beside the fields (`train.<name>` reads them); `_objective_settings_match_the_loss`
        is checked again once they are in."""
        entered = {name: settings for name, settings in objective_settings().items()
                   if name not in cls.model_fields}  # fmt: skip
        if not isinstance(data, dict) or not entered:
            return handler(data)
        train = handler({key: value for key, value in data.items() if key not in entered})
        train._entered_sections = {
            name: _entered_section(name, settings, data[name]) if name in data else settings()
            for name, settings in entered.items()
        }  # fmt: skip
        _objective_settings_match_the_loss(train)
        return train

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """Settings given by their old names (`aliases.ALIASES`) go to their sections, with a
        notice; those of another objective than the loss's are dropped (they never had an
        effect there)."""
        if not isinstance(data, dict) or not any(name in data for name in TRAIN_ATTRIBUTES):
            return data
        data = dict(data)
        for section in objective_settings():  # copies, to move settings into
            if isinstance(data.get(section), BaseModel):
                data[section] = data[section].model_dump(exclude_unset=True)
            elif isinstance(data.get(section), dict):
                data[section] = dict(data[section])
        renamed = rename_old_keys(data, prefix="train.")
        drop_inert(data, renamed, data.get("loss", DEFAULT_OBJECTIVE), "train.")
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainSettings:
        for rule in TRAIN_RULES:
            rule(self)
        return self

    @model_serializer(mode="wrap")
    def _with_entered_sections(self, handler: SerializerFunctionWrapHandler,
                               info: SerializationInfo) -> dict[str, Any]:  # fmt: skip
        """The fields, then the sections of the objectives entered since (`_entered_since`)."""
        options = {"mode": info.mode, "exclude_unset": info.exclude_unset,
                   "exclude_defaults": info.exclude_defaults, "exclude_none": info.exclude_none}
        entered = {name: section.model_dump(**options)
                   for name, section in self._entered_sections.items()}  # fmt: skip
        return {**handler(self), **entered}

    # The old names of the settings now in an objective's section, as attributes: read and
    # assigned through to the section, with the notice (a TRL script may set them). The sections
    # of objectives entered since, as attributes like the others'.
    def __getattr__(self, name: str) -> Any:
        if name in TRAIN_ATTRIBUTES:
            notice_renamed(f"train.{name}")
            section, field = TRAIN_ATTRIBUTES[name]
            return getattr(getattr(self, section), field)
        if not name.startswith("_") and name in self._entered_sections:
            return self._entered_sections[name]
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
    able = [name for name, objective in OBJECTIVES.items() if objective.needs.group_statistics]
    if train.group_size == 1 and (train.group_baseline != "generation"
                                  or (train.samples_per_prompt or 1) < 2
                                  or train.loss not in able):  # fmt: skip
        raise ValueError("train.group_size=1 compares a response with nothing: use 2 or "
                         "more, or train.samples_per_prompt >= 2 with "
                         "train.group_baseline=generation and a loss with group statistics ("
                         + ", ".join(able) + "): its generation's other responses then make "
                         "the group's statistics")  # fmt: skip


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
    (config.yaml) lists every setting. (The section of an objective entered since the config
    was made is not there yet while its fields are validated: it is checked once it is.)"""
    for objective in objective_settings():
        settings: Section | None = getattr(train, objective, None)
        if objective == train.loss or settings is None:
            continue
        for name, field in type(settings).model_fields.items():
            if name in settings.model_fields_set and getattr(settings, name) != field.default:
                raise ValueError(f"train.{objective}.{name} applies to train.loss={objective}, "
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

# `train`: its own settings, then a section of each objective whose entry in the registry names a
# settings class (`train.tb`, `train.ppo`, `train.vineppo`), under the objective's name.
TrainConfig = create_model(
    "TrainConfig", __base__=TrainSettings, __module__=__name__, __doc__=TrainSettings.__doc__,
    **{name: (settings, settings()) for name, settings in objective_settings().items()},
)


def _entered_section(name: str, settings: type[Section], value: Any) -> Section:
    """The section `train.<name>` of an objective entered in the registry since `TrainConfig`
    was made: `value` validated against the settings class its entry names, as a transport's
    section is against its kind's (`tba.config.base.kind_settings`). What is wrong is a
    `ValueError` of one line naming the setting."""
    key = f"train.{name}"
    if isinstance(value, settings):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{key} is a section of settings, not a value (got {value!r:.40})")
    try:
        return settings.model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        if first["type"] == "extra_forbidden":
            raise ValueError(f"{key}.{where}: not a setting of {key} (its settings: "
                             f"{', '.join(settings.model_fields)})") from None  # fmt: skip
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{key}.{where}: {message} (got {first.get('input')!r:.80})") from None
