"""TRL's GRPOConfig arguments in `TBAConfig` (`tba.trl_args`): every mapped argument sets the tba
setting it means, at TRL's default and at another value; TRL's batch semantics; TRL's defaults
where a script sets nothing; every GRPOConfig argument of TRL 1.x is mapped, accepted without
effect or refused with a reason; and an error names what the script wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BitsAndBytesConfig

from tba import TBAConfig
from tba.config import load_config
from tba.errors import ConfigError
from tba.limits import step_limit
from tba.trl_args import TRL_ARGUMENTS, TRL_DEFAULTS, Ignored, Mapped, Refused, reference_page

ROOT = Path(__file__).resolve().parents[1]

# Every field of TRL 1.16's GRPOConfig (its own and transformers' TrainingArguments'), as
# `dataclasses.fields(GRPOConfig)` lists them.
GRPO_CONFIG_FIELDS = """
output_dir per_device_train_batch_size num_train_epochs max_steps learning_rate
lr_scheduler_type lr_scheduler_kwargs warmup_steps optim optim_args weight_decay adam_beta1
adam_beta2 adam_epsilon optim_target_modules gradient_accumulation_steps
average_tokens_across_devices max_grad_norm label_smoothing_factor bf16 fp16 bf16_full_eval
fp16_full_eval tf32 activation_checkpointing activation_checkpointing_kwargs
gradient_checkpointing gradient_checkpointing_kwargs torch_compile torch_compile_backend
torch_compile_mode use_liger_kernel liger_kernel_config use_cache neftune_noise_alpha
torch_empty_cache_steps auto_find_batch_size logging_strategy logging_steps logging_first_step
log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen log_level
log_level_replica disable_tqdm report_to run_name project trackio_space_id trackio_bucket_id
trackio_static_space_id eval_strategy eval_steps eval_delay per_device_eval_batch_size
prediction_loss_only eval_on_start eval_do_concat_batches eval_use_gather_object
eval_accumulation_steps include_for_metrics batch_eval_metrics save_only_model save_strategy
save_steps save_on_each_node save_total_limit enable_jit_checkpoint push_to_hub hub_token
hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision load_best_model_at_end
metric_for_best_model greater_is_better ignore_data_skip
restore_callback_states_from_checkpoint full_determinism seed data_seed use_cpu
accelerator_config parallelism_config dataloader_drop_last dataloader_num_workers
dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor
dataloader_multiprocessing_context dataloader_in_order remove_unused_columns label_names
train_sampling_strategy length_column_name ddp_find_unused_parameters ddp_bucket_cap_mb
ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout fsdp fsdp_config deepspeed
debug skip_memory_metrics do_train do_eval do_predict resume_from_checkpoint local_rank
model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32
num_generations num_generations_eval max_completion_length ds3_gather_for_generation
shuffle_dataset pad_to_multiple_of generation_batch_size steps_per_generation temperature
top_p top_k min_p generation_kwargs chat_template_kwargs repetition_penalty
cache_implementation use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode
vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port
vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length
vllm_tensor_parallel_size beta num_iterations epsilon delta epsilon_high sapo_temperature_neg
sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg
importance_sampling_level reward_weights multi_objective_aggregation scale_rewards loss_type
mask_truncated_completions sync_ref_model ref_model_mixup_alpha ref_model_sync_steps
top_entropy_quantile entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max
entropy_coef_delta entropy_target max_tool_calling_iterations
vllm_importance_sampling_correction vllm_importance_sampling_mode
vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min off_policy_mask_threshold
use_bias_correction_kl log_completions log_multimodal num_completions_to_print
log_unique_prompts log_completions_hub_repo use_transformers_continuous_batching
transformers_continuous_batching_config use_transformers_paged vllm_importance_sampling_cap
"""
GRPO_CONFIG_FIELDS = GRPO_CONFIG_FIELDS.split()  # noqa: SIM905 - a list of 191 names


def setting(config: TBAConfig, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


# Every mapped argument at a value other than TRL's default, and the tba settings it gives.
MAPPED = {
    "output_dir": ("out", {"output_dir": "out"}),
    "seed": (7, {"seed": 7}),
    "learning_rate": (3e-5, {"train.learning_rate": 3e-5}),
    "max_steps": (12, {"train.max_steps": 12, "train.max_minutes": None}),
    "num_train_epochs": (2, {"train.num_epochs": 2.0, "train.max_minutes": None}),
    "warmup_steps": (5, {"train.warmup_steps": 5, "train.warmup_ratio": 0.0}),
    "warmup_ratio": (0.1, {"train.warmup_ratio": 0.1, "train.warmup_steps": 0}),
    "lr_scheduler_type": ("cosine", {"train.lr_schedule": "cosine"}),
    "weight_decay": (0.01, {"train.weight_decay": 0.01}),
    "max_grad_norm": (0.5, {"train.max_grad_norm": 0.5}),
    "optim": ("adamw_bnb_8bit", {"train.optimizer": "adamw_8bit"}),
    "gradient_checkpointing": (False, {"train.gradient_checkpointing": False}),
    "activation_checkpointing": (False, {"train.gradient_checkpointing": False}),
    "beta": (0.04, {"train.beta": 0.04}),
    "epsilon": (0.3, {"train.clip_eps": 0.3}),
    "per_device_train_batch_size": (16, {"train.num_prompts": 2, "train.group_size": 8}),
    "gradient_accumulation_steps": (4, {"train.num_prompts": 4, "train.micro_batch_groups": 1}),
    "num_generations": (4, {"train.group_size": 4, "train.num_prompts": 2}),
    "generation_batch_size": (16, {"searchers.prompts_per_batch": 2, "train.num_prompts": 1}),
    "steps_per_generation": (3, {"searchers.prompts_per_batch": 3, "train.num_prompts": 1}),
    "num_iterations": (2, {"buffer.fresh_uses": 2}),
    "max_completion_length": (64, {"policy.max_new_tokens": 64}),
    "max_prompt_length": (128, {"policy.max_prompt_length": 128}),
    "temperature": (0.7, {"policy.temperature": 0.7}),
    "use_vllm": (True, {"searchers.engine.type": "vllm"}),
    "vllm_gpu_memory_utilization": (0.5, {"searchers.engine.gpu_memory_utilization": 0.5}),
    "vllm_tensor_parallel_size": (2, {"searchers.engine.tensor_parallel_size": 2}),
    "vllm_max_model_length": (2048, {"searchers.engine.max_model_len": 2048}),
    "bf16": (True, {"policy.dtype": "bfloat16"}),
    "use_cpu": (True, {"policy.device": "cpu", "searchers.device": "cpu",
                       "task.reward_device": "cpu"}),
    "no_cuda": (True, {"policy.device": "cpu", "searchers.device": "cpu"}),
    "model_init_kwargs": ({"dtype": "bfloat16", "attn_implementation": "sdpa",
                           "quantization_config": BitsAndBytesConfig(load_in_8bit=True)},
                          {"policy.dtype": "bfloat16", "quantization.bits": 8}),
    "reward_weights": ([1.0, 0.5], {"task.reward_weights": [1.0, 0.5]}),
    "mask_truncated_completions": (True, {"train.truncated": "drop"}),
    "report_to": ("tensorboard", {"report_to": ["tensorboard"]}),
    "log_completions": (True, {"log_completions": True}),
    "save_steps": (10, {"checkpoint.every": 10}),
    "save_total_limit": (3, {"checkpoint.keep": 3}),
    "eval_steps": (20, {"eval.every": 20}),
    "push_to_hub": (True, {"_hub": {"push": True}}),
    "hub_model_id": ("me/policy", {"_hub": {"model_id": "me/policy"}}),
    "hub_token": ("hf_x", {"_hub": {"token": "hf_x"}}),
    "hub_private_repo": (True, {"_hub": {"private": True}}),
    "hub_revision": ("v1", {"_hub": {"revision": "v1"}}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MAPPED))
def test_a_mapped_argument_sets_the_tba_setting_it_means(name):
    value, expected = MAPPED[name]
    entry = TRL_ARGUMENTS[name]
    alongside = {entry.only_with: True} if entry.only_with else {}  # use_vllm for vLLM's
    config = TBAConfig(**{name: value}, **alongside)
    for dotted, wanted in expected.items():
        got = config._hub if dotted == "_hub" else setting(config, dotted)
        assert got == wanted, (name, dotted)
    if name in TRL_DEFAULTS:  # and at TRL's default, the tba setting TRL's default gives
        assert TBAConfig(**{name: TRL_DEFAULTS[name]}).model_dump() == TBAConfig().model_dump()


def test_vllms_settings_take_effect_with_use_vllm_alone_as_in_trl():
    """Without use_vllm=True, TRL generates without vLLM and its vLLM settings do nothing: so
    here, where they are named among the arguments without effect (not an error for the
    built-in engine, which has no such settings)."""
    config = TBAConfig(vllm_gpu_memory_utilization=0.5, vllm_max_model_length=64)
    assert config.searchers.engine.type == "builtin"
    assert config._trl.ignored == ["vllm_gpu_memory_utilization=0.5 (without use_vllm=True)",
                                   "vllm_max_model_length=64 (without use_vllm=True)"]
    off = TBAConfig(use_vllm=False, vllm_tensor_parallel_size=2)
    assert off.searchers.engine.type == "builtin"
    on = TBAConfig(use_vllm=True, vllm_tensor_parallel_size=2).searchers.engine
    assert on.type == "vllm" and on.tensor_parallel_size == 2 and on.gpu_memory_utilization == 0.3


def test_every_mapped_argument_is_tested_and_every_grpo_config_field_is_known():
    assert {n for n, e in TRL_ARGUMENTS.items() if isinstance(e, Mapped)} == set(MAPPED)
    assert [name for name in GRPO_CONFIG_FIELDS if name not in TRL_ARGUMENTS] == []
    kinds = {type(entry) for entry in TRL_ARGUMENTS.values()}
    assert kinds == {Mapped, Ignored, Refused}


def test_the_lr_schedule_and_weight_decay_of_a_trl_snippet():
    """The GRPOConfig snippet of TRL's docs that stopped with a key the user never wrote."""
    config = TBAConfig(lr_scheduler_type="cosine", warmup_ratio=0.1, weight_decay=0.01,
                       learning_rate=1e-5)  # fmt: skip
    train = config.train
    assert (train.lr_schedule, train.warmup_ratio, train.weight_decay) == ("cosine", 0.1, 0.01)
    assert TBAConfig(lr_scheduler_type="constant_with_warmup").train.lr_schedule == "constant"
    assert TBAConfig(warmup_steps=0.05).train.warmup_ratio == 0.05  # transformers 5's ratio


# ------------------------------------------------------------------------------------ batches


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        # TRL's defaults: 8 completions a pass, 1 pass, 8 a prompt: one group a step.
        ({}, (8, None, 1, None, 1)),
        # The cookbook: 8 a pass, 16 passes, 4 a prompt: 32 groups, 2 a pass.
        ({"gradient_accumulation_steps": 16, "num_generations": 4}, (4, None, 32, 2, 32)),
        # LoRA Without Regret: 1 a pass, 4 passes, generations of 8 completions of one prompt:
        # half a prompt's completions a step, the other half at the next.
        ({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4,
          "num_generations": 8, "generation_batch_size": 8}, (4, 8, 1, None, 1)),
        # 12 completions a step of prompts of 8: groups of 4, three a step.
        ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3,
          "num_generations": 8, "generation_batch_size": 24}, (4, 8, 3, 1, 3)),
        # A generation for two steps.
        ({"per_device_train_batch_size": 8, "steps_per_generation": 2}, (8, None, 1, None, 2)),
        # 3 completions a pass, prompts of 8, no common factor: single completions, three a
        # step, their statistics from their generation's 8.
        ({"per_device_train_batch_size": 3, "num_generations": 8, "generation_batch_size": 24},
         (1, 8, 3, None, 3)),
        ({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 3,
          "num_generations": 8, "steps_per_generation": 8}, (1, 8, 3, 1, 1)),
    ],
)  # fmt: skip
def test_trls_batches_as_tbas(arguments, expected):
    config = TBAConfig(**arguments)
    train = config.train
    assert (train.group_size, train.samples_per_prompt, train.num_prompts,
            train.micro_batch_groups, config.searchers.prompts_per_batch) == expected
    # As many completions a step as TRL: per_device_train_batch_size * gradient_accumulation.
    completions = (arguments.get("per_device_train_batch_size", 8)
                   * arguments.get("gradient_accumulation_steps", 1))  # fmt: skip
    assert train.num_prompts * train.group_size == completions
    assert train.sync_generate == "when_needed"  # no replayed group in the synchronous mode
    # A group split across steps keeps all of its completions in its statistics, as TRL's.
    split = train.samples_per_prompt is not None
    assert train.group_baseline == ("generation" if split else "trained")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_generations": 3}, "generation_batch_size=8 (per_device_train_batch_size"),
        ({"per_device_train_batch_size": 1, "num_generations": 8},
         "must be a multiple of num_generations=8"),
        ({"generation_batch_size": 16, "steps_per_generation": 2}, "set one of them"),
        ({"generation_batch_size": 12}, "multiple of per_device_train_batch_size=8"),
        ({"num_generations": 1}, "num_generations=1: a group needs 2 or more"),
    ],
)  # fmt: skip
def test_batches_trl_refuses_are_refused_in_one_line(arguments, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as error:
        TBAConfig(**arguments)
    assert "\n" not in str(error.value)


def test_groups_split_across_steps_train_on_one_process():
    """Their statistics' extra forward passes would put sharded ranks out of step."""
    with pytest.raises(ConfigError, match="train.group_baseline=generation runs its extra"):
        load_config(None, ["train.group_baseline=generation", "trainer.world_size=2"])


# ------------------------------------------------------------------------------ TRL's defaults


def test_a_config_starts_from_trls_defaults_where_the_script_sets_nothing():
    config = TBAConfig()
    assert config.policy.max_new_tokens == 512 and config.train.learning_rate == 1e-6
    assert (config.train.num_epochs, config.train.max_steps, config.train.max_minutes) == (
        3.0, None, None)  # fmt: skip
    assert (config.train.group_size, config.train.num_prompts) == (8, 1)
    assert config.train.lr_schedule == "linear" and config.seed == 42
    # Set by TRL's name, or in tba's sections: the script's value.
    assert TBAConfig(max_completion_length=32).policy.max_new_tokens == 32
    mine = TBAConfig(policy={"max_new_tokens": 24}, train={"max_steps": 5, "num_prompts": 2})
    assert mine.policy.max_new_tokens == 24
    assert (mine.train.max_steps, mine.train.num_epochs, mine.train.max_minutes) == (5, None, 10.0)
    assert (mine.train.num_prompts, mine.train.group_size) == (2, 16)  # tba's batch, whole
    # A run's length set in tba's sections: TRL's linear decay over its epochs does not apply.
    assert mine.train.lr_schedule == "constant"
    assert TBAConfig(train={"max_minutes": 5.0}).train.num_epochs is None
    # As in TRL, a step limit wins over the epochs (`tests/test_step_limit.py`).
    assert step_limit(TBAConfig(max_steps=5, num_train_epochs=3).train, 1000) == 5
    # tba's own ways start from tba's defaults; the embedded tasks keep their presets.
    assert TBAConfig.from_overrides().policy.max_new_tokens == 40
    assert load_config(None, ["task.name=redteam"]).policy.max_new_tokens == 12


def test_tba_overrides_win_over_the_script_and_its_epochs(monkeypatch):
    monkeypatch.setenv("TBA_OVERRIDES", "train.mode=sync searchers.count=0 train.beta=0.2 "
                       "train.max_steps=3")  # fmt: skip
    config = TBAConfig(beta=0.1, num_train_epochs=1)
    assert (config.train.mode, config.searchers.count, config.train.beta) == ("sync", 0, 0.2)
    assert step_limit(config.train, 1000) == 3


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"beta": 0.0}, "beta=0.0: TB needs beta > 0"),
        ({"learning_rate": -1.0}, "learning_rate=-1.0: Input should be greater than 0"),
        ({"max_completion_length": 2.5}, "max_completion_length=2.5: Input should be a valid"),
        ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type='polynomial': tba's"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1: Input should be greater than or equal"),
        ({"warmup_ratio": 1.5}, "warmup_ratio=1.5: Input should be less than 1"),
        ({"top_p": 0.9}, "top_p=0.9 has no tba equivalent: nucleus sampling"),
        ({"fp16": True}, "fp16=True has no tba equivalent: use bf16=True"),
        ({"report_to": "mlflow"}, "report_to='mlflow': tba reports to tensorboard, wandb, trackio"),
        ({"lr_scheduler": 1}, "unknown setting 'lr_scheduler': not a tba section nor a GRPOConfig"),
        ({"model_init_kwargs": {"quantization_config": object()}},
         "model_init_kwargs=.*a BitsAndBytesConfig .or its dict. is what tba takes"),
        ({"model_init_kwargs": {"quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, llm_int8_skip_modules=["q_proj"])}},
         "model_init_kwargs=.*with llm_int8_skip_modules=\\['q_proj'\\]: tba takes 4 or 8"),
        ({"model_init_kwargs": {"quantization_config": {"quant_method": "gptq", "bits": 4}}},
         "quant_method=gptq: tba quantizes with bitsandbytes"),
        ({"learning_rate": 1e-5, "train": {"learning_rate": 1e-4}},
         "train.learning_rate is set twice: by learning_rate=1e-05 and in train"),
        ({"train": {"beta": -1}}, "invalid value for train.beta: Input should be greater than 0"),
    ],
)  # fmt: skip
def test_an_error_names_what_the_script_wrote_in_one_line(arguments, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as error:
        TBAConfig(**arguments)
    assert "\n" not in str(error.value)
    name = next(iter(arguments))  # the setting as the script wrote it
    assert name in str(error.value)
    if name != "train":  # never only a key of tba's that the script did not write
        assert not str(error.value).startswith(("invalid value for", "unknown config key"))


@pytest.mark.parametrize(
    ("quantization", "expected"),
    [
        (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16),
         ({"bits": 4, "quant_type": "nf4", "double_quant": True}, "bfloat16")),
        (BitsAndBytesConfig(load_in_4bit=True),  # bitsandbytes' own defaults: fp4, float32
         ({"bits": 4, "quant_type": "fp4", "double_quant": False}, "float32")),
        ({"load_in_8bit": True, "quant_method": "bitsandbytes"},  # no dtype named: tba's auto
         ({"bits": 8, "quant_type": "nf4", "double_quant": False}, "auto")),
    ],
)  # fmt: skip
def test_a_bitsandbytes_quantization_config_is_tbas_quantization(quantization, expected):
    """QLoRA's model_init_kwargs: the quantization section, its 4-bit compute dtype as the
    policy's dtype, unless the script's dtype says otherwise."""
    config = TBAConfig(model_init_kwargs={"quantization_config": quantization})
    assert (config.quantization.model_dump(), config.policy.dtype) == expected
    typed = TBAConfig(model_init_kwargs={"quantization_config": quantization, "dtype": "float32"})
    assert typed.policy.dtype == "float32"


def test_trackio_is_reported_to_when_installed(monkeypatch):
    monkeypatch.setattr("tba.trl_args.converters._installed", lambda name: name != "trackio")
    with pytest.raises(ConfigError, match=r"report_to='trackio': needs `pip install trackio`"):
        TBAConfig(report_to="trackio")
    monkeypatch.setattr("tba.trl_args.converters._installed", lambda name: True)
    assert TBAConfig(report_to=["trackio", "none"]).report_to == ["trackio"]
    assert TBAConfig(report_to="all").report_to == ["tensorboard", "wandb", "trackio"]


def test_every_trl_argument_is_documented():
    assert (ROOT / "docs" / "trl.md").read_text() == reference_page(), (
        "docs/trl.md is out of date: `tba config --trl > docs/trl.md`"
    )
