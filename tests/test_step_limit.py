"""A step limit that is given wins over an epoch count, as TRL's `max_steps` does over
`num_train_epochs`, however it is given; the time limit applies beside either; the start of a run
says which limit applies."""

from __future__ import annotations

import json
import re

import pytest

from tba import TBAConfig, TBATrainer
from tba.config import load_config
from tba.limits import limits_line, step_limit

PROMPTS = 100  # training prompts; TRL's default batch takes one prompt a step


def trl_script_config(**arguments) -> TBAConfig:
    """What the README's port of TRL's quickstart makes: TRL's defaults, among them
    `num_train_epochs=3`."""
    return TBAConfig(output_dir="out", logging_steps=10, **arguments)


def test_trls_default_epochs_alone_give_the_epoch_limit():
    config = trl_script_config()
    assert config.train.num_epochs == 3.0 and config.train.max_steps is None
    assert step_limit(config.train, PROMPTS) == 3 * PROMPTS
    assert limits_line(config.train, PROMPTS).startswith(
        f"stops at step {3 * PROMPTS} (train.num_epochs=3 over {PROMPTS} training prompts)")


def test_trls_max_steps_argument_wins_over_its_epochs():
    assert step_limit(trl_script_config(max_steps=3).train, PROMPTS) == 3
    assert step_limit(trl_script_config(max_steps=3, num_train_epochs=1).train, PROMPTS) == 3
    assert step_limit(trl_script_config(max_steps=-1).train, PROMPTS) == 3 * PROMPTS


def test_max_steps_set_on_the_config_object_wins_over_trls_epochs():
    config = trl_script_config()
    config.train.max_steps = 3
    assert step_limit(config.train, PROMPTS) == 3
    assert limits_line(config.train, PROMPTS) == (
        "stops at step 3 (train.max_steps; train.num_epochs=3 ignored) (or at Ctrl-C)")


def test_max_steps_from_the_environment_wins_over_the_scripts_epochs(monkeypatch):
    monkeypatch.setenv("TBA_OVERRIDES", "train.max_steps=4")
    assert step_limit(trl_script_config(num_train_epochs=2).train, PROMPTS) == 4


def test_max_steps_on_the_command_line_or_in_yaml_wins_over_epochs(tmp_path):
    overrides = load_config(None, ["train.num_epochs=3", "train.max_steps=5"]).train
    assert step_limit(overrides, PROMPTS) == 5
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  num_epochs: 3\n  max_steps: 6\n")
    assert step_limit(load_config(path).train, PROMPTS) == 6
    mixed = load_config(path, ["train.max_steps=7"]).train
    assert step_limit(mixed, PROMPTS) == 7


def test_the_time_limit_applies_beside_a_step_limit():
    train = load_config(None, ["train.max_steps=5", "train.max_minutes=2"]).train
    assert limits_line(train, PROMPTS) == (
        "stops at step 5 (train.max_steps) or after 2 minutes, whichever comes first "
        "(or at Ctrl-C)")
    clock = load_config(None, []).train
    assert step_limit(clock, PROMPTS) is None
    assert limits_line(clock, PROMPTS) == "stops after 10 minutes (or at Ctrl-C)"


@pytest.mark.slow
def test_a_trl_port_with_max_steps_set_on_its_config_stops_there(tmp_path, tiny_model, tokenizer,
                                                                capsys):
    """The user's case: TRL's quickstart ported, then `args.train.max_steps = 3` and
    `args.train.mode = "sync"` set before `TBATrainer(...)`."""
    args = TBAConfig(output_dir=str(tmp_path / "run"), logging_steps=10,
                     per_device_train_batch_size=4, num_generations=4,
                     max_completion_length=8)  # fmt: skip
    args.train.max_steps = 3
    args.train.mode = "sync"
    args.searchers.count = 0
    args.task.num_eval = 4
    rows = [{"prompt": f"{a}+{a}="} for a in range(40)]
    trainer = TBATrainer(model=tiny_model, processing_class=tokenizer, args=args,
                         reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
                         train_dataset=rows)  # fmt: skip
    trainer.train()
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 3
    # The console's lines, wrapped between a time column and a source column, read as text.
    words = [word for word in capsys.readouterr().err.split()
             if not re.fullmatch(r"\S+\.py:\d+|\[\d\d:\d\d:\d\d\]", word)]  # fmt: skip
    assert "stops at step 3 (train.max_steps; train.num_epochs=3 ignored)" in " ".join(words)
