"""The argument table: every argument of TRL's `GRPOConfig` (its own and transformers'
`TrainingArguments`', TRL 1.x, and the older names scripts still use), and what it is in tba.

Each is mapped (the tba settings it means; the batch arguments together, `tba.trl_args.batches`),
without effect (only the Hugging Face Trainer's plumbing, or GRPO's own loss, which tba replaces
by TB), or refused unless left at its default (it would change what is trained and tba cannot do
it). `TRL_DEFAULTS` are GRPOConfig's own defaults of the mapped arguments: a `TBAConfig` starts
from them, as a `GRPOConfig` does. docs/trl.md is this table (`tba.trl_args.reference`).
"""

from __future__ import annotations

from typing import Any

from tba.trl_args.batches import BATCH_ARGUMENTS, BATCH_KEYS
from tba.trl_args.converters import (
    MODEL_PLUMBING,
    bf16,
    cpu,
    epochs,
    max_steps,
    model_init,
    optimizer,
    report_to,
    schedule,
    truncated,
    warmup_steps,
)
from tba.trl_args.kinds import Ignored, Mapped, Refused, hub, none_or_empty, same, to

# The batch arguments' one entry: `from_trl` reads them together (`batch_settings`).
BATCH = Mapped(BATCH_KEYS, lambda value: {}, "the batch arguments together (Batches, above)")

_LOGGING = "TRL's logging: tba logs every step to metrics.jsonl (and report_to)"
_HUB = "tba uploads once, when `trainer.push_to_hub()` or `push_to_hub=True` asks"
_GRPO = "a setting of GRPO's loss: tba trains with train.loss (default TB)"
_DATA = "TRL's data loading: tba's searchers read the rows themselves"
_SAVE = "TRL's saving: tba checkpoints every checkpoint.every steps or checkpoint.every_minutes"
_EVAL = "TRL's evaluation loop: tba evaluates every eval.every steps"
_DEVICES = "how the Hugging Face Trainer spreads work over devices: tba places its own processes"
_SPEED = "speed or memory of the Hugging Face Trainer's own passes, not what is trained"
_VLLM = ("tba's vLLM engines run inside its searcher processes, neither as a server nor beside "
         "the trainer (docs/engines.md)")
_SAMPLING = "TB's behaviour log-probs are those of plain sampling at policy.temperature"
_ADAM = "tba's optimizer is AdamW with its own betas and epsilon"


def _vllm(setting: str) -> Mapped:
    """One of the vLLM engine's settings (`searchers.engine.<setting>`): as in TRL, it takes
    effect with `use_vllm=True` alone."""
    key = f"searchers.engine.{setting}"
    return Mapped(key, to(key).convert, "with use_vllm=True (without it, no effect, as in TRL)",
                  only_with="use_vllm")


TRL_ARGUMENTS: dict[str, Mapped | Ignored | Refused] = {
    # What is trained, and how long.
    "output_dir": to("output_dir"),
    "seed": to("seed"),
    "learning_rate": to("train.learning_rate"),
    "max_steps": Mapped("train.max_steps, train.max_minutes=null", max_steps,
                        "-1: the epochs decide; otherwise it overrides num_train_epochs"),
    "num_train_epochs": Mapped("train.num_epochs, train.max_minutes=null", epochs),
    "warmup_steps": Mapped("train.warmup_steps", warmup_steps,
                           "below 1, train.warmup_ratio, as transformers 5 reads it"),
    "warmup_ratio": to("train.warmup_ratio"),
    "lr_scheduler_type": Mapped("train.lr_schedule", schedule,
                                "constant (constant_with_warmup too), linear or cosine"),
    "lr_scheduler_kwargs": Refused("tba's schedules take no arguments (train.lr_schedule, "
                                   "train.warmup_steps)", none_or_empty),
    "weight_decay": to("train.weight_decay"),
    "max_grad_norm": to("train.max_grad_norm"),
    "gradient_checkpointing": to("train.gradient_checkpointing"),
    "activation_checkpointing": to("train.gradient_checkpointing"),
    "beta": to("train.beta", lambda v: v > 0,
                "TB needs beta > 0: it is the temperature of TB's target pi_ref exp(r / beta); a "
                "small one (e.g. 0.01) is the nearest to TRL's beta=0"),
    "epsilon": to("train.clip_eps"),
    **dict.fromkeys(BATCH_ARGUMENTS, BATCH),
    # Generation.
    "max_completion_length": to("policy.max_new_tokens"),
    "max_prompt_length": to("policy.max_prompt_length"),
    "temperature": to("policy.temperature"),
    "top_p": Refused(f"nucleus sampling: {_SAMPLING}", same(1.0)),
    "top_k": Refused(f"top-k sampling: {_SAMPLING}", lambda v: v in (None, 0)),
    "min_p": Refused(f"min-p sampling: {_SAMPLING}", lambda v: v is None),
    "repetition_penalty": Refused("a repetition penalty changes the sampling distribution that "
                                  "TB's log-probs describe", same(1.0)),
    "generation_kwargs": Refused("tba samples with its own settings (policy.temperature, "
                                 "policy.max_new_tokens)", none_or_empty),
    "chat_template_kwargs": Refused("tba renders chats with the tokenizer's template as it is",
                                    none_or_empty),
    "vllm_structured_outputs_regex": Refused(f"constrained decoding: {_SAMPLING}",
                                             lambda v: v is None),
    "use_vllm": Mapped("searchers.engine=vllm",
                       lambda value: {"searchers.engine.type": "vllm" if value else "builtin"},
                       "vLLM inside each searcher process"),
    "vllm_gpu_memory_utilization": _vllm("gpu_memory_utilization"),
    "vllm_tensor_parallel_size": _vllm("tensor_parallel_size"),
    "vllm_max_model_length": _vllm("max_model_len"),
    **dict.fromkeys(["vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
                     "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
                     "vllm_server_timeout", "vllm_group_port", "ds3_gather_for_generation",
                     "use_transformers_continuous_batching",
                     "transformers_continuous_batching_config", "use_transformers_paged",
                     "cache_implementation"], Ignored(_VLLM)),  # fmt: skip
    # Precision and devices.
    "bf16": Mapped("policy.dtype", bf16, "True: bfloat16, False: float32 (unset: tba's auto)"),
    "fp16": Refused("use bf16=True (policy.dtype=bfloat16)", same(False)),
    "use_cpu": Mapped("policy.device, searchers.device, task.reward_device = cpu", cpu),
    "no_cuda": Mapped("policy.device, searchers.device, task.reward_device = cpu", cpu),
    "model_init_kwargs": Mapped("policy.dtype, quantization", model_init,
                                "its dtype; a bitsandbytes quantization_config (QLoRA, with "
                                "peft_config) as the quantization section; the loader's "
                                "plumbing (" + ", ".join(MODEL_PLUMBING) + ") has no effect"),
    "disable_dropout": Refused("tba always disables dropout: the trainer's log-probs must be the "
                               "searchers'", same(True)),
    "trust_remote_code": Refused("tba loads models without remote code", same(False)),
    "deepspeed": Refused("tba's trainer does not run under DeepSpeed; it shards itself "
                         "(trainer.world_size, docs/sharding.md)", lambda v: v is None),
    "fsdp": Refused("tba shards its trainer itself (trainer.world_size, docs/sharding.md)",
                    none_or_empty),
    "parallelism_config": Refused("tba shards its trainer itself (trainer.world_size, "
                                  "docs/sharding.md)", lambda v: v is None),
    **dict.fromkeys(["fsdp_config", "accelerator_config", "ddp_find_unused_parameters",
                     "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph",
                     "ddp_backend", "ddp_timeout", "local_rank", "average_tokens_across_devices",
                     "tf32", "bf16_full_eval", "fp16_full_eval", "cast_lm_head_to_fp32",
                     "full_determinism"], Ignored(_DEVICES)),  # fmt: skip
    **dict.fromkeys(["torch_compile", "torch_compile_backend", "torch_compile_mode",
                     "use_liger_kernel", "liger_kernel_config", "use_cache",
                     "torch_empty_cache_steps", "gradient_checkpointing_kwargs",
                     "activation_checkpointing_kwargs"], Ignored(_SPEED)),  # fmt: skip
    # Rewards.
    "reward_weights": to("task.reward_weights"),
    "mask_truncated_completions": Mapped("train.truncated", truncated,
                                         "True: drop, False: score"),
    # Records.
    "report_to": Mapped("report_to", report_to,
                        "tensorboard, wandb, trackio (each when installed), none or all"),
    "log_completions": to("log_completions"),
    "save_steps": to("checkpoint.every", lambda v: isinstance(v, int) and v >= 1,
                      "counts steps in tba (an int >= 1), not a share of the run"),
    "save_total_limit": to("checkpoint.keep"),
    "eval_steps": to("eval.every", lambda v: isinstance(v, int) and v >= 1,
                      "counts steps in tba (an int >= 1), not a share of the run"),
    "shuffle_dataset": Refused("each searcher always shuffles its own prompt stream", same(True)),
    "train_sampling_strategy": Refused("each searcher always shuffles its own prompt stream",
                                       same("random")),
    # The Hub.
    "push_to_hub": hub("after training: the start", "push"),
    "hub_model_id": hub("the repository (default: output_dir's name)", "model_id"),
    "hub_token": hub("the token", "token"),
    "hub_private_repo": hub("private or public: the repository", "private"),
    "hub_revision": hub("the branch", "revision"),
    **dict.fromkeys(["hub_strategy", "hub_always_push"], Ignored(_HUB)),
    "log_completions_hub_repo": Ignored("the completions stay in RUN_DIR/completions.jsonl "
                                        "(log_completions), uploaded by no one"),
    # Accepted without effect.
    **dict.fromkeys(["logging_steps", "logging_strategy", "logging_first_step", "logging_dir",
                     "run_name", "disable_tqdm", "num_completions_to_print", "log_unique_prompts",
                     "log_multimodal", "log_level", "log_level_replica", "log_on_each_node",
                     "logging_nan_inf_filter", "include_num_input_tokens_seen", "debug",
                     "skip_memory_metrics", "project", "trackio_space_id", "trackio_bucket_id",
                     "trackio_static_space_id"], Ignored(_LOGGING)),  # fmt: skip
    **dict.fromkeys(["scale_rewards", "loss_type", "epsilon_high", "delta",
                     "importance_sampling_level", "multi_objective_aggregation",
                     "top_entropy_quantile", "sapo_temperature_neg", "sapo_temperature_pos",
                     "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                     "off_policy_mask_threshold", "use_bias_correction_kl",
                     "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                     "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
                     "vllm_importance_sampling_cap", "label_smoothing_factor",
                     "ref_model_mixup_alpha", "ref_model_sync_steps", "entropy_coef_min",
                     "entropy_coef_max", "entropy_coef_delta", "entropy_target",
                     "max_tool_calling_iterations"], Ignored(_GRPO)),  # fmt: skip
    **dict.fromkeys(["remove_unused_columns", "dataloader_num_workers", "dataloader_pin_memory",
                     "dataloader_drop_last", "dataloader_persistent_workers",
                     "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
                     "dataloader_in_order", "pad_to_multiple_of", "num_generations_eval",
                     "label_names", "length_column_name", "data_seed"],
                    Ignored(_DATA)),  # fmt: skip
    **dict.fromkeys(["save_strategy", "save_safetensors", "save_only_model", "save_on_each_node",
                     "overwrite_output_dir", "enable_jit_checkpoint", "ignore_data_skip",
                     "restore_callback_states_from_checkpoint", "resume_from_checkpoint"],
                    Ignored(_SAVE + "; resume with trainer.train(resume_from_checkpoint=True)")),
    **dict.fromkeys(["eval_strategy", "evaluation_strategy", "per_device_eval_batch_size",
                     "do_train", "do_eval", "do_predict", "eval_delay", "prediction_loss_only",
                     "eval_on_start", "eval_do_concat_batches", "eval_use_gather_object",
                     "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics",
                     "metric_for_best_model", "greater_is_better"],
                    Ignored(_EVAL)),  # fmt: skip
    "load_best_model_at_end": Refused("tba's final policy is the last one (evaluated and kept "
                                      "in RUN_DIR/final)", same(False)),
    "optim": Mapped("train.optimizer", optimizer,
                    "adamw_torch, adamw_torch_fused (and adamw_hf, adamw_apex_fused, "
                    "adamw_torch_xla, adamw_torch_npu_fused): adamw; adamw_8bit, adamw_bnb_8bit: "
                    "adamw_8bit; paged_adamw_8bit (bitsandbytes' 8-bit AdamW); others refused"),
    "optim_args": Refused(_ADAM, lambda v: v is None),
    "optim_target_modules": Refused(_ADAM, lambda v: v is None),
    "adam_beta1": Refused("tba's AdamW keeps beta1 = 0.9", same(0.9)),
    "adam_beta2": Refused("tba's AdamW keeps beta2 = 0.999", same(0.999)),
    "adam_epsilon": Refused("tba's AdamW keeps epsilon = 1e-8", same(1e-8)),
    "auto_find_batch_size": Refused("tba's batches are what the settings say", same(False)),
    "neftune_noise_alpha": Refused("noise on the input embeddings while training is not TB's "
                                   "objective", lambda v: v is None),
    "entropy_coef": Refused("an entropy bonus is not TB's objective (its target has the "
                            "entropy it has)", same(0.0)),
    "use_adaptive_entropy": Refused("an entropy bonus is not TB's objective", same(False)),
    "router_aux_loss_coef": Refused("a mixture-of-experts router loss is not part of TB's "
                                    "objective", lambda v: v is None),
    "sync_ref_model": Refused("TB's reference policy is the starting policy, fixed", same(False)),
}

# GRPOConfig's own defaults (TRL 1.x) of what it maps: a TBAConfig starts from them, as a
# GRPOConfig does. TRL's beta=0 has no TB equivalent (train.beta stays tba's), nor its bf16
# (mixed precision over fp32 weights, not bf16 weights): neither is among them.
TRL_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-6,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "num_train_epochs": 3.0,
    "max_steps": -1,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "num_generations": 8,
    "num_iterations": 1,
    "max_completion_length": 512,
    "temperature": 1.0,
    "epsilon": 0.2,
    "mask_truncated_completions": False,
    "gradient_checkpointing": True,
    "seed": 42,
    "save_steps": 500,
}
