"""Real datasets: GSM8K rows in the standard format from JSONL and Parquet, prompt templates,
bad rows named by file and row, the GSM8K and MATH verifiers, and the TL;DR reward model."""

from __future__ import annotations

import builtins
import json
import pickle
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from tba.cli import main
from tba.config import ConfigError, TaskConfig, load_config
from tba.errors import DatasetError
from tba.policy.tokenizer import build_char_tokenizer
from tba.rewards.models import RewardModel
from tba.tasks import load_task
from tba.tasks.dataset_tasks import dataset_task
from tba.tasks.verifiers import boxed as cm
from tba.tasks.verifiers import gsm8k

# Rows in GSM8K's format: a word problem, and a worked answer with calculator annotations that
# ends with "#### <final answer>".
GSM8K_TRAIN = [
    {
        "question": "Mia picks 12 apples on Monday and twice as many on Tuesday. How many "
        "apples does she pick in the two days?",
        "answer": "On Tuesday she picks 12*2 = <<12*2=24>>24 apples.\n"
        "In total she picks 12+24 = <<12+24=36>>36 apples.\n#### 36",
    },
    {
        "question": "A bike costs $1,200. Leo has saved $350 and earns $50 a week. How many "
        "more weeks until he can buy the bike?",
        "answer": "He still needs 1200-350 = <<1200-350=850>>850 dollars.\n"
        "That takes 850/50 = <<850/50=17>>17 weeks.\n#### 17",
    },
    {
        "question": "The temperature was 4 degrees at noon and fell 9 degrees by midnight. "
        "What was the temperature at midnight?",
        "answer": "4-9 = <<4-9=-5>>-5\n#### -5",
    },
    {
        "question": "A town of 2,500 people grows by 10% a year. How many people live there "
        "after one year?",
        "answer": "It grows by 2500*0.1 = <<2500*0.1=250>>250 people.\n"
        "2500+250 = <<2500+250=2750>>2,750 people.\n#### 2,750",
    },
]
GSM8K_TEST = [
    {
        "question": "Sam buys 3 notebooks at $2.50 each. How much does he spend?",
        "answer": "3*2.50 = <<3*2.5=7.5>>7.50\n#### 7.5",
    },
    {
        "question": "Ana reads 15 pages a day. How many pages does she read in a week?",
        "answer": "15*7 = <<15*7=105>>105\n#### 105",
    },
]
RHO1B_PROMPT = "[MATH_TASK] Problem:\n{}\n\nSolution:"


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """`datasets` caches what it reads; keep that out of the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def gsm8k_files(tmp_path):
    return (
        write_jsonl(tmp_path / "train.jsonl", GSM8K_TRAIN),
        write_jsonl(tmp_path / "test.jsonl", GSM8K_TEST),
    )


def gsm8k_config(train: Path, test: Path, **settings) -> TaskConfig:
    return TaskConfig(name="gsm8k", train_path=str(train), eval_path=str(test), **settings)


# ---------------------------------------------------------------------------- loading GSM8K


def test_gsm8k_jsonl_rows_get_the_rho1b_prompt_and_the_final_answer(gsm8k_files):
    task = dataset_task(gsm8k_config(*gsm8k_files, num_train=None, num_eval=None))
    assert task.name == "gsm8k"
    assert [row["prompt"] for row in task.train_rows] == [
        RHO1B_PROMPT.format(row["question"]) for row in GSM8K_TRAIN
    ]
    assert [row["answer"] for row in task.train_rows] == ["36", "17", "-5", "2,750"]
    assert [row["answer"] for row in task.eval_rows] == ["7.5", "105"]
    assert set(task.train_rows[0]) == {"prompt", "answer"}


def test_gsm8k_parquet_reads_like_jsonl(tmp_path, gsm8k_files):
    train = write_parquet(tmp_path / "train.parquet", GSM8K_TRAIN)
    test = write_parquet(tmp_path / "test.parquet", GSM8K_TEST)
    from_parquet = dataset_task(gsm8k_config(train, test))
    from_jsonl = dataset_task(gsm8k_config(*gsm8k_files))
    assert from_parquet.train_rows == from_jsonl.train_rows
    assert from_parquet.eval_rows == from_jsonl.eval_rows


def test_num_train_and_num_eval_take_the_first_rows(gsm8k_files):
    task = dataset_task(gsm8k_config(*gsm8k_files, num_train=2, num_eval=1))
    assert [row["answer"] for row in task.train_rows] == ["36", "17"]
    assert [row["answer"] for row in task.eval_rows] == ["7.5"]


def test_a_dataset_by_name_reads_its_splits(tmp_path):
    """`task.dataset` goes through `datasets.load_dataset`; a local folder of split files stands
    in for a Hub dataset here (no network)."""
    folder = tmp_path / "gsm8k_copy"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", GSM8K_TRAIN)
    write_jsonl(folder / "test.jsonl", GSM8K_TEST)
    task = dataset_task(TaskConfig(name="gsm8k", dataset=str(folder)))
    assert len(task.train_rows) == len(GSM8K_TRAIN) and len(task.eval_rows) == len(GSM8K_TEST)
    assert task.eval_rows[1]["answer"] == "105"


def test_a_custom_template_names_row_columns(gsm8k_files):
    template = "Question: {question}\nThink step by step. {{Answer}} after ####.\n"
    task = dataset_task(gsm8k_config(*gsm8k_files, prompt_template=template))
    question = GSM8K_TRAIN[0]["question"]
    expected = f"Question: {question}\nThink step by step. {{Answer}} after ####.\n"
    assert task.train_rows[0]["prompt"] == expected


def test_load_task_reads_the_config_keys(gsm8k_files):
    train, test = gsm8k_files
    config = load_config(
        None, ["task.name=gsm8k", f"task.train_path={train}", f"task.eval_path={test}"]
    )
    task = load_task(config.task, seed=0)
    assert len(task.train_rows) == 4 and len(task.eval_rows) == 2


def test_gsm8k_rewards_score_the_loaded_rows(gsm8k_files):
    task = dataset_task(gsm8k_config(*gsm8k_files))
    rows = task.train_rows
    prompts = [row["prompt"] for row in rows]
    answers = {"answer": [row["answer"] for row in rows]}
    right = [
        " 12*2=24, 12+24=36\n#### 36",
        " He needs $850, so 17 weeks.\n#### 17",
        " 4-9=-5\n#### -5",
        " 2500+250 = 2,750\n#### 2750",
    ]
    wrong = [" #### 35", " #### 18", " #### 5", " #### 2,500"]
    assert task.reward_fns[0](prompts, right, **answers) == [1.0] * 4
    assert task.reward_fns[0](prompts, wrong, **answers) == [0.0] * 4
    assert task.correct_fn(prompts, right, **answers) == [1.0] * 4


def test_tba_train_runs_on_gsm8k_rows(tmp_path, gsm8k_files):
    """The whole loop on a dataset task: searcher, rewards and held-out evaluation read the rows
    (the built-in policy, pretrained for a few steps, stands in for a real model)."""
    train, test = gsm8k_files
    run_dir = tmp_path / "run"
    status = main(
        ["train", "task.name=gsm8k", f"task.train_path={train}", f"task.eval_path={test}",
         'task.prompt_template="Q: {question}\\n"', "task.num_eval_pass_k=2", "eval.pass_k=2",
         "train.mode=sync", "searchers.count=0", "train.num_prompts=2", "train.group_size=2",
         "train.max_steps=2", "eval.every=2", "policy.max_new_tokens=8", "policy.num_threads=1",
         "pretrain.num_examples=16", "pretrain.steps=2", "pretrain.batch_size=8",
         f"pretrain.cache_dir={tmp_path / 'cache'}", f"output_dir={run_dir}"]
    )  # fmt: skip
    assert status == 0
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["steps"] == 2
    assert {"eval_pass@1", "pass@2"} <= set(summary["final"])
    resolved = load_config(run_dir / "config.yaml").task
    assert resolved.train_path == str(train) and resolved.prompt_template == "Q: {question}\n"


# ---------------------------------------------------------------------------- bad data


def test_a_row_without_a_field_names_the_file_and_the_row(tmp_path, gsm8k_files):
    rows = [dict(row) for row in GSM8K_TRAIN]
    del rows[2]["answer"]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError) as caught:
        dataset_task(gsm8k_config(bad, gsm8k_files[1]))
    message = str(caught.value)
    assert "\n" not in message
    assert str(bad) in message and "row 3" in message and "'answer'" in message


def test_a_template_field_missing_from_the_rows_names_it(gsm8k_files):
    with pytest.raises(DatasetError, match=r"row 1 has no 'problem' field \(it has: question"):
        dataset_task(gsm8k_config(*gsm8k_files, prompt_template="{problem}\n"))


def test_a_final_answer_that_is_not_a_number_names_the_row(tmp_path, gsm8k_files):
    rows = [dict(row) for row in GSM8K_TRAIN]
    rows[1]["answer"] = "He needs more money.\n#### seventeen"
    bad = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 2, field 'answer'.*seventeen"):
        dataset_task(gsm8k_config(bad, gsm8k_files[1]))


def test_a_missing_file_names_the_key(tmp_path, gsm8k_files):
    with pytest.raises(FileNotFoundError, match=r"task\.train_path: no such file: .*nope\.jsonl"):
        dataset_task(gsm8k_config(tmp_path / "nope.jsonl", gsm8k_files[1]))


def test_an_unknown_file_type_and_a_malformed_file_are_one_line(tmp_path, gsm8k_files):
    with pytest.raises(DatasetError, match=r"task\.eval_path: .*\.txt must end in"):
        dataset_task(gsm8k_config(gsm8k_files[0], tmp_path / "rows.txt"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "Q", "answer": "#### 1"}\n{"question": \n')
    with pytest.raises(DatasetError, match=r"broken\.jsonl: row 2 is not valid JSON"):
        dataset_task(gsm8k_config(broken, gsm8k_files[1]))
    not_parquet = tmp_path / "rows.parquet"
    not_parquet.write_text("question,answer\n")
    with pytest.raises(DatasetError, match=r"cannot read .*rows\.parquet as parquet") as caught:
        dataset_task(gsm8k_config(not_parquet, gsm8k_files[1]))
    assert "\n" not in str(caught.value)


def test_the_cli_reports_a_bad_row_in_one_line_with_status_2(tmp_path, gsm8k_files, capsys):
    rows = [dict(row) for row in GSM8K_TEST]
    del rows[1]["question"]
    bad = write_jsonl(tmp_path / "test_bad.jsonl", rows)
    status = main(
        ["train", "task.name=gsm8k", f"task.train_path={gsm8k_files[0]}",
         f"task.eval_path={bad}", f"output_dir={tmp_path / 'run'}", "policy.num_threads=1"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("tba: error: ") and err.count("\n") == 1
    assert "test_bad.jsonl: row 2 has no 'question' field" in err
    assert not (tmp_path / "run").exists()  # stopped before making a run directory


@pytest.mark.parametrize(
    ("overrides", "naming"),
    [
        (["task.name=gsm8k"], "needs task.train_path or task.dataset"),
        (["task.name=gsm8k", "task.train_path=a.jsonl"], "needs task.eval_path"),
        (["task.train_path=a.jsonl"], "task.train_path applies to the dataset tasks"),
        (["task.name=tldr", "task.dataset=x"], "needs task.reward_model"),
        (["task.name=gsm8k", "task.dataset=x", "task.reward_model=rm"], "applies to tldr"),
        (["task.name=gsm8k", "task.dataset=x", "task.prompt_template={} {q}"], "named"),
        (["task.name=gsm8k", "task.dataset=x", "task.prompt_template=a {b"], "expected '}'"),
        (["task.num_train=null"], "needs task.num_train"),
    ],
)
def test_task_settings_are_checked(overrides, naming):
    with pytest.raises(ConfigError, match="invalid value for task") as caught:
        load_config(None, overrides)
    assert naming in str(caught.value) and "\n" not in str(caught.value)


# ---------------------------------------------------------------------------- GSM8K verifier


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("12*2=24\n12+24=36\n#### 36", "36", True),
        ("#### 1,234", "1234", True),
        ("The total is 1,234,567 stars.", "1234567", True),
        ("She pays $18 a day.", "18", True),
        ("#### $18.00", "18", True),
        ("It costs -$5 now.", "-5", True),
        ("It is $-5.", "-5", True),
        ("#### 7.50", "7.5", True),
        ("#### .5", "0.5", True),
        ("#### 0.33", "0.333", False),
        ("#### -5", "-5", True),
        ("#### 5", "-5", False),
        ("It fell to −5 degrees", "-5", True),  # a typographic minus
        ("#### 14.", "14", True),  # a trailing full stop is punctuation
        ("The answer is 14.", "14", True),
        ("10 - 5 = 5", "5", True),
        ("10 - 5 = 5", "-5", False),  # a spaced minus is subtraction, not a sign
        ("I counted 3,4 and 5", "34", False),  # "3,4" is two numbers
        ("#### 36\n\n[MATH_TASK] Problem:\nTom has 2 cats.\n#### 2", "36", True),  # first ####
        ("#### 5 + 3 = 8", "8", True),  # the last number of the #### line
        ("#### 18\nWait, it is 20.", "18", True),  # the #### line wins over the last number
        ("####\nSo 12 then 20", "20", True),  # a #### line without a number does not count
        ("I do not know", "14", False),
        ("", "0", False),
        ("#### 2,750", "Then 2500+250 = 2750 people.\n#### 2,750", True),  # gold after ####
        ("#### 2750", "#### two", False),  # a gold answer that is not a number
    ],
)
def test_gsm8k_is_correct(completion, gold, expected):
    assert gsm8k.is_correct(completion, gold) is expected


def test_gsm8k_gold_answer_is_the_text_after_the_last_marker():
    assert gsm8k.gold_answer(GSM8K_TRAIN[0]["answer"]) == "36"
    assert gsm8k.gold_answer("42") == "42"
    assert gsm8k.gold_answer("x\n####  1,000 ") == "1,000"


def test_gsm8k_verifier_never_runs_text(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the verifier ran code")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    completions = ["#### __import__('os').system('x')", "#### 2+2", "#### 6*7"]
    assert gsm8k.gsm8k_reward(["Q"] * 3, completions, answer=["0", "4", "42"]) == [0.0] * 3


# ---------------------------------------------------------------------------- MATH verifier


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        (r"so $x = \boxed{5}$.", "5"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"The answer is $\boxed 7$", "7"),
        (r"\fbox{x^2}", "x^2"),
        (r"\boxed{unclosed", None),
        ("no box here", None),
    ],
)
def test_last_boxed(text, boxed):
    assert cm.last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        (r"\frac{1}{2}", r"\dfrac{1}{2}", True),
        ("0.5", r"\frac12", True),
        ("1/2", r"\tfrac{1}{2}", True),
        (r"-\frac{3}{4}", "-0.75", True),
        ("1,000", "1000", True),
        (r"90^\circ", "90", True),
        (r"50\%", "50", True),
        ("x = 3", "3", True),
        (r"\text{(B)}", "(B)", True),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})", True),
        ("5.", "5", True),
        ("{5}", "5", True),
        ("3", "4", False),
        (r"2\sqrt{2}", r"\sqrt{8}", False),  # equal values, other forms: not matched
        ("", "", False),
    ],
)
def test_math_answers_match(predicted, gold, expected):
    assert cm.answers_match(predicted, gold) is expected


def test_competition_math_rows_and_reward(tmp_path):
    rows = [
        {"problem": "What is $1+1$?", "solution": r"We add: $1+1=\boxed{2}$.", "level": "Level 1"},
        {"problem": r"Simplify $\frac{2}{4}$.", "solution": r"It is $\boxed{\frac{1}{2}}$."},
    ]
    data = write_jsonl(tmp_path / "math.jsonl", rows)
    config = TaskConfig(name="competition_math", train_path=str(data), eval_path=str(data))
    task = dataset_task(config)
    assert [row["answer"] for row in task.train_rows] == ["2", r"\frac{1}{2}"]
    assert task.train_rows[0]["prompt"].startswith("What is $1+1$?\nPlease reason step by step")
    assert task.train_rows[0]["prompt"].endswith("within \\boxed{}.\n")
    completions = [r"so \boxed{2}", r"$\boxed{0.5}$", "2"]
    scores = task.correct_fn(["p"] * 3, completions, answer=["2", r"\frac{1}{2}", "2"])
    assert scores == [1.0, 1.0, 0.0]  # an answer outside a box does not count


# ---------------------------------------------------------------------------- TL;DR


@pytest.fixture
def reward_model_dir(tmp_path, tokenizer):
    """A tiny sequence-classification reward model with the character tokenizer."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "rm"
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_tldr_reward_model_scores_and_pickles_without_its_weights(tmp_path, reward_model_dir):
    rows = [
        {"query": "POST: I lost my keys.\n\nTL;DR:", "reference_response": " lost keys"},
        {"query": "POST: My cat sleeps all day.\n\nTL;DR:", "reference_response": " lazy cat"},
    ]
    data = write_jsonl(tmp_path / "tldr.jsonl", rows)
    config = TaskConfig(
        name="tldr", train_path=str(data), eval_path=str(data),
        reward_model=str(reward_model_dir), reward_device="cpu", reward_batch_size=1,
    )  # fmt: skip
    task = dataset_task(config)
    assert task.train_rows[0] == {"prompt": rows[0]["query"], "reference": " lost keys"}
    reward = task.reward_fns[0]
    prompts = [row["prompt"] for row in task.train_rows]
    scores = reward(prompts, [" keys gone", " cat naps"], reference=["a", "b"])
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)
    assert scores == reward(prompts, [" keys gone", " cat naps"])  # deterministic
    batched = RewardModel(str(reward_model_dir), device="cpu", batch_size=2)
    assert batched(prompts, [" keys gone", " cat naps"]) == pytest.approx(scores, abs=1e-5)
    copy = pickle.loads(pickle.dumps(reward))
    assert copy.model._value is None and reward.model._value is not None  # the copy loads its own
    assert copy(prompts, [" keys gone", " cat naps"]) == pytest.approx(scores)


def test_a_reward_model_scores_conversations_through_its_chat_template(reward_model_dir):
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    completion = [{"role": "assistant", "content": "hello"}]
    plain = RewardModel(str(reward_model_dir), device="cpu")
    with pytest.raises(ValueError, match="has no chat template to render conversational"):
        plain([conversation], [completion])
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    tokenizer.save_pretrained(reward_model_dir)
    reward = RewardModel(str(reward_model_dir), device="cpu")
    rendered = "system: be brief\nuser: hi\nassistant: hello\n"
    assert reward([conversation, "Q: hi\n"], [completion, "A"]) == pytest.approx(
        reward.score([rendered, "Q: hi\nA<eos>"])
    )


# ---------------------------------------------------------------------------- example configs


def test_every_example_config_loads():
    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert len(configs) >= 5
    for path in configs:
        load_config(path)
