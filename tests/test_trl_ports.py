"""TRL GRPO scripts port to tba by changing three lines: the import, the trainer class and the
config class. TRL's quickstart, and a script in the shape of a popular GRPO cookbook
(conversational prompts with a system prompt, LoRA by `get_peft_model`, two reward functions of
TRL's `(completions, **kwargs)` shape, a GRPOConfig with the usual arguments), run here as
their own processes on a local random-weight Qwen2, synchronously and asynchronously."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_models import build_model, task_texts, teach_to_stop, train_tokenizer

from tba.run_dir import read_metrics
from tba.tasks.math import world

PORTS = Path(__file__).parent / "ports"
# The test's own limits, through the environment: the scripts stay as they are.
MODES = {
    "sync": "train.mode=sync searchers.count=0 policy.num_threads=1",
    "async": "searchers.num_threads=1 policy.num_threads=1",
}
SMALL_EVAL = "task.num_eval=8 eval.batch_size=8"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    """A random-weight Qwen2 with a chat template, taught to end its answers with EOS."""
    tokenizer = train_tokenizer("qwen2")
    model = build_model("qwen2", tokenizer)
    teach_to_stop(model, tokenizer)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", ["grpo_quickstart", "grpo_cookbook"])
def test_a_trl_script_ports_by_changing_three_lines(name):
    trl = (PORTS / f"{name}_trl.py").read_text().splitlines()
    tba = (PORTS / f"{name}_tba.py").read_text().splitlines()
    assert len(trl) == len(tba)
    changed = [(ours, theirs) for ours, theirs in zip(tba, trl) if ours != theirs]
    assert len(changed) == 3
    (import_ours, import_theirs), *classes = changed
    assert (import_theirs, import_ours) == ("from trl import GRPOConfig, GRPOTrainer",
                                            "from tba import TBAConfig, TBATrainer")  # fmt: skip
    renamed = [theirs.replace("GRPOConfig(", "TBAConfig(").replace("GRPOTrainer(", "TBATrainer(")
               for _, theirs in classes]  # fmt: skip
    assert renamed == [ours for ours, _ in classes]
    names = [ours.split(" = ")[1].split("(")[0] for ours, _ in classes]
    assert names == ["TBAConfig", "TBATrainer"]


def run_port(name: str, tmp_path: Path, model: Path, rows: list[dict], mode: str) -> Path:
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    env = os.environ | {
        "PORT_MODEL": str(model), "PORT_DATASET": str(dataset), "PORT_OUTPUT_DIR": str(run_dir),
        "TBA_OVERRIDES": f"{MODES[mode]} {SMALL_EVAL}",
    }  # fmt: skip
    done = subprocess.run([sys.executable, str(PORTS / f"{name}_tba.py")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trl_quickstart_runs_on_tba(tmp_path, qwen2, mode):
    prompts, answers = task_texts(16)
    rows = [{"prompt": p, "completion": a} for p, a in zip(prompts, answers)]
    run_dir = run_port("grpo_quickstart", tmp_path, qwen2, rows, mode)
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["steps"] == 2 and summary["mode"] == mode
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    # reward_len, called as TRL calls it, by keyword: its values are lengths' distances.
    assert all(r["rewards/reward_len/mean"] <= 0 for r in steps if "rewards/reward_len/mean" in r)
    assert (run_dir / "final" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_conversational_lora_cookbook_runs_on_tba(tmp_path, qwen2, mode):
    problems = world.problems("train", 64, seed=0)
    rows = [{"problem": p.question, "solution": p.answer} for p in problems]
    run_dir = run_port("grpo_cookbook", tmp_path, qwen2, rows, mode)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    # The GRPOConfig as tba settings: 8 completions a pass, 16 passes, 4 per prompt = 32 prompts.
    expected = {"learning_rate": 1e-5, "group_size": 4, "num_prompts": 32,
                "micro_batch_groups": 2, "num_epochs": 1.0}  # fmt: skip
    assert {key: config["train"][key] for key in expected} == expected
    assert config["policy"]["dtype"] == "bfloat16" and config["policy"]["max_new_tokens"] == 64
    assert config["policy"]["max_prompt_length"] == 128 and config["checkpoint"]["every"] == 10
    assert config["lora"]["r"] == 8 and config["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert config["report_to"] == ["tensorboard"] and (run_dir / "tensorboard").is_dir()
    summary = json.loads((run_dir / "eval.json").read_text())
    assert summary["steps"] == 2  # one epoch: 64 prompts, 32 a step
    records = read_metrics(run_dir / "metrics.jsonl")
    assert any("rewards/format_reward/mean" in r and "rewards/accuracy_reward/std" in r
               for r in records)  # fmt: skip
    # trainer.save_model(output_dir): the policy loadable from the run directory itself.
    assert (run_dir / "config.json").is_file() and (run_dir / "adapter").is_dir()
    assert (run_dir / "base_model" / "config.json").is_file()
