"""`benchmarks.compare`: `--only` keeps the methods it names, in that order, and refuses an unknown
one; every method of every suite is a valid config; the value suite's table of times to 55% and
60% and its critics' explained variance."""

import argparse
import json
import math

import pytest

from benchmarks.common import Point, aggregate, pick_methods
from benchmarks.compare import (
    critic_fit,
    objectives_at,
    print_critic_fit,
    print_times_to_targets,
    suites,
)
from tba.config import load_config


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
            if method.runner is None:  # `tba train` with these overrides
                config = load_config(None, method.overrides)
                if suite == "long":
                    assert config.train.max_minutes == 90, name
