"""The run's recipe (`tba.run`): its checks before anything loads, the phases a signal names
(`StopRequest.during`), the policy's dtype decided once (`policy.dtype=auto`), and when held-out
evaluations come (`tba.eval_schedule`, `eval.every_minutes=auto`)."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from test_train_e2e import FAST

from tba.checkpoint import Checkpoint, latest_checkpoint
from tba.config import ConfigError, load_config
from tba.eval_schedule import EvalSchedule, greedy_share, next_eval_time
from tba.interrupts import StopRequest
from tba.run import PREFLIGHT_RULES, check_before_loading, train, with_concrete_dtype
from tba.trl_args import from_trl

# ----------------------------------------------------------------------------- checks and phases


def test_the_checks_before_loading_run_in_order_and_the_first_failure_stops_the_run(monkeypatch):
    assert [rule.__name__ for rule in PREFLIGHT_RULES] == [
        "_trackers_installed", "_engine_available", "_devices_present", "_cluster_answers",
        "_quantization_possible", "_optimizer_available"]  # fmt: skip
    assert all(rule.__doc__ for rule in PREFLIGHT_RULES)
    check_before_loading(load_config(None, []))
    config = load_config(None, ["quantization.bits=4"])  # a frozen base, and nothing to train
    with pytest.raises(ConfigError, match="freezes the base weights"):
        check_before_loading(config)

    def missing(report_to):
        raise ConfigError("a tracker is missing")

    monkeypatch.setattr("tba.run.require_trackers", missing)
    with pytest.raises(ConfigError, match="a tracker is missing"):  # the first rule, first
        check_before_loading(config)


def test_a_phase_holds_for_its_block_and_until_the_next_one():
    stop = StopRequest()
    assert (stop.phase, stop.after_step) == ("while starting", False)
    with stop.during("while training", after_step=True):
        assert (stop.phase, stop.after_step) == ("while training", True)
    # What closes after the block is still its end; a first signal no longer waits for a step.
    assert (stop.phase, stop.after_step) == ("while training", False)
    with stop.during("during the final evaluation"):
        assert (stop.phase, stop.after_step) == ("during the final evaluation", False)


def test_a_phase_left_by_an_exception_stays_for_the_line_that_says_where_the_run_was():
    stop = StopRequest()
    with pytest.raises(KeyboardInterrupt), stop.during("while training", after_step=True):
        raise KeyboardInterrupt
    assert (stop.phase, stop.after_step) == ("while training", True)


# ---------------------------------------------------------------------------- policy.dtype=auto


@pytest.fixture
def policy_dir(tiny_model, tokenizer, tmp_path) -> Path:
    tiny_model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    return tmp_path / "policy"


def test_auto_is_the_default_and_a_run_decides_it_once_in_one_line(policy_dir):
    config = load_config(None, ["policy.device=cpu"])
    assert config.policy.dtype == "auto"
    lines = []
    decided = with_concrete_dtype(config, policy_dir, None, lines.append)
    assert decided.policy.dtype == "float32"  # the tiny policy, on any CPU
    assert config.policy.dtype == "auto"  # the caller's config is left as it was
    assert len(lines) == 1 and lines[0].startswith("policy.dtype=auto: float32 (")
    pinned = load_config(None, ["policy.device=cpu", "policy.dtype=bfloat16"])
    assert with_concrete_dtype(pinned, policy_dir, None, lines.append).policy.dtype == "bfloat16"
    assert lines[-1].startswith("policy.dtype=bfloat16 (as set")


def test_a_resumed_auto_run_keeps_the_dtype_it_was_trained_in(policy_dir):
    """Decided again on another machine, `auto` could differ from what the checkpoint's weights
    and optimizer state were trained in: the run goes on in that dtype."""
    config = load_config(None, ["policy.device=cpu"])
    for trained in ("bfloat16", "float32"):
        saved = load_config(None, [f"policy.dtype={trained}"]).model_dump()
        checkpoint = Checkpoint(Path("step000002"), {"step": 2, "config": saved})
        lines = []
        decided = with_concrete_dtype(config, policy_dir, checkpoint, lines.append)
        assert decided.policy.dtype == trained
        assert lines == [f"policy.dtype=auto: {trained} (the dtype this run was trained in)"]


def test_a_trl_script_that_says_bf16_false_trains_in_float32():
    assert from_trl({"bf16": False}).settings["policy.dtype"] == "float32"
    assert from_trl({"bf16": True}).settings["policy.dtype"] == "bfloat16"
    assert "policy.dtype" not in from_trl({"bf16": None}).settings
    dtype = {"model_init_kwargs": {"dtype": "float32"}}
    assert from_trl(dtype).settings["policy.dtype"] == "float32"
    # bf16 named by one argument wins over float32 named by another, in either order.
    for arguments in ({"bf16": True, **dtype}, {**dtype, "bf16": True},
                      {"bf16": False, "model_init_kwargs": {"dtype": "bfloat16"}}):  # fmt: skip
        assert from_trl(arguments).settings["policy.dtype"] == "bfloat16"


# ------------------------------------------------------------------- eval.every_minutes=auto


def eval_config(*overrides: str):
    return load_config(None, ["task.num_eval=256", "task.num_eval_pass_k=128", "eval.pass_k=16",
                              *overrides])  # fmt: skip


TASK = SimpleNamespace(evaluate=None, eval_rows=[{}] * 256)


def evaluated_at(schedule: EvalSchedule, step_seconds: float, eval_seconds: float,
                 minutes: float = 30) -> list[float]:  # fmt: skip
    """A fake clock: steps of `step_seconds` and evaluations of `eval_seconds`, as the loop runs
    them, for `minutes`; the training seconds at which each evaluation began."""
    return run_clock(schedule, step_seconds, eval_seconds, minutes * 60)[0]


def run_clock(schedule: EvalSchedule, step_seconds: float, eval_seconds: float, until: float,
              clock: float = 0.0, step: int = 0) -> tuple[list[float], float, int]:  # fmt: skip
    """`evaluated_at` from `clock` and `step` on, to `until`; also the clock and step it ends at."""
    starts = []
    while clock < until:
        step += 1
        clock += step_seconds
        if schedule.due(step, clock):
            starts.append(clock)
            clock += eval_seconds
            schedule.evaluated(clock, eval_seconds)
    return starts, clock, step


def test_auto_evaluates_a_fast_policy_exactly_as_every_half_minute_did():
    fixed = evaluated_at(EvalSchedule(eval_config("eval.every_minutes=0.5"), TASK, 9.0), 0.3, 1.5)
    auto = evaluated_at(EvalSchedule(eval_config(), TASK, 9.0), 0.3, 1.5)
    assert auto == fixed and len(fixed) >= 59
    assert [round(start // 30) for start in fixed[:3]] == [1, 2, 3]


def test_auto_keeps_held_out_evaluation_to_about_a_tenth_of_a_slow_policys_run():
    """SmolLM2-135M on two CPU cores: a minute an evaluation. Every half minute, it would spend
    two thirds of its run evaluating."""
    fixed = evaluated_at(EvalSchedule(eval_config("eval.every_minutes=0.5"), TASK, None), 3, 60)
    assert len(fixed) * 60 > 0.6 * 30 * 60
    auto = evaluated_at(EvalSchedule(eval_config(), TASK, 9 * 60.0), 3, 60, minutes=120)
    assert 0.08 < len(auto) * 60 / (120 * 60) <= 0.1
    assert all(b - a >= 10 * 60 for a, b in zip(auto, auto[1:]))  # 9 minutes after each end
    # The first by the base policy's evaluation, of which the greedy pass@1 is a ninth here: a
    # minute, so the first half-minute mark after 9 minutes.
    assert greedy_share(TASK, eval_config()) == pytest.approx(1 / 9)
    assert auto[0] == 9 * 60 + 30


def test_explicit_minutes_and_steps_keep_their_meaning():
    every_two = evaluated_at(EvalSchedule(eval_config("eval.every_minutes=2"), TASK, 99.0), 1, 60)
    assert [round(start) for start in every_two[:3]] == [120, 240, 360]
    steps = EvalSchedule(eval_config("eval.every=5"), TASK, 99.0)
    assert [step for step in range(1, 16) if steps.due(step, 1e6)] == [5, 10, 15]
    assert steps.line() is None
    never = EvalSchedule(eval_config("eval.every_minutes=null"), TASK, 1.0)
    assert evaluated_at(never, 1, 1) == []
    with pytest.raises(ConfigError, match="eval.every_minutes"):
        load_config(None, ["eval.every_minutes=sometimes"])


def test_a_resumed_schedule_continues_as_the_uninterrupted_one():
    """The loop's checkpoint keeps `next` (as `next_eval`): a run resumed from it, which has no
    base evaluation to time, evaluates when the uninterrupted run would have."""
    whole, _, _ = run_clock(EvalSchedule(eval_config(), TASK, 540.0), 3, 60, 3600)
    first = EvalSchedule(eval_config(), TASK, 540.0)
    before, clock, step = run_clock(first, 3, 60, 1500)
    resumed = EvalSchedule(eval_config(), TASK, None)
    resumed.next = first.next
    after, _, _ = run_clock(resumed, 3, 60, 3600, clock, step)
    assert len(before) >= 2 and after and before + after == whole
    assert EvalSchedule(eval_config(), TASK, None).line() == (
        "held-out evaluation next at 0.5 min of training (eval.every_minutes=auto: 0.5 min, or "
        "9x as long as an evaluation takes when that is longer)")  # fmt: skip


def test_the_start_line_says_how_often():
    line = EvalSchedule(eval_config(), TASK, 9.0).line()
    assert line == ("held-out evaluation every 0.5 min (eval.every_minutes=auto: 0.5 min, or 9x as "
                    "long as an evaluation takes when that is longer; one takes about 1.0 s, by "
                    "the base policy's)")  # fmt: skip
    assert next_eval_time(0.0, 30.0, 60.0) == 540 + 30


# ------------------------------------------------------------------------------- a whole run


@pytest.mark.slow
def test_an_auto_run_decides_its_dtype_once_and_resumes_with_its_schedule(tmp_path):
    """policy.dtype=auto and eval.every_minutes=auto, the defaults: config.yaml and the
    checkpoints have the dtype decided, the checkpoint when the next evaluation is due, and a
    resumed run, given `auto` again (as the Python API gives it), goes on with both."""
    overrides = [*FAST, f"pretrain.cache_dir={tmp_path / 'cache'}", "eval.every=null",
                 f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    out = io.StringIO()
    console = Console(file=out, width=400, markup=False, emoji=False)
    config = load_config(None, [*overrides, "train.max_steps=2"])
    assert (config.policy.dtype, config.eval.every_minutes) == ("auto", "auto")
    run_dir = train(config, console)
    log = out.getvalue()
    assert log.count("policy.dtype=auto: float32 (") == 1
    assert "held-out evaluation every 0.5 min (eval.every_minutes=auto" in log
    assert load_config(run_dir / "config.yaml").policy.dtype == "float32"
    state = latest_checkpoint(run_dir).state
    assert state["config"]["policy"]["dtype"] == "float32"
    assert state["loop"]["next_eval"] == 30.0  # a two-step run never reaches it
    notes = [line for line in log.splitlines() if "gradient checkpointing" in line]
    assert len(notes) == 1  # said when decided, not at every step
    assert "gradient checkpointing off (train.gradient_checkpointing=auto)" in notes[0]

    out.truncate(0)
    resumed = train(load_config(None, [*overrides, "train.max_steps=4"]), console, resume=True)
    log = out.getvalue()
    assert resumed == run_dir
    assert "policy.dtype=auto: float32 (the dtype this run was trained in)" in log
    assert "held-out evaluation next at 0.5 min of training" in log
    assert latest_checkpoint(run_dir).step == 4
