"""Faults a user found after the first table of docs/faults.md (its items 6 to 9), each met as the
user met it, through `tba` (its `main`, in this process, or a process of its own) and, where
Python is involved, through `TBATrainer`:

6. a reward returning strings ("1" for a right answer, 0.0 otherwise) trained on its zeros alone
   and ended with status 0: a value that is no number now stops the run at once, naming it;
7. a finished run resumed with a higher `train.max_steps` under a decaying learning rate trained
   its first step at 0, then jumped back up: the decay now goes on from the last step's rate;
8. `push_to_hub` offline was one line and status 0: it now raises after saving, saying where
   the policy is kept;
9. a deleted `.lock` let a second start in (the run directory itself is locked now); a resume
   with another trainer (`train.loss`, `train.ppo.value_model`) named state-dict keys, not the
   setting; `tba eval` of a live run said to start it again; an empty CSV prompt cell had a
   self-contradicting message; the README evaluated a directory no default run makes; a TRL
   batch of single completions with `ppo` blamed `train.group_size=1`, which the script never
   set; an error named pydantic's internal key (`searchers.num_gpus.constrained-float`).
"""

from __future__ import annotations

import decimal
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch

from benchmarks.faults import FAST, Workspace
from tba import TBAConfig, TBATrainer
from tba.api import PushToHubError
from tba.checkpoint import check_compatible
from tba.cli import main
from tba.errors import CheckpointError, ConfigError, DatasetError, RewardError
from tba.locks import FileLock, Locked
from tba.lr_schedule import LRSchedule, lr_factor
from tba.rewards.scorer import RewardScorer
from tba.run_dir import LOCK_FILE, RunBusyError, read_metrics

ROOT = Path(__file__).resolve().parents[1]
REWARDS = textwrap.dedent('''
    def strings(completions, **kwargs):
        """"1" for a right answer (here every other one), 0.0 otherwise."""
        return ["1" if i % 2 else 0.0 for i in range(len(completions))]
''')


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    """A tiny policy, rows and reward functions (`benchmarks.faults`), and `strings`."""
    workspace = Workspace(tmp_path / "ws")
    (workspace.root / "more_rewards.py").write_text(REWARDS)
    return workspace


def tba(args: list[str], capsys) -> tuple[int, list[str]]:
    """`tba ARGS` in this process: its exit status and the lines it wrote to stderr."""
    capsys.readouterr()
    status = main(args)
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def errors(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("tba: error:")]


def rates(run: Path) -> list[float]:
    return [r["learning_rate"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def works(completions, **_):
    return [float(len(c) % 3) for c in completions]


def strings(completions, **_):
    """"1" for a right answer (here every other one), 0.0 otherwise."""
    return ["1" if i % 2 else 0.0 for i in range(len(completions))]


# ------------------------------------------------------------------ 6. rewards that are strings


def test_a_value_that_is_no_number_stops_the_scorer_at_once_and_numbers_are_read():
    scorer = RewardScorer([strings])
    with pytest.raises(RewardError, match=r"reward function 'strings' returned '1', a str, for 2 "
                       r"of 4 completions: .*return float\('1'\)"):  # fmt: skip
        scorer.score(["p"] * 4, ["a"] * 4, [[1]] * 4, {})
    for wrong in ["high", b"1", [1.0], {"reward": 1.0}, np.array([1.0, 2.0]), object()]:
        with pytest.raises(RewardError, match=f"a {type(wrong).__name__}, for 1 of 4"):
            RewardScorer([lambda completions, **_: [0.0, 0.0, 0.0, wrong]]).score(  # noqa: B023
                ["p"] * 4, ["a"] * 4, [[1]] * 4, {})  # fmt: skip
    # What TRL reads as numbers is read as numbers, whatever its type.
    typed = [np.float32(0.5), np.bool_(True), torch.tensor(2.0), decimal.Decimal("0.25")]
    scores = RewardScorer([lambda completions, **_: typed]).score(["p"] * 4, ["a"] * 4,
                                                                  [[1]] * 4, {})  # fmt: skip
    assert scores.totals == [0.5, 1.0, 2.0, 0.25] and scores.faults == []


@pytest.mark.slow
def test_a_reward_of_strings_stops_the_run_and_the_trainer_before_a_step(workspace, tmp_path,
                                                                         capsys):  # fmt: skip
    rewards = workspace.root / "more_rewards.py"
    run = tmp_path / "run"
    status, lines = tba(["train", *FAST, *workspace.task(eval_func="works"),
                         f"task.reward_funcs=[{rewards}:strings]", f"output_dir={run}"],
                        capsys)  # fmt: skip
    assert status == 1 and len(errors(lines)) == 1, lines
    assert "reward function 'strings' returned '1', a str, for 4 of 8 completions" in lines[-1]
    assert "return float('1')" in lines[-1]
    assert rates(run) == [] and not (run / "checkpoints").exists()  # nothing trained on
    # The same through TBATrainer: the error, not a run of zeros.
    config = TBAConfig.from_overrides([*FAST, f"output_dir={tmp_path / 'api'}"])
    with pytest.raises(RewardError, match="returned '1', a str, for 4 of 8 completions"):
        TBATrainer(str(workspace.policy), strings, args=config, eval_func=works,
                   train_dataset=[{"prompt": f"Q{i}\n"} for i in range(8)]).train()  # fmt: skip
    assert rates(tmp_path / "api") == []


# ------------------------------------------------- 7. a longer limit under a decaying schedule


def schedule(total: int, kind: str = "linear", warmup: int = 0) -> LRSchedule:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return LRSchedule(optimizer, kind, warmup, total)


def run_steps(scheduler: LRSchedule, steps: int) -> list[float]:
    taken = []
    for _ in range(steps):
        taken.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return taken


def resumed(scheduler: LRSchedule, total: int, warmup: int = 0) -> LRSchedule:
    """`scheduler`'s state, as a checkpoint's state.json gives it back, in a run of `total`."""
    again = schedule(total, scheduler.lr_schedule, warmup)
    again.optimizer.load_state_dict(scheduler.optimizer.state_dict())
    again.load_state_dict(json.loads(json.dumps(scheduler.state_dict())))
    return again


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_a_longer_limit_decays_on_from_the_last_rate_and_the_same_limit_goes_on_as_before(kind):
    first = schedule(4, kind)
    before = run_steps(first, 4)
    after = run_steps(resumed(first, 8), 4)
    last = lr_factor(3, kind, 0, 4)
    expected = [lr_factor(step, kind, 0, 8, decay_from=(3, last)) for step in range(4, 8)]
    assert after == pytest.approx(expected, abs=1e-12)
    taken = before + after
    assert all(a > b > 0 for a, b in zip(taken, taken[1:]))  # never up, never 0
    # Resumed twice, the second time with the same limit: the extended schedule goes on.
    extended = resumed(first, 8)
    run_steps(extended, 2)
    assert run_steps(resumed(extended, 8), 2) == pytest.approx(expected[2:], abs=1e-12)
    # Interrupted and resumed with its own limit: what it would have done uninterrupted.
    whole, half = schedule(8, kind), schedule(8, kind)
    run_steps(half, 3)
    assert run_steps(whole, 8)[3:] == pytest.approx(run_steps(resumed(half, 8), 5), abs=1e-12)


def test_a_warmup_under_way_stays_and_an_old_checkpoint_that_ended_at_0_decays_on():
    warming = schedule(4, "linear", warmup=3)
    run_steps(warming, 2)
    again = resumed(warming, 8, warmup=4)  # a warmup ratio would give another length
    assert run_steps(again, 6) == pytest.approx(
        [lr_factor(s, "linear", 3, 8) for s in range(2, 8)], abs=1e-12)  # fmt: skip
    # A checkpoint written before the schedule kept its limit: LambdaLR's state alone.
    old = schedule(4)
    run_steps(old, 4)
    added = ("lr_schedule", "warmup_steps", "total_steps", "decay_from")
    state = {key: value for key, value in old.state_dict().items() if key not in added}
    new = schedule(8)
    new.optimizer.load_state_dict(old.optimizer.state_dict())
    new.load_state_dict(state)
    assert run_steps(new, 4) == pytest.approx([0.2, 0.15, 0.1, 0.05], abs=1e-12)


@pytest.mark.slow
def test_a_finished_run_resumed_with_a_higher_max_steps_never_trains_at_0(workspace, tmp_path,
                                                                          capsys):  # fmt: skip
    run = tmp_path / "run"
    settings = [*FAST, *workspace.task(), "train.lr_schedule=linear", f"output_dir={run}"]
    assert tba(["train", *settings, "train.max_steps=4"], capsys)[0] == 0
    status, lines = tba(["train", "--resume", str(run), "train.max_steps=4"], capsys)
    assert status == 2 and "train.max_steps=8" in lines[-1]  # what the refusal recommends
    assert tba(["train", "--resume", str(run), "train.max_steps=8"], capsys)[0] == 0
    rate = TBAConfig.from_overrides(FAST).train.learning_rate
    assert rates(run) == pytest.approx([rate * f for f in (1, 0.75, 0.5, 0.25, 0.2, 0.15, 0.1,
                                                           0.05)], rel=1e-9)  # fmt: skip
    # The same through TBATrainer, with a cosine decay.
    api = tmp_path / "api"
    rows = [{"prompt": f"Q{i}\n"} for i in range(8)]
    for steps, resume in [(4, False), (8, True)]:
        config = TBAConfig.from_overrides([*FAST, "train.lr_schedule=cosine",
                                           f"train.max_steps={steps}", f"output_dir={api}"])
        TBATrainer(str(workspace.policy), works, args=config,
                   train_dataset=rows).train(resume_from_checkpoint=resume)  # fmt: skip
    taken = rates(api)
    assert len(taken) == 8 and all(a > b > 0 for a, b in zip(taken, taken[1:])), taken


# ------------------------------------------------------------------------ 8. push_to_hub offline


PUSHING = textwrap.dedent('''
    import sys
    from tba import TBAConfig, TBATrainer

    def reward(completions, **kwargs):
        return [float(len(c) % 3) for c in completions]

    config = TBAConfig(output_dir=sys.argv[2], push_to_hub=True, max_steps=1,
                       train={"mode": "sync"}, searchers={"count": 0},
                       per_device_train_batch_size=4, num_generations=4,
                       max_completion_length=8, task={"num_eval": 4})
    trainer = TBATrainer(sys.argv[1], reward, args=config,
                         train_dataset=[{"prompt": f"Q{i}"} for i in range(8)])
    trainer.train()
    print("the script went on as if the model were on the Hub")
''')


@pytest.mark.slow
def test_a_failed_upload_raises_after_saving_and_a_script_exits_with_an_error(
    workspace, tmp_path, monkeypatch
):  # fmt: skip
    run = tmp_path / "run"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    config = TBAConfig(**TBAConfig.from_overrides([*FAST, f"output_dir={run}"]).model_dump(),
                       push_to_hub=True)  # fmt: skip
    trainer = TBATrainer(str(workspace.policy), works, args=config,
                         train_dataset=[{"prompt": f"Q{i}\n"} for i in range(8)])  # fmt: skip
    with pytest.raises(PushToHubError, match=f"run was not uploaded .*kept in {run / 'final'}"):
        trainer.train()
    assert (run / "final" / "config.json").is_file() and (run / "eval.json").is_file()
    # A script, run from the command line: a failed upload is not a success to a scheduler.
    script = tmp_path / "script.py"
    script.write_text(PUSHING)
    done = subprocess.run([sys.executable, str(script), str(workspace.policy), str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=600,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert done.returncode == 1 and "went on" not in done.stdout, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tba.api.PushToHubError: push_to_hub: s was not uploaded")
    assert f"kept in {tmp_path / 's' / 'final'}" in last
    assert (tmp_path / "s" / "final" / "config.json").is_file()


# ---------------------------------------------------------------- 9a and 9c. a run in progress


def test_a_deleted_lock_file_does_not_let_a_second_process_in(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    first = FileLock(run / LOCK_FILE, directory=True)
    first.acquire()
    try:
        (run / LOCK_FILE).unlink()  # what a user may do to a running run
        second = FileLock(run / LOCK_FILE, directory=True)
        # flock: two open files of one process exclude each other as two processes would.
        with pytest.raises(Locked, match=f"locked by process {os.getpid()}"):
            second.acquire()
        assert second.directory_descriptor is None and not (run / LOCK_FILE).exists()
        assert second.holder()["pid"] == os.getpid()
    finally:
        first.release()
    assert FileLock(run / LOCK_FILE, directory=True).holder() is None
    assert sorted(p.name for p in run.iterdir()) == []  # the probe made no file


@pytest.mark.slow
def test_a_live_run_without_its_lock_file_is_neither_replaced_nor_evaluated(workspace, tmp_path,
                                                                            capsys):  # fmt: skip
    run = tmp_path / "run"
    settings = [*FAST, *workspace.task(), f"output_dir={run}"]
    first = subprocess.Popen([sys.executable, "-m", "tba.cli", "train", *settings,
                              "train.max_steps=100000", "train.max_minutes=5"],
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not rates_or_none(run) and first.poll() is None:
            time.sleep(0.2)
        assert first.poll() is None, first.stderr.read()
        (run / LOCK_FILE).unlink()
        config = (run / "config.yaml").read_bytes()
        for args in (["train", *settings], ["train", *settings, "--overwrite"]):
            status, lines = tba(args, capsys)
            assert status == 2 and len(errors(lines)) == 1, lines
            assert f"run directory {run} is in use by process {first.pid}" in lines[-1]
        config_api = TBAConfig.from_overrides([*FAST, f"output_dir={run}"])
        with pytest.raises(RunBusyError, match=f"process {first.pid}"):
            TBATrainer(str(workspace.policy), works, args=config_api,
                       train_dataset=[{"prompt": "Q\n"}]).train()  # fmt: skip
        # 9c: evaluated while it trains, it is said to be in progress, by whom.
        status, lines = tba(["eval", str(run)], capsys)
        assert status == 2 and len(errors(lines)) == 1, lines
        assert f"the run is in progress, held by process {first.pid}" in lines[-1]
        assert "evaluate it when it ends" in lines[-1] and "start it again" not in lines[-1]
        assert (run / "config.yaml").read_bytes() == config
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=300)
    assert first.returncode == 143 and (run / "final" / "config.json").is_file()
    assert any((run / "checkpoints").glob("step*/state.json"))


def rates_or_none(run: Path) -> list[float]:
    return rates(run) if (run / "metrics.jsonl").exists() else []


# ----------------------------------------------------- 9b. a resume with another trainer's state


def test_a_trainer_of_other_parts_is_named_by_its_settings_old_names_too(tmp_path):
    tb = {"train": {"loss": "tb", "tb": {"log_z": "vargrad"}}}
    path = tmp_path / "step000004"
    with pytest.raises(CheckpointError, match=r"train.loss='tb' \(this run: 'ppo'\): a trainer "
                       "with no critic or learned log Z does not resume as one with a value head"):
        check_compatible(tb, {"train": {"loss": "ppo"}}, path)
    old_ppo = {"train": {"loss": "ppo", "value_model": "head"}}  # before train.ppo
    with pytest.raises(CheckpointError, match=r"train.ppo.value_model='head' \(this run: "
                       "'critic'\\): a trainer with a value head does not resume as one with a "
                       "critic LM"):  # fmt: skip
        check_compatible(old_ppo, {"train": {"loss": "ppo", "ppo": {"value_model": "critic"}}},
                         path)  # fmt: skip
    check_compatible(tb, {"train": {"loss": "grpo"}}, path)  # the same parts: it resumes


@pytest.mark.slow
def test_a_resume_with_another_loss_or_value_model_names_the_setting(workspace, tmp_path,
                                                                     capsys):  # fmt: skip
    run, api = tmp_path / "run", tmp_path / "api"
    assert tba(["train", *FAST, *workspace.task(), "train.loss=ppo", f"output_dir={run}"],
               capsys)[0] == 0  # fmt: skip
    for change, then, now in [("train.loss=tb", "'ppo'", "'tb'"),
                              ("train.ppo.value_model=critic", "'head'", "'critic'")]:
        key = change.partition("=")[0]
        status, lines = tba(["train", "--resume", str(run), "train.max_steps=6", change], capsys)
        assert status == 2 and len(errors(lines)) == 1, lines
        assert f"was written with {key}={then} (this run: {now})" in lines[-1]
        assert "state_dict" not in lines[-1] and "Missing key" not in lines[-1]
    rows = [{"prompt": f"Q{i}\n"} for i in range(8)]
    for loss, steps, resume in [("ppo", 3, False), ("tb", 6, True)]:
        config = TBAConfig.from_overrides([*FAST, f"train.loss={loss}", f"train.max_steps={steps}",
                                           f"output_dir={api}"])  # fmt: skip
        trainer = TBATrainer(str(workspace.policy), works, args=config, train_dataset=rows)
        if not resume:
            trainer.train()
            continue
        with pytest.raises(CheckpointError, match=r"train.loss='ppo' \(this run: 'tb'\)"):
            trainer.train(resume_from_checkpoint=True)


# ---------------------------------------------------------------- 9d. an empty CSV prompt cell


def test_an_empty_prompt_cell_is_said_to_be_empty(workspace, tmp_path, capsys):
    data = tmp_path / "rows.csv"
    data.write_text("prompt,answer\nQ1,1\n,2\nQ3,3\n")
    status, lines = tba(["train", *FAST, *workspace.task(), f"task.train_path={data}",
                         f"output_dir={tmp_path / 'run'}"], capsys)  # fmt: skip
    assert status == 2 and lines == [f"tba: error: {data}: row 2's `prompt` is empty: every row "
                                     "needs a prompt (text or a conversation)"], lines
    config = TBAConfig.from_overrides([*FAST, f"output_dir={tmp_path / 'api'}"])
    with pytest.raises(DatasetError, match="row 2's `prompt` is empty"):
        TBATrainer(str(workspace.policy), works, args=config,
                   train_dataset=[{"prompt": "Q1"}, {"prompt": None}])  # fmt: skip


def test_an_empty_text_prompt_is_refused_as_an_empty_cell_is(workspace, tmp_path, capsys):
    """A prompt of "" (JSON, a Python list of rows): trained on, it would have been nothing but
    the chat template; every prompt empty trained to the end without a word."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "Q1", "answer": "1"}\n{"prompt": "  ", "answer": "2"}\n')
    status, lines = tba(["train", *FAST, *workspace.task(), f"task.train_path={data}",
                         f"output_dir={tmp_path / 'run'}"], capsys)  # fmt: skip
    assert status == 2 and lines == [f"tba: error: {data}: row 2's `prompt` is empty: every row "
                                     "needs a prompt (text or a conversation)"], lines
    config = TBAConfig.from_overrides([*FAST, f"output_dir={tmp_path / 'api'}"])
    with pytest.raises(DatasetError, match="row 1's `prompt` is empty"):
        TBATrainer(str(workspace.policy), works, args=config,
                   train_dataset=[{"prompt": ""}, {"prompt": ""}])  # fmt: skip


# ------------------------------------------------------------------- 9e. the README's example


def test_the_readme_evaluates_a_directory_a_default_run_makes():
    readme = (ROOT / "README.md").read_text()
    assert "runs/default" not in readme
    default = re.compile(r"runs/\d{8}-\d{6}")  # runs/%Y%m%d-%H%M%S, as create_run_dir names it
    examples = [line for line in readme.splitlines() if line.startswith(("tba eval", "tba plot"))]
    assert examples and all(default.search(line) for line in examples)
    assert default.fullmatch("runs/" + time.strftime("%Y%m%d-%H%M%S"))
    assert 'Path("runs") / time.strftime("%Y%m%d-%H%M%S")' in (
        ROOT / "src" / "tba" / "run_dir" / "create.py").read_text()  # fmt: skip


def test_a_trl_batch_of_single_completions_with_ppo_names_the_scripts_arguments():
    with pytest.raises(ConfigError) as error:
        TBAConfig(per_device_train_batch_size=3, num_generations=4, generation_batch_size=12,
                  train={"loss": "ppo"})  # fmt: skip
    message = str(error.value)
    assert message.startswith("per_device_train_batch_size=3, num_generations=4")
    assert "train.loss=ppo cannot" in message and "train.group_size" not in message
    # A loss with group statistics trains them, from the generation's other completions.
    assert TBAConfig(per_device_train_batch_size=3, num_generations=4,
                     generation_batch_size=12).train.group_size == 1  # fmt: skip


@pytest.mark.parametrize(("override", "line"), [
    ("searchers.num_gpus=foo", "invalid value for searchers.num_gpus: Input should be a valid "
     "number, or Input should be 'auto' (got 'foo')"),
    ("searchers.num_gpus=-1", "invalid value for searchers.num_gpus: Input should be greater "
     "than or equal to 0, or Input should be 'auto' (got -1)"),
    ("task.reward_weights=[1,x]", "invalid value for task.reward_weights.1: Input should be a "
     "valid number (got 'x')"),
])  # fmt: skip
def test_an_error_names_the_setting_never_pydantics_internal_key(override, line, capsys):
    assert main(["config", override]) == 2
    assert capsys.readouterr().err.strip() == f"tba: error: {line}"
