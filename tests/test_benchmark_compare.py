"""`benchmarks.compare`: `--only` keeps the methods it names, in that order, and refuses an unknown
one; every method of every suite is a valid config (the SmolLM2 suites': the same model, prompts,
reward, batch, length, temperature and learning rate for every method); a suite's own defaults;
the value suite's table of times to 55% and 60% and its critics' explained variance."""

import argparse
import json
import math
from pathlib import Path

import pytest

from benchmarks.common import Point, aggregate, pick_methods
from benchmarks.compare import (
    critic_fit,
    objectives_at,
    parse_args,
    print_critic_fit,
    print_times_to_targets,
    suites,
)
from tba.config import load_config
from tba.keys import get_key


def test_only_keeps_the_named_methods_in_the_order_given():
    methods = objectives_at(2)
    picked = pick_methods(methods, "rloo-k2,tb-k2", argparse.ArgumentParser())
    assert list(picked) == ["rloo-k2", "tb-k2"]
    assert pick_methods(methods, None, argparse.ArgumentParser()) is methods


def test_an_unknown_method_is_refused_in_one_line_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        pick_methods(objectives_at(2), "tb-k3", argparse.ArgumentParser(prog="compare"))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--only: unknown tb-k3; choose from tb-k2, tb-plain-k2" in error


def test_times_to_targets_give_minutes_samples_and_multiples_of_tbs_time(capsys):
    def run(minutes_per_point: float, samples_per_point: int,
            values: tuple[float, ...] = (0.40, 0.50, 0.60, 0.70)) -> list[Point]:  # fmt: skip
        return [Point(i * minutes_per_point, i, i * samples_per_point, v)
                for i, v in enumerate(values)]  # fmt: skip

    aggregates = {
        "tba": aggregate("TB", [run(1.0, 100)], [{}], step=0.5),
        "vineppo-sync": aggregate("VinePPO", [run(4.0, 1000)], [{}], step=0.5),
        "ppo-sync": aggregate("PPO", [run(2.0, 100, (0.40, 0.50, 0.60, 0.65))], [{}], step=0.5),
    }
    print_times_to_targets(aggregates)
    rows = capsys.readouterr().out.strip().splitlines()
    # 55%: half-way between the points at 0.50 and 0.60; 60%: the third point; the last target
    # is TB's own end, 70%, which PPO never reaches in its 6 minutes: more than 6 / 3 TB's time.
    assert rows[0].startswith("| method | minutes to 55.0% |")
    assert "minutes to 70.0% | samples to 70.0% | x TB's time |" in rows[0]
    assert rows[-3] == "| TB | 1.5 | 150 | 1.0 | 2.0 | 200 | 1.0 | 3.0 | 300 | 1.0 |"
    assert rows[-2] == "| VinePPO | 6.0 | 1,500 | 4.0 | 8.0 | 2,000 | 4.0 | 12.0 | 3,000 | 4.0 |"
    assert rows[-1] == "| PPO | 3.0 | 150 | 2.0 | 4.0 | 200 | 2.0 | > 6.0 | not reached | > 2.0 |"
    assert {"tba", "ppo-sync", "ppo-async", "ppo-sync-head", "vineppo-sync"} == set(
        suites(argparse.Namespace(trl_lr=5e-5))["value"]
    )


def test_critic_fit_averages_the_last_steps_and_the_quarters_leaving_out_constant_returns(
    tmp_path, capsys
):
    run_dir = tmp_path / "ppo-sync" / "seed0"
    run_dir.mkdir(parents=True)
    # Eight steps; the fourth had constant returns (NaN). Evaluation rows carry no critic.
    fits = [0.0, 0.1, 0.2, math.nan, 0.4, 0.5, 0.6, 0.7]
    rows = [{"step": 0, "eval_pass@1": 0.4}] + [
        {"step": i + 1, "explained_variance": fit} for i, fit in enumerate(fits)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "ppo-sync" / "seed0.log").write_text("the run's log, not a run")
    last, quarters = critic_fit(run_dir, last=3)
    assert last == pytest.approx(0.6)
    assert quarters == pytest.approx([0.05, 0.2, 0.45, 0.65])

    tb_dir = tmp_path / "tba" / "seed0"
    tb_dir.mkdir(parents=True)
    (tb_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    assert critic_fit(tb_dir) is None

    print_critic_fit([tmp_path], ["tba", "ppo-sync"])
    rows_printed = capsys.readouterr().out.strip().splitlines()
    assert rows_printed[-1] == "| ppo-sync | seed0 | 0.357 | 0.05, 0.20, 0.45, 0.65 |"
    assert len(rows_printed) == 3  # header, rule, the one run with a critic


def test_every_method_of_every_suite_is_a_valid_config():
    for suite, methods in suites(argparse.Namespace(trl_lr=5e-5)).items():
        for name, method in methods.items():
            # `tba train` with these overrides, or the settings another runner starts from.
            config = load_config(None, method.overrides)
            if suite == "long":
                assert config.train.max_minutes == 90, name


def test_the_smollm2_suites_train_one_model_with_one_batch_length_and_learning_rate():
    """tba asynchronous, tba synchronous and TRL see the same model, prompts, reward, B x K,
    length, temperature and learning rate; only the mode (and who trains) differs."""
    every = suites(argparse.Namespace(trl_lr=5e-5))
    shared = ("policy.model", "policy.chat_template", "policy.max_new_tokens",
              "policy.temperature", "task.name", "task.reward_funcs", "task.train_path",
              "train.num_prompts", "train.group_size", "train.learning_rate", "train.truncated")
    for suite in ("smollm2-quickstart", "smollm2-math"):
        methods = every[suite]
        assert list(methods) == ["tba-async", "tba-sync", "trl"]
        configs = {name: load_config(None, m.overrides).model_dump() for name, m in methods.items()}
        for key in shared:
            assert len({json.dumps(get_key(c, key)) for c in configs.values()}) == 1, (suite, key)
        modes = {name: c["train"]["mode"] for name, c in configs.items() if name != "trl"}
        assert modes == {"tba-async": "async", "tba-sync": "sync"}
        assert all(m.runner is not None for m in methods.values())
    quickstart = load_config(None, every["smollm2-quickstart"]["trl"].overrides)
    assert (quickstart.train.num_prompts, quickstart.train.group_size) == (2, 8)
    assert quickstart.policy.max_new_tokens == 32 and quickstart.train.learning_rate == 2e-5
    assert quickstart.policy.model == "pypi:smollm2-135m-instruct"
    recipe = load_config(Path("configs/smollm2_math.yaml"))
    math_config = load_config(None, every["smollm2-math"]["trl"].overrides)
    for key in ("max_new_tokens", "temperature", "chat_template", "model"):
        assert getattr(math_config.policy, key) == getattr(recipe.policy, key), key
    # The sweep: the recipe, synchronous (the faster mode on two cores), one setting changed
    # at a time.
    sweep = {name: load_config(None, m.overrides) for name, m in every["smollm2-sweep"].items()}
    assert sweep["recipe"].train.learning_rate == recipe.train.learning_rate
    assert sweep["lr1e-4"].train.learning_rate == 1e-4 and sweep["lora16"].lora.r == 16
    assert {c.train.mode for c in sweep.values()} == {"sync"}


def test_a_smollm2_suite_has_its_own_defaults_and_the_others_keep_theirs():
    _, args = parse_args(["--suite", "smollm2-math"])
    assert (args.minutes, args.seeds, args.snapshot_minutes, args.num_eval) == (30.0, 3, 5.0, 256)
    assert args.target is None and args.out == Path("runs/compare_smollm2_math")
    _, args = parse_args(["--suite", "smollm2-quickstart", "--minutes", "2", "--seeds", "1"])
    assert (args.minutes, args.seeds, args.snapshot_minutes) == (2.0, 1, 2.5)
    _, args = parse_args(["--suite", "stress"])
    assert (args.minutes, args.seeds, args.target, args.snapshot_minutes, args.num_eval,
            args.out) == (5.0, 3, 0.55, 0.5, 1024, Path("runs/compare"))  # fmt: skip
