"""What a TRL user relies on: TRL's reward contract (keywords, `completion_ids`,
`trainer_state`, None for a completion a function does not score, reward weights), TRL's config
names in `TBAConfig`, the truncation rule, `save_model`, the completions log, per-function
reward metrics, a model wrapped by `get_peft_model`, and reruns after a failed start."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import peft
import pytest
from safetensors.torch import load_file

from tba import TBAConfig, TBATrainer
from tba.config import load_config
from tba.errors import ConfigError
from tba.policy.sampling import Generation
from tba.rewards.scorer import RewardScorer, TrainerState
from tba.run_dir import RunExistsError, read_metrics
from tba.searcher import Searcher, SearchSettings
from tba.trl_args import TRL_ARGUMENTS, Ignored, Refused, reference_page

ROOT = Path(__file__).resolve().parents[1]
SYNC = ["train.mode=sync", "searchers.count=0", "train.num_prompts=2", "train.group_size=4",
        "train.max_steps=3", "policy.max_new_tokens=8", "policy.num_threads=1", "eval.every=2",
        "task.num_eval=4"]  # fmt: skip


@pytest.fixture
def policy_dir(tmp_path, tiny_model, tokenizer) -> Path:
    path = tmp_path / "policy"
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def rows(count: int = 8) -> list[dict]:
    return [{"prompt": f"Q{i}\n", "answer": str(i)} for i in range(count)]


# ------------------------------------------------------------------------- the reward contract


def test_reward_functions_are_called_with_trls_keywords():
    seen = {}

    def reward_len(completions, **kwargs):  # TRL's quickstart: completions by keyword
        seen.update(kwargs)
        return [-abs(20 - len(c)) for c in completions]

    def named(prompts, completions, completion_ids, trainer_state, answer):  # no **kwargs
        return [float(len(ids) + trainer_state.global_step) for ids in completion_ids]

    scorer = RewardScorer([reward_len, named])
    state = TrainerState(global_step=7, max_steps=100)
    scores = scorer.score(["p1", "p2"], ["abc", "de"], [[5, 6, 2], [7, 2]],
                          {"answer": ["1", "2"]}, state)  # fmt: skip
    assert scores.parts == {"reward_len": [-17, -18], "named": [10.0, 9.0]}
    assert scores.totals == [-7.0, -9.0] and scores.faults == []
    assert seen["prompts"] == ["p1", "p2"] and seen["completion_ids"] == [[5, 6, 2], [7, 2]]
    assert seen["answer"] == ["1", "2"] and seen["trainer_state"] == state
    assert callable(seen["log_extra"])


def test_reward_weights_weigh_each_function_as_trl_does():
    def one(completions, **kwargs):
        return [1.0, None]

    def two(completions, **kwargs):
        return [2.0, 4.0]

    scores = RewardScorer([one, two], weights=[0.5, -1.0]).score(["p", "q"], ["a", "b"],
                                                                  [[1], [1]], {})  # fmt: skip
    assert scores.totals == [0.5 - 2.0, -4.0]
    with pytest.raises(ValueError, match="1 reward weights for 2 reward functions"):
        RewardScorer([one, two], weights=[1.0])


def test_the_trainer_checks_reward_weights_against_its_functions(tmp_path, policy_dir):
    def one(completions, **kwargs):
        return [1.0] * len(completions)

    config = TBAConfig(reward_weights=[1.0, 2.0], output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="reward_weights has 2 weights for 1 reward functions"):
        TBATrainer(str(policy_dir), one, args=config, train_dataset=rows())


def test_a_completion_no_function_scores_is_dropped_and_counted(tiny_model, tokenizer):
    def even_only(completions, **kwargs):
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    settings = SearchSettings(samples_per_prompt=4, temperature=1.0, max_new_tokens=4,
                              truncated="score", truncation_penalty=-1.0)  # fmt: skip
    searcher = Searcher(tiny_model, tokenizer, rows(2), [even_only], settings)
    samples, stats = searcher.generate(num_prompts=2)
    assert len(samples) == 4 and stats["reward_unscored"] == 4 and stats["reward_dropped"] == 4
    assert all(s.reward == 1.0 and s.reward_parts == {"even_only": 1.0} for s in samples)
    assert searcher.take_reward_faults() == []  # not scoring a completion is not a fault


# ------------------------------------------------------------------------- the truncation rule


@pytest.mark.parametrize(
    ("rule", "expected"), [("score", [0.5, 0.5]), ("penalize", [0.5, -1.0]), ("drop", [0.5, None])]
)
def test_a_response_without_eos_is_scored_penalized_or_dropped(tiny_model, tokenizer, rule,
                                                               expected):  # fmt: skip
    def half(completions, **kwargs):
        return [0.5] * len(completions)

    settings = SearchSettings(samples_per_prompt=2, temperature=1.0, max_new_tokens=4,
                              truncated=rule, truncation_penalty=-1.0)  # fmt: skip
    searcher = Searcher(tiny_model, tokenizer, rows(1), [half], settings)
    out = Generation([[1], [1]], [0.0, 0.0], [[0.0], [0.0]], [False, True])
    _, totals, _ = searcher._score([0, 0], ["a", "b"], out)
    assert [t if not math.isnan(t) else None for t in totals] == expected


def test_the_default_rule_is_trls_and_the_embedded_tasks_keep_their_penalty():
    assert TBAConfig().train.truncated == "score"
    assert load_config(None, ["task.name=custom"]).train.truncated == "score"
    for task in ("math", "redteam", "summarize"):
        assert load_config(None, [f"task.name={task}"]).train.truncated == "penalize"
    assert TBAConfig(mask_truncated_completions=True).train.truncated == "drop"


# ------------------------------------------------------------------------- TRL's config names


def test_grpo_config_arguments_become_tba_settings():
    config = TBAConfig(
        learning_rate=1e-5, num_generations=4, per_device_train_batch_size=8,
        gradient_accumulation_steps=16, max_completion_length=64, max_prompt_length=128,
        num_train_epochs=1, bf16=True, beta=0.04, epsilon=0.3, save_steps=10,
        report_to="none", temperature=0.9, reward_weights=[1.0, 0.5], warmup_steps=5,
        max_grad_norm=0.5, gradient_checkpointing=True, logging_steps=10,
        remove_unused_columns=False, mask_truncated_completions=True, log_completions=True,
    )  # fmt: skip
    train = config.train
    assert (train.learning_rate, train.group_size, train.num_prompts) == (1e-5, 4, 32)
    assert (train.micro_batch_groups, train.num_epochs, train.max_minutes) == (2, 1.0, None)
    assert (train.beta, train.clip_eps, train.warmup_steps, train.max_grad_norm) == (
        0.04, 0.3, 5, 0.5)  # fmt: skip
    assert train.gradient_checkpointing and train.truncated == "drop" and config.log_completions
    assert (config.policy.max_new_tokens, config.policy.max_prompt_length) == (64, 128)
    assert (config.policy.dtype, config.policy.temperature) == ("bfloat16", 0.9)
    assert config.checkpoint.every == 10 and config.report_to == []
    assert config.task.reward_weights == [1.0, 0.5]
    assert config._trl_notes == [
        "logging_steps=10 has no effect in tba: TRL's logging: tba logs every step to "
        "metrics.jsonl (and report_to)",
        "remove_unused_columns=False has no effect in tba: TRL's data loading: tba's searchers "
        "read the rows themselves",
    ]
    assert TBAConfig(max_steps=5, num_train_epochs=3).train.num_epochs is None  # as in TRL


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"beta": 0.0}, "TRL argument beta=0.0: tba's train.beta must be > 0"),
        ({"top_p": 0.9}, "TRL argument top_p=0.9 has no tba equivalent: nucleus sampling"),
        ({"fp16": True}, "fp16=True has no tba equivalent: use bf16=True"),
        ({"push_to_hub": True}, "push_to_hub=True has no tba equivalent: tba does not upload"),
        ({"report_to": "mlflow"}, "tba reports to tensorboard and wandb"),
        ({"lr_scheduler": 1}, "unknown setting 'lr_scheduler': not a tba section nor a TRL"),
        ({"num_generations": 3, "per_device_train_batch_size": 8}, "whole groups per pass"),
        ({"learning_rate": 1e-5, "train": {"learning_rate": 1e-4}},
         "train.learning_rate is set twice"),
        ({"train": {"beta": -1}}, "invalid value for train.beta: Input should be greater than 0"),
    ],
)  # fmt: skip
def test_what_tba_cannot_honour_is_one_line_naming_it(arguments, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        TBAConfig(**arguments)
    assert "\n" not in str(error.value)


def test_every_trl_argument_is_documented():
    assert (ROOT / "docs" / "trl.md").read_text() == reference_page(), (
        "docs/trl.md is out of date: `tba config --trl > docs/trl.md`"
    )
    kinds = {type(entry) for entry in TRL_ARGUMENTS.values()}
    assert Ignored in kinds and Refused in kinds


def test_tba_overrides_from_the_environment_apply_on_top(monkeypatch):
    monkeypatch.setenv("TBA_OVERRIDES", "train.mode=sync searchers.count=0 train.beta=0.2")
    config = TBAConfig(beta=0.1)
    assert (config.train.mode, config.searchers.count, config.train.beta) == ("sync", 0, 0.2)


# ------------------------------------------------------------------------- the trainer


def test_datasets_of_every_usual_shape_and_clear_errors_for_the_others(tmp_path, policy_dir):
    def one(completions, **kwargs):
        return [1.0] * len(completions)

    config = TBAConfig(output_dir=str(tmp_path / "run"))
    frame = pd.DataFrame(rows())
    assert TBATrainer(str(policy_dir), one, args=config, train_dataset=frame).task.train_rows[0] \
        == {"prompt": "Q0\n", "answer": "0"}  # fmt: skip
    for dataset, message in [
        ("data.jsonl", "train_dataset: a path"),
        (["Q1", "Q2"], "rows must be dicts with a `prompt` column, got a str"),
        ({"train": rows()}, "train_dataset: a mapping \\(train\\); pass one split"),
    ]:
        with pytest.raises(ConfigError, match=message):
            TBATrainer(str(policy_dir), one, args=config, train_dataset=dataset)
    with pytest.raises(ConfigError, match="reward_funcs: a function.*got int 42"):
        TBATrainer(str(policy_dir), 42, args=config, train_dataset=rows())
    with pytest.raises(ConfigError, match="callbacks have no tba equivalent"):
        TBATrainer(str(policy_dir), one, args=config, train_dataset=rows(), callbacks=[object()])


def test_a_peft_model_trains_its_adapters_and_the_run_keeps_everything(tmp_path, tiny_model,
                                                                       tokenizer):  # fmt: skip
    def short(completions, **kwargs):
        return [-len(c) / 8 for c in completions]

    model = peft.get_peft_model(tiny_model, peft.LoraConfig(r=4, lora_alpha=8,
                                                            target_modules=["q_proj", "v_proj"]))
    config = TBAConfig.from_overrides([*SYNC, f"output_dir={tmp_path / 'run'}",
                                       "log_completions=true"])  # fmt: skip
    trainer = TBATrainer(model, short, args=config, train_dataset=rows(),
                         processing_class=tokenizer)  # fmt: skip
    assert trainer.args.lora.r == 4 and trainer.args.lora.target_modules == ["q_proj", "v_proj"]
    trainer.train()
    run = tmp_path / "run"
    assert (run / "base_model" / "config.json").is_file()
    assert not any("lora" in key for key in load_file(run / "base_model" / "model.safetensors"))
    assert (run / "final" / "adapter").is_dir()
    saved = trainer.save_model(tmp_path / "saved")
    assert (saved / "config.json").is_file() and (saved / "adapter").is_dir()
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert all("rewards/short/mean" in r and "rewards/short/std" in r for r in steps)
    logged = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(logged) == 3 * 2 * 4  # every sample of every step
    assert {"prompt", "completion", "step", "reward", "short", "truncated", "version"} <= set(
        logged[0])  # fmt: skip


def test_trained_adapters_are_refused_rather_than_dropped(tmp_path, tiny_model, tokenizer):
    model = peft.get_peft_model(tiny_model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.fill_(0.1)
    with pytest.raises(ConfigError, match="already trained: merge them"):
        TBATrainer(model, lambda completions, **kwargs: [0.0] * len(completions),
                   args=TBAConfig(output_dir=str(tmp_path / "run")), train_dataset=rows(),
                   processing_class=tokenizer)  # fmt: skip


def test_a_failed_start_does_not_block_the_next_and_messages_name_the_api(tmp_path, policy_dir):
    def one(completions, **kwargs):
        return [1.0] * len(completions)

    run = tmp_path / "run"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # a model directory that does not load
    config = TBAConfig.from_overrides([*SYNC, f"output_dir={run}"])
    with pytest.raises(Exception):  # noqa: B017 - transformers' own error for a broken model
        TBATrainer(str(broken), one, args=config, train_dataset=rows()).train()
    assert (run / "config.yaml").exists() and not (run / "checkpoints").exists()
    trainer = TBATrainer(str(policy_dir), one, args=config, train_dataset=rows())
    trainer.train()  # the failed start is replaced, not in the way
    with pytest.raises(RunExistsError, match=r"trainer.train\(resume_from_checkpoint=True\)"):
        TBATrainer(str(policy_dir), one, args=config, train_dataset=rows()).train()
