"""Typed run configuration: YAML files plus `key=value` overrides, validated by pydantic.

Every section is a plain model with unknown keys forbidden, so a typo is an error, not a silently
ignored setting. `load_config` raises `ConfigError` with one line naming the key and what is
allowed; the CLI prints that line and exits with status 2.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from tba.errors import ConfigError  # defined there; importable from here too
from tba.objectives import BASELINE_KLS, OBJECTIVES, ROW_MEAN_GROUP_OBJECTIVES, TRUST_REGIONS
from tba.templates import template_fields


class Section(BaseModel):
    # strict: `true` is not a number and `"8"` is not an int; a typo must not pass as a value.
    # Every number finite: `.inf` as a learning rate trains one step, then fails somewhere deep.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True,
                              allow_inf_nan=False)  # fmt: skip


DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def _device_name(device: str) -> str:
    """A device torch knows, written as the settings take it; whether this machine has it is
    checked as a run starts (`tba.policy.model.check_devices`)."""
    if not DEVICE_PATTERN.fullmatch(device):
        raise ValueError("a device is auto (CUDA when present), cpu, cuda, cuda:N (the GPU of "
                         "index N) or mps")  # fmt: skip
    return device


Device = Annotated[str, AfterValidator(_device_name)]


def cuda_index(device: str) -> int | None:
    """The GPU index a device setting names (`cuda`: 0), None for anything but CUDA."""
    kind, _, index = device.partition(":")
    return (int(index) if index else 0) if kind == "cuda" else None


class PolicyConfig(Section):
    model: str = Field(
        "builtin:math",
        description="`builtin:math` (the embedded tiny policy, built on first use; "
        "`builtin:redteam` for the red-teaming task, `builtin:summarize` for summarize), a "
        "directory saved with `save_pretrained`, or a Hugging Face Hub model id (downloaded once "
        "into the Hub cache; `HF_HUB_OFFLINE=1` uses the cache only); also the reference policy",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="weights of trainer and searchers; `bfloat16`: the optimizer updates fp32 "
        "master weights, the loss runs in fp32",
    )
    chat_template: bool = Field(
        False, description="wrap every prompt in the tokenizer's chat template (instruct models)"
    )
    device: Device = Field(
        "auto", description="trainer device: `auto` (CUDA when present), `cpu`, `cuda`, `cuda:1`"
    )
    temperature: float = Field(
        1.0, gt=0, description="sampling temperature, also used in log-probs"
    )
    max_new_tokens: int = Field(40, ge=1, description="response length limit, EOS included")
    max_prompt_length: int | None = Field(
        None, ge=1, description="prompts longer than this many tokens keep their last ones "
        "(null: prompts are never cut)",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch threads of the trainer (default: all cores; async on "
        "a local instance: the cores the searchers do not reserve)",
    )
    sampler: Literal["auto", "loop", "static", "compiled"] = Field(
        "auto", description="how the built-in engine and held-out evaluation generate: `loop` "
        "(a growing KV cache, a check with the host after every token), `static` (a static KV "
        "cache and buffers of fixed shapes, the check every few tokens), `compiled` (`static` "
        "with its decode step compiled by torch.compile, CUDA graphs on a GPU; the first "
        "generation of each batch-size and length bucket compiles), `auto` (`compiled` on CUDA "
        "where the model supports it, else `loop`: the faster on a CPU) (docs/engines.md)",
    )


class PretrainConfig(Section):
    """How the built-in base policy is made (`tba pretrain`)."""

    num_examples: int = Field(4000, ge=1, description="worked solutions in the limited SFT set")
    steps: int = Field(260, ge=1, description="SFT steps (cosine learning-rate decay)")
    batch_size: int = Field(64, ge=1, description="worked solutions per SFT step")
    learning_rate: float = Field(3e-3, gt=0, description="peak SFT learning rate")
    sloppy_fraction: float = Field(
        0.7, ge=0, le=1, description="share of three-step solutions that stop one step early"
    )
    cache_dir: str = Field("~/.cache/tba", description="where built-in base policies are kept")


DATASET_TASKS = ("gsm8k", "competition_math", "tldr")
EMBEDDED_TASKS = ("math", "redteam", "summarize")


class RedteamConfig(Section):
    """Red-teaming (`task.name=redteam`): the policy writes attacks on a frozen victim LM; a
    classifier scores the victim's answers. `builtin` models are the embedded world's."""

    victim_model: str = Field(
        "builtin", description="the victim: a causal LM, directory or Hub id (`builtin`: the "
        "embedded world's)",
    )
    victim_template: str = Field(
        "{attack} =>", description="the victim's prompt, `{attack}` replaced by the attack"
    )
    victim_samples: int = Field(5, ge=1, description="victim answers per attack")
    victim_max_new_tokens: int = Field(12, ge=1, description="length limit of an answer")
    victim_temperature: float = Field(1.0, gt=0, description="sampling temperature of the victim")
    classifier_model: str = Field(
        "builtin", description="P(harmful) of an answer: a sequence-classification model, "
        "directory or Hub id (`builtin`: the embedded world's)",
    )
    harmful_label: int = Field(1, ge=0, description="the classifier's label index of harmful")
    embedding_model: str | None = Field(
        None, description="diversity: mean-pooled hidden states of this model (directory or Hub "
        "id); default TF-IDF of word unigrams and bigrams",
    )
    min_attack_words: int = Field(
        3, ge=0, description="shorter attacks get the lowest reward, log 1e-4"
    )
    prompt: str | None = Field(
        None, description="the fixed prompt that asks the policy for an attack (default: the "
        "embedded world's few-shot prompt)",
    )


class TaskConfig(Section):
    name: Literal[
        "math", "redteam", "summarize", "gsm8k", "competition_math", "tldr", "custom"
    ] = Field(
        "math", description="`math`, `redteam` and `summarize`: embedded synthetic tasks "
        "(red-teaming a frozen victim; preference tuning of summaries); `gsm8k`, "
        "`competition_math` (MATH, `\\boxed{}` answers) and `tldr` "
        "(reward-model summaries) read real data; `custom`: your data and task.reward_funcs",
    )
    num_train: int | None = Field(
        5000, ge=1, description="training prompts (a dataset's first N rows; null: all)"
    )
    num_eval: int | None = Field(
        256, ge=1, description="held-out problems for greedy pass@1 (first N rows; null: all)"
    )
    num_eval_pass_k: int = Field(128, ge=1, description="held-out problems for pass@k")
    train_path: str | None = Field(
        None, description="training rows: a local .jsonl, .json, .parquet or .csv file "
        "(default: task.dataset's train_split)",
    )
    eval_path: str | None = Field(
        None, description="held-out rows, as train_path (default: eval_split of eval_dataset, "
        "else of dataset)",
    )
    dataset: str | None = Field(
        None, description="a dataset for `datasets.load_dataset` by name (a Hub id, or a local "
        "folder of split files), read where no path is given",
    )
    dataset_config: str | None = Field(
        None, description="its configuration, e.g. `main` for `openai/gsm8k`"
    )
    train_split: str = Field("train", description="split of task.dataset to train on")
    eval_dataset: str | None = Field(
        None, description="held-out rows from another dataset by name (default: task.dataset)"
    )
    eval_dataset_config: str | None = Field(
        None, description="configuration of eval_dataset (default: task.dataset_config)"
    )
    eval_split: str = Field("test", description="split of the held-out dataset to evaluate on")
    prompt_template: str | None = Field(
        None, description="prompt made from a row, `{column}` fields, `{{`/`}}` for braces "
        "(default per task; gsm8k: `[MATH_TASK] Problem:\\n{question}\\n\\nSolution:`)",
    )
    answer_field: str | None = Field(
        None, description="the row's gold column (default: gsm8k `answer`, text after "
        "`####`; competition_math `solution`, last `\\boxed{}`; tldr `reference_response`)",
    )
    reward_model: str | None = Field(
        None, description="tldr: sequence-classification reward model, Hub id or directory"
    )
    eval_reward_model: str | None = Field(
        None, description="tldr: the judge of the held-out win rate against the reference "
        "summaries (default: reward_model)",
    )
    reward_device: Device = Field(
        "auto", description="device of the reward models in each process, as policy.device"
    )
    reward_batch_size: int = Field(32, ge=1, description="texts per reward-model forward pass")
    reward_weights: list[float] | None = Field(
        None, description="one weight per reward function: a completion's reward is the "
        "weighted sum of the functions' values (default: all 1)",
    )
    reward_funcs: list[str] = Field(
        [], description="custom: reward functions `module:function` (a module on the Python "
        "path or a `.py` file), or sequence-classification reward models (Hub id or directory); "
        "their rewards are summed",
    )
    eval_func: str | None = Field(
        None, description="custom: `module:function` scoring a completion 1 (correct) or 0, "
        "for held-out pass@1 (default: the mean summed reward of greedy completions)",
    )
    redteam: RedteamConfig = RedteamConfig()

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if self.name != "custom" and (self.reward_funcs or self.eval_func):
            key = "reward_funcs" if self.reward_funcs else "eval_func"
            raise ValueError(f"task.{key} applies to the custom task, not to {self.name}")
        data_keys = ["train_path", "eval_path", "dataset", "dataset_config", "eval_dataset",
                     "eval_dataset_config", "prompt_template", "answer_field", "reward_model",
                     "eval_reward_model"]  # fmt: skip
        if self.name in EMBEDDED_TASKS:
            given = [key for key in data_keys if getattr(self, key) is not None]
            if given:
                raise ValueError(
                    f"task.{given[0]} applies to the dataset tasks ({', '.join(DATASET_TASKS)}), "
                    f"not to the embedded {self.name} task"
                )
            if self.num_train is None or self.num_eval is None:
                raise ValueError(f"the {self.name} task needs task.num_train and task.num_eval")
            return self
        if self.name == "custom":  # its data and rewards are checked where they are loaded
            wrong = [k for k in ("answer_field", "reward_model", "eval_reward_model")
                     if getattr(self, k) is not None]  # fmt: skip
            if wrong:
                raise ValueError(f"task.{wrong[0]} does not apply to the custom task (its "
                                 "rewards come from task.reward_funcs)")  # fmt: skip
            weights, functions = self.reward_weights, self.reward_funcs
            if weights is not None and functions and len(weights) != len(functions):
                raise ValueError(f"task.reward_weights has {len(weights)} weights for "
                                 f"{len(functions)} reward functions (task.reward_funcs): give "
                                 "one weight per function")  # fmt: skip
            if self.prompt_template is not None:
                template_fields(self.prompt_template)
            return self
        if self.train_path is None and self.dataset is None:
            raise ValueError(f"task.name={self.name} needs task.train_path or task.dataset")
        if self.eval_path is None and self.eval_dataset is None and self.dataset is None:
            raise ValueError(
                f"task.name={self.name} needs task.eval_path, task.eval_dataset or task.dataset"
            )
        if self.name == "tldr" and self.reward_model is None:
            raise ValueError("task.name=tldr needs task.reward_model")
        if self.name != "tldr" and (self.reward_model or self.eval_reward_model):
            raise ValueError(f"task.reward_model applies to tldr, not to {self.name}")
        if self.prompt_template is not None:
            template_fields(self.prompt_template)
        return self


class TrainConfig(Section):
    mode: Literal["async", "sync"] = Field(
        "async",
        description="async: searchers never stop, the trainer never waits; "
        "sync: generate with the latest weights, then train on exactly that",
    )
    loss: Literal[tuple(OBJECTIVES)] = Field(  # type: ignore[valid-type]
        "tb", description="objective: `tb` (VarGrad trajectory balance) or a baseline "
        f"({', '.join(name for name in OBJECTIVES if name != 'tb')})",
    )
    trust_region: Literal[TRUST_REGIONS] = Field(  # type: ignore[valid-type]
        "sequence", description="tb: clip the importance ratio to the behaviour policy per "
        "`sequence` or per `token` (TBA'), or `none` (the paper's plain TB)",
    )
    clip_eps: float = Field(
        0.2, gt=0, description="ratio clip of tb's trust region, dr_grpo, grpo, proximal_rloo, "
        "ppo and vineppo"
    )
    log_z: Literal["vargrad", "learned"] = Field(
        "vargrad", description="tb: log Z(x) estimated per group (VarGrad, needs K >= 2) or "
        "learned with the policy (a linear head on the prompt's mean input embedding)",
    )
    log_z_lr: float = Field(1e-2, gt=0, description="Adam learning rate of a learned log Z")
    baseline_kl: Literal[BASELINE_KLS] = Field(  # type: ignore[valid-type]
        "current", description="log-probs in the baselines' KL-shaped reward r - beta KL: the "
        "`current` policy's (every baseline then targets TB's distribution off-policy too, and "
        "RLOO's gradient is TB's) or the `behaviour` policy's, fixed at sampling (TRL's RLOO)",
    )
    value_model: Literal["head", "critic"] = Field(
        "head", description="ppo: the critic is a linear head on the policy's last hidden "
        "state (the value loss also trains the policy's layers) or on a separate `critic` LM, "
        "a trainable copy of the starting policy (trained at train.learning_rate)",
    )
    value_lr: float = Field(1e-3, gt=0, description="ppo: Adam learning rate of the value head")
    gae_lambda: float = Field(
        0.95, ge=0, le=1, description="ppo: lambda of GAE (gamma is 1; 1: Monte Carlo returns)"
    )
    value_clip: float = Field(
        0.2, gt=0, description="ppo: the value loss's clip around the critic's values at the step"
    )
    value_coef: float = Field(0.1, ge=0, description="ppo: weight of the value loss")
    vineppo_rollouts: int = Field(
        9, ge=1, description="vineppo: continuations sampled per step prefix to estimate its value"
    )
    vineppo_max_states: int = Field(
        25, ge=1, description="vineppo: step prefixes per response at most, the prompt included "
        "(more steps: evenly spaced step ends kept)",
    )
    vineppo_delimiter: str = Field(
        "\n", min_length=1, description="vineppo: a step ends with the token whose text holds this",
    )
    max_steps: int | None = Field(
        None, ge=1, description="optimizer steps (null: no step limit); the run ends at the "
        "first limit reached: max_steps (or num_epochs), max_minutes or Ctrl-C",
    )
    num_epochs: float | None = Field(
        None, gt=0, description="passes over the training prompts: when set, the step limit is "
        "num_epochs * (training prompts) / num_prompts instead of max_steps",
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
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: less memory, ~30% "
        "more compute (each response then runs with its prompt instead of sharing its KV cache)",
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.samples_per_prompt is not None and self.samples_per_prompt < self.group_size:
            raise ValueError(
                f"samples_per_prompt ({self.samples_per_prompt}) must be >= group_size "
                f"({self.group_size})"
            )
        if self.group_size == 1 and (self.group_baseline != "generation"
                                     or (self.samples_per_prompt or 1) < 2
                                     or self.loss not in ROW_MEAN_GROUP_OBJECTIVES):  # fmt: skip
            raise ValueError("train.group_size=1 compares a response with nothing: use 2 or "
                             "more, or train.samples_per_prompt >= 2 with "
                             "train.group_baseline=generation and a loss with group statistics ("
                             + ", ".join(ROW_MEAN_GROUP_OBJECTIVES) + "): its generation's other "
                             "responses then make the group's statistics")  # fmt: skip
        if self.beta_start_frac > self.beta_end_frac:
            raise ValueError("beta_start_frac must be <= beta_end_frac")
        if self.max_steps is None and self.num_epochs is None and self.max_minutes is None:
            raise ValueError("a run needs a limit: set train.max_minutes, train.max_steps or "
                             "train.num_epochs")  # fmt: skip
        if self.max_steps is None and self.num_epochs is None:
            if self.lr_schedule != "constant":
                raise ValueError(f"train.lr_schedule={self.lr_schedule} decays over the run's "
                                 "steps: set train.max_steps or train.num_epochs")  # fmt: skip
            if self.warmup_ratio > 0 and self.warmup_steps == 0:
                raise ValueError("train.warmup_ratio is a share of the run's steps: set "
                                 "train.max_steps or train.num_epochs, or train.warmup_steps")
        return self


class LoraConfig(Section):
    """Low-rank adapters (`peft`): the trainer trains and the searchers receive only these; the
    reference policy is the base model with the adapter switched off."""

    r: int = Field(0, ge=0, description="adapter rank; 0 trains every weight (full fine-tuning)")
    alpha: float = Field(16.0, gt=0, description="adapter scale: updates are alpha / r * B A x")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: str | list[str] = Field(
        "all-linear", description="modules that get an adapter: `all-linear` (every linear "
        "layer but the output head), a list of module names, or a regex of full names",
    )


class QuantizationConfig(Section):
    """QLoRA: the base weights loaded quantized by bitsandbytes (`pip install bitsandbytes`), in
    the trainer and in every searcher, and frozen; LoRA adapters (lora.r > 0) train on them in
    fp32 and are all that moves to the searchers. Saved policies (final/, snapshots) are the
    base weights dequantized with the adapters merged in."""

    bits: Literal[0, 4, 8] = Field(
        0, description="0: full weights; 4 or 8: the base's linear layers (not the output head) "
        "in that many bits, computing in policy.dtype",
    )
    quant_type: Literal["nf4", "fp4"] = Field(
        "nf4", description="bits=4: NormalFloat (QLoRA's) or plain 4-bit floats"
    )
    double_quant: bool = Field(
        False, description="bits=4: also quantize the quantization constants (about 0.4 bits a "
        "weight less)",
    )


class BufferConfig(Section):
    capacity: int = Field(20000, ge=1, description="samples kept; oldest weight version evicted")
    per_prompt_capacity: int | None = Field(None, ge=1, description="samples kept per prompt")
    recent_prob: float = Field(
        1.0, ge=0, le=1, description="m: probability a group is made of fresh samples (never "
        "trained on, newest weights first); otherwise, or when none is left, a replay group",
    )
    reward_weight: float = Field(
        0.0, ge=0, le=1, description="replay: weight of softmax(r/T) against uniform"
    )
    reward_temperature: float = Field(1.0, gt=0, description="replay: T in softmax(r/T)")
    dedup: Literal["none", "exact", "near"] = Field(
        "none", description="a response that duplicates one of its prompt's (`exact`: same "
        "tokens; `near`: same set of tokens) replaces it if its reward is higher, else is dropped",
    )
    max_staleness: int | None = Field(
        None, ge=0, description="drop samples of weights published more than this many optimizer "
        "steps ago (the newest published weights are always kept)",
    )
    fresh_uses: int = Field(
        1, ge=1, description="times a sample is drawn as fresh before it is only replayed "
        "(TRL's num_iterations: each generation serves that many passes, the least-used "
        "samples first; in the synchronous mode with train.sync_generate=when_needed, a "
        "generation comes once they are used up)",
    )


class VllmConfig(Section):
    """vLLM as the searchers' engine (`searchers.engine=vllm`): one engine in each searcher
    process (docs/engines.md)."""

    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="share of the device's memory the engine takes for weights "
        "and KV cache (on vLLM's CPU backend: the share of RAM for the KV cache)",
    )
    kv_cache_gb: float | None = Field(
        None, gt=0, description="the KV cache's size in GiB, instead of a share of memory "
        "(default: the share on a GPU; 1 GiB on vLLM's CPU backend, where the share is of RAM "
        "less what the process already holds)",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="prompt + response tokens a sequence may hold (default: the "
        "model's own limit)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the engine's weights (`auto`: policy.dtype)"
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine spans")
    enforce_eager: bool = Field(
        False, description="no CUDA graphs (less start-up time and memory, slower decoding)"
    )


class SearchersConfig(Section):
    """The processes that generate and score samples (Ray actors)."""

    engine: Literal["builtin", "vllm"] = Field(
        "builtin", description="what searchers generate with: `builtin` (tba's KV-cache sampler; "
        "the faster on a CPU) or `vllm` (a vLLM engine in each searcher, for GPUs; `pip install "
        "'tba[vllm]'`)",
    )
    vllm: VllmConfig = VllmConfig()

    count: int = Field(
        1, ge=0, description="searcher processes; 0 runs one searcher inside the trainer "
        "process, without Ray (sync mode only)",
    )
    prompts_per_batch: int | None = Field(
        None, ge=1, description="prompts per generation batch of each searcher (async), or "
        "per generation in all (sync: one a step, or as train.sync_generate says) (default: B)",
    )
    temperature: float | None = Field(
        None, gt=0, description="sampling temperature of the searchers, for exploration "
        "(default: policy.temperature); the losses still take log-probs at policy.temperature",
    )
    max_unsent_samples: int = Field(
        4096, ge=1, description="async: a searcher pauses while this many of its samples "
        "wait for the trainer",
    )
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per searcher")
    num_gpus: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Ray GPUs reserved per searcher; `auto`: where a local Ray "
        "instance has a GPU to give, the searchers share the first with the trainer, 1 / "
        "(count + 1) each; else (no GPU, a cluster's ray.address, searchers.device=cpu) 0",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads per searcher (default: num_cpus, at least 1)"
    )
    device: Device = Field("auto", description="searcher device, as policy.device")
    max_restarts: int = Field(
        5, ge=0, description="restarts allowed per searcher before the run fails"
    )
    reward_timeout_s: float = Field(
        60.0, gt=0, description="a reward function call that takes longer fails: its "
        "completions are dropped and counted",
    )
    max_reward_failures: int = Field(
        5, ge=1, description="a reward function that fails on this many calls in a row stops "
        "the run",
    )


class TrainerConfig(Section):
    """Where the trainer runs: in this process (`world_size` 1), or as `world_size` processes
    that shard the policy, its gradients and Adam's state with FSDP2, placed by Ray on this
    machine or across a cluster (docs/sharding.md)."""

    world_size: int = Field(
        1, ge=1, description="trainer processes (ranks) sharding the policy; 1: this process "
        "holds all of it",
    )
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs reserved per rank")
    num_gpus: float = Field(
        0.0, ge=0, description="Ray GPUs reserved per rank: ranks with a GPU train on it "
        "(NCCL), the others on their CPU (gloo)",
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch threads per rank (default: its num_cpus)"
    )


class RayConfig(Section):
    address: str | None = Field(
        None, description="an existing Ray cluster to join (default: start a local instance "
        "on loopback and stop it at exit)",
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of the local instance (default: this machine's, and at "
        "least what the searchers reserve)",
    )
    sync_timeout_s: float = Field(
        120.0, gt=0, description="a searcher that does not answer a weight sync or a "
        "collection, or a trainer rank a step or a publish, within this many seconds fails "
        "the run",
    )
    start_timeout_s: float = Field(
        600.0, gt=0, description="a searcher process or trainer rank that is not up (its "
        "model loaded) within this many seconds fails the run",
    )


class CheckpointConfig(Section):
    """Checkpoints in <run_dir>/checkpoints/: policy, optimizer, schedule, replay buffer, RNG
    states and searcher positions, enough for `tba train --resume RUN_DIR`."""

    every: int | None = Field(None, ge=1, description="save every N optimizer steps")
    every_minutes: float | None = Field(
        5.0, gt=0, description="save every N minutes of training (a checkpoint is also saved "
        "at exit, whatever these two say)",
    )
    keep: int = Field(2, ge=1, description="newest checkpoints kept; older ones are deleted")


class EvalConfig(Section):
    """Held-out evaluation: at the start and the end of a run, and on the way every
    `every_minutes` of training, or every `every` optimizer steps when that is set."""

    every: int | None = Field(
        None, ge=1, description="evaluate held-out greedy pass@1 every N optimizer steps "
        "(instead of every_minutes)",
    )
    every_minutes: float | None = Field(
        0.5, gt=0, description="evaluate held-out greedy pass@1 every N minutes of training, "
        "when eval.every is null (a run of a given length is evaluated as often on a CPU as on "
        "a GPU; null: only at the start and the end)",
    )
    pass_k: int = Field(16, ge=1, description="k of the pass@k reported at start and end")
    batch_size: int = Field(
        256, ge=1, description="prompts generated at once in greedy pass@1 (pass@k: twice as "
        "many sequences)",
    )
    snapshot_minutes: float | None = Field(
        None, gt=0, description="also save the policy every N minutes of training to "
        "snapshots/, to evaluate after the run without pausing it",
    )


class RunConfig(Section):
    seed: int = Field(0, description="seeds data order, sampling and the base policy")
    output_dir: str | None = Field(None, description="run directory (default: runs/<timestamp>)")
    policy: PolicyConfig = PolicyConfig()
    pretrain: PretrainConfig = PretrainConfig()
    task: TaskConfig = TaskConfig()
    train: TrainConfig = TrainConfig()
    lora: LoraConfig = LoraConfig()
    quantization: QuantizationConfig = QuantizationConfig()
    buffer: BufferConfig = BufferConfig()
    searchers: SearchersConfig = SearchersConfig()
    trainer: TrainerConfig = TrainerConfig()
    ray: RayConfig = RayConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log_completions: bool = Field(
        False, description="write every new sample's prompt, completion, reward and reward "
        "parts to RUN_DIR/completions.jsonl",
    )
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        [], description="also log metrics to these (`tensorboard`: event files in "
        "RUN_DIR/tensorboard, needs `pip install tensorboard`; `wandb`: a Weights & Biases run "
        "named after the run directory, files in RUN_DIR/wandb, project `WANDB_PROJECT` or "
        "`tba`, needs `pip install wandb`; `trackio`: a Trackio run named after the run "
        "directory, in Trackio's local store, project `TRACKIO_PROJECT` or `tba`, needs "
        "`pip install trackio`)",
    )

    @model_validator(mode="after")
    def _check_runtime(self) -> RunConfig:
        if self.train.mode == "async" and self.searchers.count == 0:
            raise ValueError("searchers.count=0 (in-process searcher) needs train.mode=sync")
        ranks = self.trainer.world_size
        if ranks > 1 and self.lora.r > 0:
            raise ValueError("trainer.world_size > 1 shards full fine-tuning; LoRA (lora.r > 0) "
                             "trains on one rank: set trainer.world_size=1")  # fmt: skip
        if ranks > self.train.num_prompts:
            raise ValueError(f"trainer.world_size={ranks} needs train.num_prompts >= {ranks}: "
                             "every rank trains on whole groups")  # fmt: skip
        if self.train.group_baseline == "generation" and ranks > 1:
            raise ValueError("train.group_baseline=generation runs its extra forward passes on "
                             "one trainer process: set trainer.world_size=1, or "
                             "train.group_baseline=trained")  # fmt: skip
        if self.quantization.bits and self.searchers.engine == "vllm":
            raise ValueError(f"quantization.bits={self.quantization.bits}: the searchers' vLLM "
                             "engine takes full weights; use searchers.engine=builtin, or "
                             "quantization.bits=0")  # fmt: skip
        if self.train.loss == "ppo" and ranks > 1:
            raise ValueError("train.loss=ppo trains on one rank (its critic is not sharded): set "
                             "trainer.world_size=1")  # fmt: skip
        if self.train.loss == "ppo" and self.train.value_model == "critic" and self.lora.r > 0:
            raise ValueError("train.value_model=critic copies the whole policy; with LoRA "
                             "(lora.r > 0) use train.value_model=head")  # fmt: skip
        self._check_searcher_devices()
        return self

    def _check_searcher_devices(self) -> None:
        """Ray shows a searcher process only the GPUs it reserves (`searchers.num_gpus`), as
        cuda:0 upwards: a CUDA device it is not given cannot be there, on any machine."""
        if self.searchers.count == 0:
            return
        # `auto` gives a share of one GPU where there is one (`searcher_gpus`): cuda:0 at most;
        # where there is none, the run's start says so (`tba.policy.model.check_devices`).
        gpus = self.searchers.num_gpus
        check_searcher_devices(self, 1 if gpus == "auto" else gpus)


def check_searcher_devices(config: RunConfig, num_gpus: float, why: str = "") -> None:
    """ValueError unless the searchers' and reward models' CUDA devices are among the
    `num_gpus` (rounded up) that Ray shows each searcher process; `why`: how `auto` came to
    that number."""
    visible = math.ceil(num_gpus)
    for key, device in (("searchers.device", config.searchers.device),
                        ("task.reward_device", config.task.reward_device)):  # fmt: skip
        index = cuda_index(device)
        if index is None:
            continue
        if visible == 0:
            raise ValueError(f"{key}={device} needs searchers.num_gpus > 0{why}: Ray shows a "
                             "searcher process only the GPUs it reserves (or set "
                             f"{key}=cpu)")  # fmt: skip
        if index >= visible:
            seen = "cuda:0" if visible == 1 else f"cuda:0 to cuda:{visible - 1}"
            raise ValueError(f"{key}={device}: a searcher sees only the GPUs it reserves "
                             f"(searchers.num_gpus={num_gpus:g}), as {seen}")  # fmt: skip


# ---------------------------------------------------------------------------- loading


# Defaults that differ per task, applied where the file and the overrides leave a key unset.
TASK_PRESETS: dict[str, dict[str, Any]] = {
    # The embedded math task and the paper's: a response cut off at the length limit has no
    # answer line, and gets the truncation penalty rather than the verifier's guess.
    "math": {"train.truncated": "penalize"},
    "gsm8k": {"train.truncated": "penalize"},
    "competition_math": {"train.truncated": "penalize"},
    # The paper's non-EOS penalty for summaries.
    "tldr": {"train.truncated": "penalize"},
    "redteam": {
        "train.truncated": "penalize",
        "policy.model": "builtin:redteam",
        "policy.max_new_tokens": 12,
        "train.num_prompts": 4,
        "train.group_size": 32,
        # The attacker is far from its target after 1,000 steps at lr 1e-4 (KL 3-6 nats); at 1e-3
        # it gets within 0.3. Beta 0.3: the target's ASR is 93.5% over ~7.7 modes (0.1: 98.6%, 7.3).
        "train.learning_rate": 1e-3,
        "train.beta": 0.3,
        "train.max_steps": 2500,  # ~5 minutes on 2 CPU cores
        "eval.every": 25,  # a run of a fixed number of steps: evaluations counted in steps
        # A learned log Z kept more modes and diversity than VarGrad at the same ASR (3 seeds).
        "train.log_z": "learned",
        # Most groups are reward-prioritised replays thousands of steps old: TB learns from them
        # off-policy, a trust region against their behaviour policy clips them.
        "train.trust_region": "none",
        "buffer.recent_prob": 0.5,
        "buffer.reward_weight": 1.0,
        "buffer.dedup": "near",
        "task.num_eval": 512,
    },
    "summarize": {
        "train.truncated": "penalize",  # the paper's non-EOS penalty
        "policy.model": "builtin:summarize",
        "policy.max_new_tokens": 24,  # the world's longest reference is 20 words
        "train.learning_rate": 1e-4,
        # Lower betas over-optimise the proxy within minutes: win rate peaks, then falls.
        "train.beta": 0.5,
        # The paper's TL;DR settings: k = 10 steps between syncs, half the groups fresh, the
        # other half replayed by reward.
        "train.sync_every": 10,
        "buffer.recent_prob": 0.5,
        "buffer.reward_weight": 1.0,
        "task.num_eval": 512,
        "train.max_steps": 1000,  # 2.5 to 2.75 minutes on 2 CPU cores
        "eval.every": 100,  # each evaluation writes 1,024 summaries (greedy and sampled)
    },
}


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Defaults (the task's own where `TASK_PRESETS` has some), then the YAML file (if any), then
    `a.b=value` overrides (values parsed as YAML)."""
    data = apply_overrides(_read_yaml(Path(path)) if path is not None else {}, overrides)
    _check_sections(data)
    task = data.get("task", {}).get("name") if isinstance(data.get("task"), dict) else None
    for key, value in TASK_PRESETS.get(task or TaskConfig().name, {}).items():
        if not _has_nested(data, key):
            _set_nested(data, key, value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(first_error_line(error)) from None


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """`data` (nested settings) with `a.b=value` strings applied in order (values parsed as
    YAML)."""
    for override in overrides:
        key, value = _parse_override(override)
        _set_nested(data, key, value)
    return data


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-4` as a string; read it as the float every user means. A key given twice
    in one mapping (a second `train:` section, a setting repeated) is an error, not a silent
    replacement of the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (first on line {seen[key] + 1})",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _parse_yaml(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(error, "problem", error)
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    return data


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like key=value (e.g. train.beta=0.05)")
    try:
        value = _parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _set_nested(data: dict[str, Any], dotted_key: str, value: Any) -> None:
    *parents, leaf = dotted_key.split(".")
    node = data
    for number, part in enumerate(parents, start=1):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            section = ".".join(parents[:number])
            if _section_fields(section):  # a section the file left empty, or gave a value
                raise ConfigError(section_message(section, child))
            raise ConfigError(f"{dotted_key}: {part} is a value, not a section")
        node = child
    node[leaf] = value


def _check_sections(
    data: dict[str, Any], model: type[BaseModel] | None = None, prefix: str = ""
) -> None:
    """Every section given (`train`, `task.redteam`, ...) is a mapping of settings: one that is
    a value or empty is named as the user wrote it, before defaults are filled in under it."""
    for name, field in (model or RunConfig).model_fields.items():
        if _is_section(field) and name in data:
            if not isinstance(data[name], dict):
                raise ConfigError(section_message(prefix + name, data[name]))
            _check_sections(data[name], field.annotation, f"{prefix}{name}.")


def section_message(key: str, value: Any) -> str:
    """What to say of a section given something other than a mapping of settings."""
    if value is None:
        return (f"{key} is empty: a section needs settings under it ({key}.KEY: value), none "
                "are given (all commented out?); remove the section or give it a setting")
    return (f"{key} is a section of settings, not a value (got {value!r:.40}): set its keys, "
            f"e.g. {key}.{next(iter(_section_fields(key)), 'KEY')}=...")


def _has_nested(data: dict[str, Any], dotted_key: str) -> bool:
    node: Any = data
    for part in dotted_key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def first_error_line(error: ValidationError) -> str:
    """One line: the dotted key, what is wrong, and what was given."""
    first = error.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        parent = ".".join(str(part) for part in first["loc"][:-1])
        allowed = sorted(_section_fields(parent))
        return f"unknown config key {key!r}; allowed here: {', '.join(allowed)}"
    message = first["msg"].removeprefix("Value error, ")
    given = first.get("input")
    if first["type"] == "model_type" and not isinstance(given, dict):  # a section, given a value
        return section_message(key, given)
    shown = "" if isinstance(given, dict) else f" (got {given!r})"
    return f"invalid value for {key}: {message}{shown}"


def _section_fields(dotted: str) -> list[str]:
    """The settings of the section `dotted` ("" the top level); none if it is no section."""
    model: type[BaseModel] = RunConfig
    for part in filter(None, dotted.split(".")):
        if part not in model.model_fields:
            return []
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(), sort_keys=False)


def reference_table(model: type[BaseModel] = RunConfig, prefix: str = "") -> str:
    """Every setting as a Markdown table row: `| key | default | meaning |`."""
    rows = []
    for name, field in model.model_fields.items():
        if _is_section(field):
            rows.append(reference_table(field.annotation, f"{prefix}{name}."))
        else:
            rows.append(_reference_row(f"{prefix}{name}", field))
    return "\n".join(rows)


def reference_page() -> str:
    """docs/configuration.md: every setting by section, with its default and meaning, and the
    defaults each task changes (`TASK_PRESETS`)."""
    header = "| key | default | meaning |\n|---|---|---|"
    fields = RunConfig.model_fields
    parts = [
        "# Configuration reference",
        "",
        "Every setting of a run, its default and its meaning. Generated from the code by "
        "`tba config --reference > docs/configuration.md`; a test keeps it current.",
        "",
        "A run is configured by a YAML file (`tba train CONFIG.yaml`) and `section.key=value` "
        "overrides (values parsed as YAML), on top of these defaults; `tba config [CONFIG.yaml] "
        "[key=value ...]` prints the resolved configuration. Every value is typed and checked: "
        "an unknown key, a wrong type or a value out of range is one line naming the key and "
        "what is allowed.",
        "",
        "## Top level",
        "",
        header,
        *(_reference_row(name, f) for name, f in fields.items() if not _is_section(f)),
    ]
    for name, field in fields.items():
        if _is_section(field):
            doc = field.annotation.__doc__
            parts += ["", f"## `{name}`", ""]
            if doc and doc != Section.__doc__:
                parts += [" ".join(doc.split()), ""]
            parts += [header, reference_table(field.annotation, f"{name}.")]
    parts += ["", "## Task presets", "", "Defaults a task changes, where the file and the "
              "overrides leave a key unset:", ""]  # fmt: skip
    for task, preset in TASK_PRESETS.items():
        settings = ", ".join(f"`{key}={value}`" for key, value in preset.items())
        parts.append(f"- `task.name={task}`: {settings}")
    return "\n".join(parts) + "\n"


def _reference_row(key: str, field) -> str:
    default = "null" if field.default is None else field.default
    if isinstance(default, str):  # a newline shown as `\n`, not as a break in the table
        default = default.encode("unicode_escape").decode()
    return f"| `{key}` | `{default}` | {field.description or ''} |"


def _is_section(field) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
