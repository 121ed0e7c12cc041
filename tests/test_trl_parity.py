"""What a TRL user relies on: TRL's reward contract (keywords, `completion_ids`,
`trainer_state`, `log_metric`, None for a completion a function does not score, reward weights),
the truncation rule, `train()`'s `TrainOutput`, `save_model`, `push_to_hub`, `report_to="trackio"`,
the completions log, per-function reward metrics, a model wrapped by `get_peft_model`, and reruns
into the same directory (TRL's config names: test_trl_args.py)."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import huggingface_hub.constants
import pandas as pd
import peft
import pytest
from safetensors.torch import load_file
from transformers.trainer_utils import TrainOutput

from tba import TBAConfig, TBATrainer
from tba.api import PushToHubError
from tba.config import RunConfig, load_config
from tba.errors import ConfigError
from tba.policy.sampling import Generation
from tba.rewards.scorer import RewardScorer, TrainerState
from tba.run_dir import RunExistsError, read_metrics
from tba.searcher import Searcher
from tba.tracking import open_trackers

ROOT = Path(__file__).resolve().parents[1]
SYNC = ["train.mode=sync", "searchers.count=0", "train.num_prompts=2", "train.group_size=4",
        "train.max_steps=3", "policy.max_new_tokens=8", "policy.num_threads=1", "eval.every=2",
        "task.num_eval=4"]  # fmt: skip


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
    with pytest.raises(ConfigError, match="reward_weights has 1 weights for 2 reward functions"):
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

    config = RunConfig(policy={"max_new_tokens": 4}, train={"group_size": 4, "truncated": "score"})
    searcher = Searcher(tiny_model, tokenizer, rows(2), [even_only], config)
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

    config = RunConfig(policy={"max_new_tokens": 4}, train={"group_size": 2, "truncated": rule})
    searcher = Searcher(tiny_model, tokenizer, rows(1), [half], config)
    out = Generation([[1], [1]], [0.0, 0.0], [[0.0], [0.0]], [False, True])
    _, totals, _ = searcher._score([0, 0], ["a", "b"], out)
    assert [t if not math.isnan(t) else None for t in totals] == expected


def test_the_default_rule_is_trls_and_the_embedded_tasks_keep_their_penalty():
    assert TBAConfig().train.truncated == "score"
    assert load_config(None, ["task.name=custom"]).train.truncated == "score"
    for task in ("math", "redteam", "summarize"):
        assert load_config(None, [f"task.name={task}"]).train.truncated == "penalize"
    assert TBAConfig(mask_truncated_completions=True).train.truncated == "drop"


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


def test_a_failed_start_does_not_block_the_next_and_a_rerun_starts_afresh(tmp_path, policy_dir,
                                                                          capsys):  # fmt: skip
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
    result = trainer.train()  # the failed start is replaced, not in the way
    # TRL's TrainOutput, with tba's figures beside TRL's.
    assert isinstance(result, TrainOutput) and result.global_step == 3
    losses = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert result.training_loss == pytest.approx(sum(losses) / 3)
    assert result.metrics["train_runtime"] > 0 and result.metrics["train_loss"] == result[1]
    assert result.metrics["train_samples_per_second"] == pytest.approx(
        3 * 2 * 4 / result.metrics["train_runtime"])  # fmt: skip
    assert result.metrics["epoch"] == pytest.approx(3 * 2 / 8)
    assert result["run_dir"] == str(run) and "eval_reward" in result["final"]
    # As in TRL, the same script again is a fresh run; resuming or keeping it is asked for.
    again = TBATrainer(str(policy_dir), one, args=config, train_dataset=rows()).train()
    assert again.global_step == 3 and "Traceback" not in capsys.readouterr().err
    assert len([r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]) == 3
    with pytest.raises(RunExistsError, match=r"trainer.train\(resume_from_checkpoint=True\)"):
        TBATrainer(str(policy_dir), one, args=config, train_dataset=rows()).train(overwrite=False)
    with pytest.raises(ConfigError, match="resume_from_checkpoint='elsewhere': tba resumes"):
        trainer.train(resume_from_checkpoint="elsewhere")
    # push_to_hub offline: an error, as in TRL, saying where the trained policy is kept.
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as patch, pytest.raises(PushToHubError) as raised:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        trainer.push_to_hub(dataset_name="local/rows")
    line = str(raised.value)
    assert "\n" not in line and "push_to_hub: run was not uploaded" in line
    assert "offline mode is enabled" in line and f"kept in {run / 'final'}" in line
    assert (run / "final" / "config.json").is_file()


class FakeHub:
    """HfApi's create_repo and upload_folder, recorded."""

    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, private=None, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private, self.token))
        return types.SimpleNamespace(repo_id=f"me/{repo_id}" if "/" not in repo_id else repo_id)

    def upload_folder(self, repo_id, folder_path, commit_message, revision):
        card = (Path(folder_path) / "README.md").read_text()
        self.calls.append(("upload_folder", repo_id, Path(folder_path).name, revision, card))
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")


def test_push_to_hub_true_uploads_the_trained_policy_after_training(tmp_path, policy_dir,
                                                                    monkeypatch):  # fmt: skip
    monkeypatch.setattr("tba.api.HfApi", FakeHub)
    FakeHub.calls = []
    settings = TBAConfig.from_overrides([*SYNC, f"output_dir={tmp_path / 'run'}"]).model_dump()
    config = TBAConfig(**settings, push_to_hub=True, hub_model_id="org/policy",
                       hub_private_repo=True, hub_token="hf_secret")  # fmt: skip
    trainer = TBATrainer(str(policy_dir), lambda completions, **k: [0.0] * len(completions),
                         args=config, train_dataset=rows())  # fmt: skip
    trainer.train()
    created, uploaded = FakeHub.calls
    assert created == ("create_repo", "org/policy", True, "hf_secret")
    assert uploaded[:4] == ("upload_folder", "org/policy", "final", None)
    assert "tags:" in uploaded[4] and "tba" in uploaded[4]
    url = trainer.push_to_hub(dataset_name="me/rows", revision="v2")
    assert url == "https://huggingface.co/org/policy/commit/1"
    assert FakeHub.calls[-1][3] == "v2" and "me/rows" in FakeHub.calls[-1][4]


def test_trackio_gets_every_metric_record(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("trackio")
    fake.init = lambda project, name, config: calls.append(("init", project, name))
    fake.log = lambda numbers, step: calls.append(("log", step, numbers))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "trackio", fake)
    monkeypatch.setattr("tba.tracking.require_trackers", lambda names: None)
    monkeypatch.setenv("TRACKIO_PROJECT", "mine")
    trackers = open_trackers(load_config(None, ["report_to=[trackio]"]), tmp_path / "run")
    trackers.log({"step": 3, "loss": 0.5, "note": "text"})
    trackers.close()
    assert calls == [("init", "mine", "run"), ("log", 3, {"loss": 0.5}), ("finish",)]


def test_reward_functions_log_metrics_as_trls_log_metric():
    def counted(completions, log_metric, **kwargs):
        log_metric("answers/long", sum(len(c) > 2 for c in completions) / len(completions))
        log_metric("answers/long", 1.0)
        return [1.0] * len(completions)

    scores = RewardScorer([counted]).score(["p", "q"], ["abc", "d"], [[1], [1]], {})
    assert scores.metrics == {"answers/long": 0.75}


def test_a_quantized_model_of_nowhere_is_refused_in_one_line(tmp_path, tiny_model, tokenizer):
    """Every process loads a quantized base alike, from where it came: a model built in memory
    has no such place (tests/test_qlora.py runs one that has)."""
    tiny_model.config.quantization_config = {"load_in_4bit": True}
    with pytest.raises(ConfigError, match="the model is quantized and was not loaded from a "):
        TBATrainer(tiny_model, lambda completions, **k: [0.0] * len(completions),
                   args=TBAConfig(output_dir=str(tmp_path / "run")), train_dataset=rows(),
                   processing_class=tokenizer)  # fmt: skip


def train_on_lengths(policy_dir: Path, config: TBAConfig) -> tuple[TrainOutput, list[dict]]:
    """A run rewarded by completion length: TRL's `TrainOutput`, and its steps' records."""
    result = TBATrainer(str(policy_dir), lambda completions, **k: [float(len(c)) for c in
                                                                  completions],
                        args=config, train_dataset=rows()).train()  # fmt: skip
    metrics = read_metrics(Path(config.output_dir) / "metrics.jsonl")
    return result, [r for r in metrics if "loss" in r]


@pytest.mark.parametrize("iterations", [1, 2])
def test_a_generation_of_half_steps_serves_two_steps_without_replay(tmp_path, policy_dir,
                                                                    iterations):  # fmt: skip
    """LoRA Without Regret's batches: 1 completion a pass, 4 passes, generations of one prompt's
    8 completions. Synchronously, each generation serves two steps of 4 fresh completions (four
    steps, each completion twice, with num_iterations=2)."""
    config = TBAConfig(
        per_device_train_batch_size=1, gradient_accumulation_steps=4, num_generations=8,
        generation_batch_size=8, num_iterations=iterations, output_dir=str(tmp_path / "run"),
        train={"mode": "sync", "max_steps": 4}, searchers={"count": 0},
        policy={"max_new_tokens": 8, "num_threads": 1}, task={"num_eval": 4},
    )  # fmt: skip
    result, steps = train_on_lengths(policy_dir, config)
    assert [r["generations"] for r in steps] == ([1, 0, 1, 0] if iterations == 1 else [1, 0, 0, 0])
    # Each step trains on 4 of a prompt's 8 completions, its log Z from all 8.
    assert [r["context_samples"] for r in steps] == [4, 4, 4, 4]
    # The second pass over a generation is the reuse num_iterations asks for.
    assert result.metrics["groups_reused"] == (0 if iterations == 1 else 2)
    assert result.metrics["groups_fresh"] == 4
    assert result.metrics["train_samples_per_second"] * result.metrics["train_runtime"] == \
        pytest.approx(4 * 4)  # fmt: skip


def test_single_completions_a_step_keep_their_generations_statistics(tmp_path, policy_dir):
    """1 completion a pass, 3 passes, prompts of 8: P * A and G share no factor, as TRL allows
    with steps_per_generation=8. Each step trains on 3 fresh completions, never one twice, and
    a generation of 8 serves 8/3 steps."""
    config = TBAConfig(
        per_device_train_batch_size=1, gradient_accumulation_steps=3, num_generations=8,
        steps_per_generation=8, output_dir=str(tmp_path / "run"),
        train={"mode": "sync", "max_steps": 8}, searchers={"count": 0},
        policy={"max_new_tokens": 8, "num_threads": 1}, task={"num_eval": 4},
    )  # fmt: skip
    assert (config.train.group_size, config.train.num_prompts) == (1, 3)
    result, steps = train_on_lengths(policy_dir, config)
    # 24 completions in 8 steps: three generations, each completion trained once.
    assert sum(r["generations"] for r in steps) == 3
    assert result.metrics["groups_reused"] == 0 and result.metrics["groups_fresh"] == 24
    # Every trained completion's log Z comes from its generation's 8, each counted once: the
    # first step trains 3 of one prompt's 8, the other 5 its context.
    assert steps[0]["context_samples"] == 5
    assert all(math.isfinite(r["loss"]) for r in steps)


def test_single_completions_a_step_train_asynchronously(tmp_path, policy_dir):
    """The same batches with a searcher process: every step's 3 completions enter with their
    generations' others, a replayed single completion too."""
    config = TBAConfig(
        per_device_train_batch_size=1, gradient_accumulation_steps=3, num_generations=8,
        steps_per_generation=8, output_dir=str(tmp_path / "run"),
        train={"mode": "async", "max_steps": 6}, searchers={"count": 1, "num_cpus": 1},
        policy={"max_new_tokens": 8, "num_threads": 1}, task={"num_eval": 4},
    )  # fmt: skip
    result, steps = train_on_lengths(policy_dir, config)
    assert len(steps) == 6 and result.global_step == 6
    assert all(r["context_samples"] >= 5 and math.isfinite(r["loss"]) for r in steps)
