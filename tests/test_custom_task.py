"""Your own task: reward functions by `module:function` or as callables (async too), rows with a
`prompt` column, a template or a conversation, the TRL-shaped `TBATrainer`, TensorBoard logging,
and the example script end to end on Ray."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from peft import LoraConfig
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tba import TBAConfig, TBATrainer
from tba.cli import main
from tba.config import ConfigError, load_config
from tba.errors import DatasetError
from tba.policy.tokenizer import build_char_tokenizer, encode_prompts
from tba.rewards.scorer import RewardScorer, as_reward_inputs
from tba.run_dir import read_metrics
from tba.tasks import load_task
from tba.tasks.custom import (
    custom_task,
    import_function,
    prepare_rows,
    reward_functions,
)
from tba.tasks.verifiers.last_number import last_number_reward

ROOT = Path(__file__).resolve().parents[1]
REWARDS = '''
def length_reward(prompts, completions, target, **kwargs):
    return [-abs(int(t) - len(c)) / 10 for c, t in zip(completions, target)]
'''
SYNC = ["train.mode=sync", "searchers.count=0", "train.num_prompts=2", "train.group_size=4",
        "train.max_steps=3", "policy.max_new_tokens=8", "policy.num_threads=1", "eval.every=2",
        "task.num_eval=4"]  # fmt: skip


CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "3+3?"},
]


@pytest.fixture
def chat_tokenizer():
    """The character tokenizer with a chat template written in its own characters."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tokenizer


def test_functions_import_from_a_module_or_a_file(tmp_path):
    spec = "tba.tasks.verifiers.last_number:last_number_reward"
    assert import_function(spec) is last_number_reward
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    function = import_function(f"{tmp_path / 'my_rewards.py'}:length_reward")
    assert function(["p"], ["abc"], target=[5]) == [-0.2]
    with pytest.raises(ConfigError, match="not `module:function`"):
        import_function("tba.tasks.verifiers.last_number")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        import_function("no_such_module:f")
    with pytest.raises(ConfigError, match="has no function 'nothing'"):
        import_function("tba.tasks.verifiers.last_number:nothing")


def test_a_function_from_a_file_reaches_a_process_that_cannot_import_the_file(tmp_path):
    # Pickled with Ray's cloudpickle, as Ray sends reward functions to searcher processes; in a
    # child process, so that this one does not import Ray before `tba` configures it.
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    dump = ("import sys; from ray import cloudpickle; from tba.tasks.custom import import_function;"
            f" sys.stdout.buffer.write(cloudpickle.dumps(import_function("
            f"'{tmp_path / 'my_rewards.py'}:length_reward')))")  # fmt: skip
    pickled = subprocess.run([sys.executable, "-c", dump], capture_output=True, check=True).stdout
    load = "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); print(f(['p'], ['abc'], target=[5]))"  # noqa: E501
    done = subprocess.run([sys.executable, "-c", load], input=pickled, capture_output=True,
                          cwd="/")  # fmt: skip
    assert done.stdout.decode().strip() == "[-0.2]", done.stderr.decode()[-500:]


def test_rows_take_a_prompt_column_a_template_or_a_conversation():
    rows, chat = prepare_rows([{"prompt": "hi", "x": 1}], None, "data")
    assert rows == [{"prompt": "hi", "x": 1}] and not chat
    rows, _ = prepare_rows([{"q": "2+2", "x": 1}], "Q: {q}", "data")
    assert rows[0]["prompt"] == "Q: 2+2" and rows[0]["q"] == "2+2"
    rows, chat = prepare_rows([{"prompt": "a"}, {"prompt": CONVERSATION}], None, "data")
    assert rows[1]["prompt"] == CONVERSATION and chat
    with pytest.raises(DatasetError, match="row 1: a conversational prompt is a list of messages"):
        prepare_rows([{"prompt": [{"role": "robot", "content": "hi"}]}], None, "data")
    with pytest.raises(DatasetError, match="row 1: a conversational prompt ends with a user or"):
        prepare_rows([{"prompt": [{"role": "system", "content": "be brief"}]}], None, "data")
    with pytest.raises(DatasetError, match="row 2 has no text `prompt` column"):
        prepare_rows([{"prompt": "a"}, {"question": "b"}], None, "data")
    with pytest.raises(DatasetError, match="data has no rows"):
        prepare_rows([], None, "data")


def test_conversations_are_rendered_by_the_chat_template_and_prefills_continued(chat_tokenizer):
    prefilled = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}]
    ids = encode_prompts(chat_tokenizer, [CONVERSATION, prefilled, "plain"])
    assert [chat_tokenizer.decode(i) for i in ids] == [
        "system: be brief\nuser: 2+2?\nassistant: 4\nuser: 3+3?\nassistant:",
        "user: 2+2?\nassistant: It is",
        "<bos>plain",  # text prompts stay text unless policy.chat_template=true
    ]
    # As TRL gives them: the prefill moves from the prompt into the completion.
    prompts, completions = as_reward_inputs([CONVERSATION, prefilled, "plain"], ["6", " 4", "x"])
    assert prompts == [CONVERSATION, prefilled[:1], "plain"]
    assert completions == [[{"role": "assistant", "content": "6"}],
                           [{"role": "assistant", "content": "It is 4"}], "x"]  # fmt: skip


def test_tba_trainer_trains_on_conversations_and_rewards_see_them_as_in_trl(
    tmp_path, tiny_model, chat_tokenizer
):
    seen: list[tuple] = []

    def brief(prompts, completions, **kwargs):
        seen.extend(zip(prompts, completions, strict=True))
        return [-len(c[0]["content"]) / 8 for c in completions]

    question = [{"role": "user", "content": "2+2?"}]
    prefilled = [*question, {"role": "assistant", "content": "It is"}]
    rows = [{"prompt": CONVERSATION}, {"prompt": prefilled}] * 4
    config = TBAConfig.from_overrides([*SYNC, f"output_dir={tmp_path / 'run'}"])
    trainer = TBATrainer(model=tiny_model, reward_funcs=brief, train_dataset=rows, args=config,
                         processing_class=chat_tokenizer)  # fmt: skip
    results = trainer.train()
    assert "eval_reward" in results["final"]
    prompts = {json.dumps(prompt) for prompt, _ in seen}
    assert prompts == {json.dumps(CONVERSATION), json.dumps(question)}
    assert all(c[0]["role"] == "assistant" for _, c in seen)
    assert all(c[0]["content"].startswith("It is") for p, c in seen if p == question)


def test_conversations_need_a_tokenizer_with_a_chat_template(tmp_path, tiny_model, tokenizer):
    config = TBAConfig.from_overrides([*SYNC, f"output_dir={tmp_path / 'run'}"])
    trainer = TBATrainer(model=tiny_model,
                         reward_funcs=lambda completions, **k: [0.0] * len(completions),
                         train_dataset=[{"prompt": CONVERSATION}], args=config,
                         processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ConfigError, match="has no chat template, which .* conversational"):
        trainer.train()


def test_rewards_are_summed_and_async_functions_are_awaited():
    async def slow_bonus(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    def length(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    scores = RewardScorer([slow_bonus, length]).score(["p", "p"], ["a", "abc"], [[1], [1]], {})
    assert scores.totals == [2.0, 4.0]


def test_the_custom_task_is_configured_only_with_its_own_keys():
    with pytest.raises(ConfigError, match="task.reward_funcs applies to the custom task"):
        load_config(None, ["task.reward_funcs=[m:f]"])
    with pytest.raises(ConfigError, match="task.answer_field does not apply to the custom task"):
        load_config(None, ["task.name=custom", "task.answer_field=answer"])
    config = load_config(None, ["task.name=custom"])
    with pytest.raises(ConfigError, match="needs task.train_path or task.dataset"):
        load_task(config.task, seed=0)
    with pytest.raises(ConfigError, match="at least one reward function"):
        reward_functions([])


def test_without_held_out_rows_the_first_training_prompts_are_evaluated():
    rows = [{"prompt": f"p{i}"} for i in range(10)]
    task = custom_task(rows, None, [lambda completions, **k: [0.0] * len(completions)], num_eval=3)
    assert [r["prompt"] for r in task.eval_rows] == ["p0", "p1", "p2"]
    assert task.metrics == ("eval_reward",) and task.evaluate is not None
    task = custom_task(rows, rows[:2], [last_number_reward], eval_func=last_number_reward)
    assert task.correct_fn is last_number_reward and task.metrics == ("eval_pass@1",)


def test_cli_custom_task_trains_on_a_file_with_a_reward_file_and_tensorboard(tmp_path, policy_dir):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}\n", "target": 3 + i % 4}) + "\n"
                            for i in range(12)))  # fmt: skip
    run_dir = tmp_path / "run"
    overrides = [*SYNC, "task.name=custom", f"task.train_path={data}",
                 f"task.reward_funcs=[{tmp_path / 'my_rewards.py'}:length_reward]",
                 f"policy.model={policy_dir}", "report_to=[tensorboard]",
                 f"output_dir={run_dir}"]  # fmt: skip
    assert main(["train", *overrides]) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert "eval_reward" in records[0] and records[-1]["step"] == 3
    assert all(r["reward_mean"] <= 0 for r in records if "reward_mean" in r)

    board = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    losses = board.Scalars("loss")
    assert [event.step for event in losses] == [1, 2, 3]
    assert "eval_reward" in board.Tags()["scalars"]


def test_tba_trainer_takes_a_loaded_model_callables_and_rows(tmp_path, tiny_model, tokenizer):
    seen_columns: set[str] = set()

    def short_is_good(prompts, completions, level, **kwargs):
        seen_columns.update(["level"])
        return [-len(c) / 8 + level_ for c, level_ in zip(completions, level)]

    rows = [{"prompt": f"Q{i}\n", "level": 0.5} for i in range(8)]
    config = TBAConfig.from_overrides([*SYNC, f"output_dir={tmp_path / 'run'}"])
    trainer = TBATrainer(model=tiny_model, reward_funcs=short_is_good, train_dataset=rows,
                         args=config, processing_class=tokenizer)  # fmt: skip
    assert trainer.args.task.reward_funcs == [f"{__name__}:{short_is_good.__qualname__}"]
    results = trainer.train()
    assert seen_columns == {"level"}
    assert Path(results["run_dir"]) == tmp_path / "run"
    assert set(results["base"]) == {"eval_reward"} and "eval_reward" in results["final"]
    assert (tmp_path / "run" / "base_model" / "config.json").exists()
    assert (tmp_path / "run" / "final" / "config.json").exists()


def test_tba_trainer_resumes_a_run_it_started(tmp_path, policy_dir):
    rows = [{"prompt": f"Q{i}\n", "answer": "1"} for i in range(8)]
    config = TBAConfig.from_overrides([*SYNC, f"output_dir={tmp_path / 'run'}"])
    TBATrainer(str(policy_dir), last_number_reward, args=config, train_dataset=rows).train()
    run_dir = f"output_dir={tmp_path / 'run'}"
    longer = TBAConfig.from_overrides([*SYNC, "train.max_steps=5", run_dir])
    trainer = TBATrainer(str(policy_dir), last_number_reward, args=longer, train_dataset=rows)
    results = trainer.train(resume_from_checkpoint=True)
    assert results["steps"] == 5
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
            if "loss" in r] == [1, 2, 3, 4, 5]  # fmt: skip
    # Once more with the same limit: nothing to train, said in one line, nothing written.
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already reached its limit, train.max_steps=5"):
        trainer.train(resume_from_checkpoint=True)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_tba_trainer_maps_a_peft_config_to_lora(tmp_path, policy_dir):
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj"])
    trainer = TBATrainer(model=str(policy_dir), reward_funcs=[last_number_reward],
                         train_dataset=[{"prompt": "Q\n", "answer": "1"}],
                         args=TBAConfig(output_dir=str(tmp_path / "run")),
                         peft_config=peft_config)  # fmt: skip
    lora = trainer.args.lora
    assert (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (4, 8.0, 0.1, ["q_proj"])
    assert trainer.args.policy.model == str(policy_dir)


@pytest.mark.slow
def test_the_example_runs_asynchronously_with_its_reward_in_a_searcher_process(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, str(ROOT / "examples" / "custom_reward.py"), "--max-steps", "4",
               "--output-dir", str(run_dir), "train.mode=async", "searchers.count=1",
               "train.num_prompts=2", "train.group_size=4", "policy.max_new_tokens=12",
               "task.num_eval=8", "task.num_eval_pass_k=4", "eval.pass_k=2", "eval.every=2",
               "pretrain.num_examples=64", "pretrain.steps=4", "pretrain.batch_size=16",
               f"pretrain.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pass@1" in done.stdout
    records = read_metrics(run_dir / "metrics.jsonl")
    assert records[-1]["step"] == 4
    assert any(r.get("samples_in", 0) > 0 for r in records)  # made by the searcher process
