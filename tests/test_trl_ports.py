"""TRL GRPO scripts port to tba by changing the import, the trainer class and the config class.
Six scripts in the shape TRL users start from (tests/ports: TRL's classic and current
quickstarts, the multi-task example of its docs, Hugging Face's GRPO cookbook, the "LoRA Without
Regret" script and the grpo_rnj_1_instruct notebook), with their GRPOConfig arguments, trainer
arguments, reward signatures, dataset shapes and calls on the trainer, and offline stand-ins for
what they download. Each pair differs by those lines only; the tba scripts run, unchanged, on a
local random-weight Qwen2, synchronously and asynchronously: all six of a mode in one process
(tests/ports/run_ports.py), their limits set from the environment (`TBA_OVERRIDES`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from tiny_models import build_model, task_texts, teach_to_stop, train_tokenizer

from tba.run_dir import read_metrics
from tba.tasks.math import world

PORTS = Path(__file__).parent / "ports"
NAMES = ["grpo_quickstart", "grpo_multitask", "grpo_deepmath", "grpo_cookbook",
         "grpo_lora_without_regret", "grpo_rnj_1_instruct"]  # fmt: skip
# The test's own limits, through the environment: the scripts stay as they are.
MODES = {
    "sync": "train.mode=sync searchers.count=0 policy.num_threads=1",
    "async": "searchers.num_threads=1 policy.num_threads=1 train.initial_buffer_samples=1",
}
SMALL_EVAL = "task.num_eval=8 eval.batch_size=8"
STEPS = {"grpo_lora_without_regret": 4, "grpo_cookbook": None}  # None: its one epoch, 2 steps


# TRL's quickstart as a user ran it on SmolLM2 (run in tests/test_trl_smollm2.py, on that model).
PAIRS = [*NAMES, "grpo_quickstart_smollm2"]


@pytest.mark.parametrize("name", PAIRS)
def test_a_trl_script_ports_by_changing_three_lines(name):
    trl = (PORTS / f"{name}_trl.py").read_text().splitlines()
    tba = (PORTS / f"{name}_tba.py").read_text().splitlines()
    assert len(trl) == len(tba)
    changed = [(theirs, ours) for theirs, ours in zip(trl, tba) if ours != theirs]
    renames = {"from trl import GRPOConfig, GRPOTrainer": "from tba import TBAConfig, TBATrainer",
               "from trl import GRPOTrainer": "from tba import TBATrainer"}  # fmt: skip
    (import_theirs, import_ours), *classes = changed
    assert renames[import_theirs] == import_ours
    assert [theirs.replace("GRPOConfig(", "TBAConfig(").replace("GRPOTrainer(", "TBATrainer(")
            for theirs, _ in classes] == [ours for _, ours in classes]  # fmt: skip
    expected = ["TBATrainer"] if "GRPOConfig" not in import_theirs else ["TBAConfig", "TBATrainer"]
    assert [ours.split("= ")[1].split("(")[0] for _, ours in classes] == expected


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


def dataset_rows(name: str) -> list[dict]:
    """Rows in the shape of each script's dataset (the multi-task one builds its own)."""
    problems = world.problems("train", 64, seed=0)
    if name == "grpo_quickstart":  # trl-lib/tldr: prompt and completion texts
        prompts, answers = task_texts(16)
        return [{"prompt": p, "completion": a} for p, a in zip(prompts, answers)]
    if name in ("grpo_deepmath", "grpo_lora_without_regret"):  # conversational, with solutions
        return [{"prompt": [{"role": "user", "content": p.question}], "solution": str(p.answer)}
                for p in problems[:16]]  # fmt: skip
    count = 64 if name == "grpo_cookbook" else 16  # AI-MO/NuminaMath-TIR's columns
    return [{"problem": p.question, "solution": str(p.answer),
             "messages": [{"role": "user", "content": p.question}]}
            for p in problems[:count]]  # fmt: skip


@dataclass
class PortRun:
    outcome: str  # "ok", or the traceback
    log: str  # what the script printed
    run_dir: Path | None
    trackio: Path  # the Trackio stand-in's record of its calls
    hub: Path  # the Hub stand-in's record of the uploads (tests/ports/run_ports.py)


def find_run(where: Path, output_dir: Path) -> Path | None:
    """The run directory: `output_dir`, or the framework's default under the script's cwd."""
    if (output_dir / "eval.json").exists():
        return output_dir
    return next(iter(sorted(where.glob("runs/*"))), None)


@pytest.fixture(scope="module", params=["sync", "async"])
def ported(request, qwen2, tmp_path_factory) -> tuple[str, dict[str, PortRun]]:
    """Every tba script of tests/ports, run in `mode` in one process: what each left."""
    mode = request.param
    root = tmp_path_factory.mktemp(f"ports-{mode}")
    scripts = []
    for name in NAMES:
        where = root / name
        where.mkdir()
        data = where / "data.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in dataset_rows(name)))
        steps = STEPS.get(name, 2)
        limit = f" train.max_steps={steps}" if steps else ""
        scripts.append({
            "name": name, "script": str(PORTS / f"{name}_tba.py"), "cwd": str(where),
            "log": str(where / "log.txt"),
            "env": {"PORT_MODEL": str(qwen2), "PORT_DATASET": str(data),
                    "PORT_OUTPUT_DIR": str(where / "out"), "TRACKIO_DIR": str(where / "trackio"),
                    "TBA_OVERRIDES": f"{MODES[mode]} {SMALL_EVAL}{limit}"},
        })  # fmt: skip
    plan = root / "plan.json"
    outcomes = root / "outcomes.json"
    plan.write_text(json.dumps({"scripts": scripts, "outcomes": str(outcomes),
                                "ray": mode == "async"}))  # fmt: skip
    env = os.environ | {
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        # The stand-ins: trl_rewards for the searcher processes, trackio for report_to.
        "PYTHONPATH": os.pathsep.join([str(PORTS), str(PORTS / "stand_ins"),
                                       os.environ.get("PYTHONPATH", "")]),
    }  # fmt: skip
    done = subprocess.run([sys.executable, str(PORTS / "run_ports.py"), str(plan)], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0 and outcomes.exists(), done.stderr[-3000:]
    results = json.loads(outcomes.read_text())
    runs = {}
    for item in scripts:
        where = Path(item["cwd"])
        runs[item["name"]] = PortRun(results[item["name"]], Path(item["log"]).read_text(),
                                     find_run(where, where / "out"), where / "trackio",
                                     where / "hub.jsonl")  # fmt: skip
    return mode, runs


def uploads(run: PortRun) -> int:
    """How many uploads of the trained policy, with its weights and model card, the script made
    (`push_to_hub=True`, `trainer.push_to_hub()`)."""
    records = [json.loads(line) for line in run.hub.read_text().splitlines()]
    assert all({"config.json", "README.md"} <= set(record["files"]) for record in records)
    return len(records)


def finished(ported, name: str) -> tuple[str, PortRun, dict, dict, list[dict]]:
    """The run of script `name`: it trained to its limit in its mode, saved its policy, and
    printed the settings it started with once; (mode, run, config, eval.json, step records).
    Asynchronously, the samples that arrive while the buffer fills are in no step's record, and
    two steps may see no other: reward metrics are looked for in synchronous runs."""
    mode, runs = ported
    run = runs[name]
    assert run.outcome == "ok", run.outcome + run.log[-2000:]
    config = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    summary = json.loads((run.run_dir / "eval.json").read_text())
    assert summary["mode"] == mode and (run.run_dir / "final" / "config.json").is_file()
    assert summary["steps"] == (STEPS.get(name, 2) or 2)  # TBA_OVERRIDES over the epochs
    assert run.log.count("tba: TBA_OVERRIDES sets") == 1
    steps = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r]
    return mode, run, config, summary, steps


@pytest.mark.slow
def test_trls_classic_quickstart(ported):
    _, run, config, _, steps = finished(ported, "grpo_quickstart")
    # reward_len, called as TRL calls it, by keyword: its values are lengths' distances.
    assert all(r["rewards/reward_len/mean"] <= 0 for r in steps if "rewards/reward_len/mean" in r)
    assert "logging_steps=10" in run.log  # listed once, as without effect


@pytest.mark.slow
def test_the_multi_task_example_warns_of_rows_no_function_scores(ported):
    mode, run, config, summary, steps = finished(ported, "grpo_multitask")
    assert mode == "async" or any("rewards/math_reward_func/mean" in r for r in steps)
    # Its "code" rows (the coding function looks for "coding") are scored by no function.
    assert "reward_unscored" in run.log and summary["reward_unscored"] > 0
    assert run.run_dir.parent.name == "runs"  # no output_dir: the default place


@pytest.mark.slow
def test_trls_current_quickstart_runs_with_trls_defaults(ported):
    mode, run, config, _, steps = finished(ported, "grpo_deepmath")
    assert config["policy"]["max_new_tokens"] == 512  # TRL's, not tba's 40
    assert config["train"]["learning_rate"] == 1e-6 and config["train"]["lr_schedule"] == "linear"
    assert (config["train"]["group_size"], config["train"]["num_prompts"]) == (8, 1)
    assert config["seed"] == 42 and config["train"]["gradient_checkpointing"]
    assert mode == "async" or any("rewards/accuracy_reward/mean" in r for r in steps)
    assert "policy.max_new_tokens=512*" in run.log  # the resolved values, printed


@pytest.mark.slow
def test_the_cookbook_saves_and_pushes(ported):
    mode, run, config, _, steps = finished(ported, "grpo_cookbook")
    # The GRPOConfig as tba settings: 8 completions a pass, 16 passes, 4 per prompt = 32 prompts.
    expected = {"learning_rate": 1e-5, "group_size": 4, "num_prompts": 32,
                "micro_batch_groups": 2, "num_epochs": 1.0}  # fmt: skip
    assert {key: config["train"][key] for key in expected} == expected
    assert config["policy"]["dtype"] == "bfloat16" and config["policy"]["max_new_tokens"] == 64
    assert config["policy"]["max_prompt_length"] == 128 and config["checkpoint"]["every"] == 10
    assert config["lora"]["r"] == 8 and config["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert config["report_to"] == ["tensorboard"] and (run.run_dir / "tensorboard").is_dir()
    assert mode == "async" or any("rewards/format_reward/mean" in r
                                  and "rewards/accuracy_reward/std" in r for r in steps)
    # trainer.save_model(output_dir): the policy loadable from the run directory itself; then
    # push_to_hub=True and trainer.push_to_hub(): offline, one line each, nothing lost.
    assert (run.run_dir / "config.json").is_file() and (run.run_dir / "adapter").is_dir()
    assert uploads(run) == 2 and "Traceback" not in run.log


@pytest.mark.slow
def test_the_lora_script_trains_on_fresh_completions_as_many_as_trl(ported):
    mode, run, config, summary, steps = finished(ported, "grpo_lora_without_regret")
    train = config["train"]
    # TRL: 1 completion a pass, 4 passes a step, one prompt's 8 completions a generation.
    assert train["num_prompts"] * train["group_size"] == 4
    assert (train["samples_per_prompt"], train["sync_generate"]) == (8, "when_needed")
    assert config["lora"]["r"] == 1 and config["lora"]["target_modules"] == "all-linear"
    if mode == "sync":
        assert summary["groups_reused"] == 0
        # A generation serves two steps, as TRL's generation_batch_size=8 does.
        assert [r["generations"] for r in steps] == [1, 0, 1, 0]
    calls = [json.loads(line) for line in (run.trackio / "calls.jsonl").read_text().splitlines()]
    assert calls[0]["call"] == "init" and calls[-1]["call"] == "finish"
    assert any(c["call"] == "log" and "loss" in c["keys"] for c in calls)


@pytest.mark.slow
def test_the_rnj_notebook_runs_to_its_last_cell(ported):
    _, run, config, _, _ = finished(ported, "grpo_rnj_1_instruct")
    assert "seconds used for training." in run.log  # trainer_stats.metrics['train_runtime']
    assert config["lora"]["r"] == 32 and config["report_to"] == ["trackio"]
    logged = json.loads((run.run_dir / "completions.jsonl").read_text().splitlines()[0])
    assert logged["prompt"][0]["role"] == "system"  # the conversation, as JSON
    assert uploads(run) == 2 and (run.run_dir / "adapter").is_dir()
