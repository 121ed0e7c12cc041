"""Faults at a run's edges, through `TBATrainer` and `tba` in this process: a finished run replaced
by one that fails stays as it was (and a start killed while replacing it gives it back); a run
whose end (final evaluation, eval.json, final/) was cut short is finished by `--resume` without
training; Ctrl-C and SIGTERM outside the training loop are one line that says what is kept and how
to go on; a full disk at the end and read-only places for `tba eval` and `tba plot` are one line,
never a traceback. `benchmarks.fault_ends` runs the same faults in processes of their own."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

import tba.offline_eval
import tba.plots
import tba.run
from benchmarks.faults import FAST as TINY_RUN
from benchmarks.faults import Workspace
from tba import TBAConfig, TBATrainer
from tba.checkpoint import list_checkpoints
from tba.cli import main
from tba.errors import Interrupted, RewardError, RunError
from tba.interrupts import stop_on_interrupt
from tba.run_dir import (
    MOVING,
    REPLACED,
    RunExistsError,
    read_metrics,
    run_ended,
    settle_replacement,
)
from tba.runtime import ray_cluster

ROWS = [{"prompt": f"Q{i}\n"} for i in range(8)]


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    """A tiny policy, rows and reward functions (`benchmarks.faults`)."""
    return Workspace(tmp_path / "ws")


@pytest.fixture(autouse=True)
def wide_logs(monkeypatch):
    """Log lines unwrapped (rich reads COLUMNS), to read what they say."""
    monkeypatch.setenv("COLUMNS", "400")


def works(completions, **_):
    return [float(len(c) % 3) for c in completions]


def raises(completions, **_):
    raise ValueError("no such column")


def trainer(workspace: Workspace, run_dir: Path, reward=works, *settings: str,
            eval_func=None) -> TBATrainer:  # fmt: skip
    config = TBAConfig.from_overrides([*TINY_RUN, f"output_dir={run_dir}", *settings])
    return TBATrainer(str(workspace.policy), reward, args=config, train_dataset=ROWS,
                      eval_func=eval_func)  # fmt: skip


def kept(run_dir: Path) -> dict[str, bytes]:
    """What a finished run holds, byte for byte: its summary, metrics, checkpoints, final policy."""
    names = ["eval.json", "metrics.jsonl"]
    names += [str(p.relative_to(run_dir)) for p in (run_dir / "checkpoints").rglob("*")
              if p.is_file()]  # fmt: skip
    names += [str(p.relative_to(run_dir)) for p in (run_dir / "final").rglob("*") if p.is_file()]
    return {name: (run_dir / name).read_bytes() for name in names}


# ------------------------------------------------------------------------- replacing a run


@pytest.mark.slow
def test_a_rerun_through_the_api_keeps_the_finished_run_until_it_has_a_checkpoint(
    workspace, tmp_path, capsys
):  # fmt: skip
    run_dir = tmp_path / "run"
    trainer(workspace, run_dir).train()
    before = kept(run_dir)
    capsys.readouterr()
    with pytest.raises(RewardError, match="'raises' failed on all 4 completions"):
        trainer(workspace, run_dir, raises).train()  # TBATrainer.train() replaces by default
    err = capsys.readouterr().err
    assert (f"replacing the finished run in {run_dir} (final/, 1 checkpoint, the newest "
            "step000003) once this run has its first checkpoint; train(overwrite=False) keeps "
            "it") in err  # fmt: skip
    assert f"kept the finished run in {run_dir}" in err
    assert kept(run_dir) == before
    assert not (run_dir / REPLACED).exists() and not (run_dir / MOVING).exists()

    with pytest.raises(RunExistsError, match="trainer.train\\(resume_from_checkpoint=True\\)"):
        trainer(workspace, run_dir).train(overwrite=False)
    result = trainer(workspace, run_dir, works, "train.max_steps=2").train()  # replaces it now
    assert result["steps"] == 2 and [p.name for p in list_checkpoints(run_dir)] == ["step000002"]
    assert not (run_dir / REPLACED).exists() and run_ended(run_dir)


@pytest.mark.slow
def test_an_overwrite_interrupted_at_its_start_gives_the_run_back(workspace, tmp_path, capsys):
    run_dir = tmp_path / "run"
    settings = [*TINY_RUN, *workspace.task(), f"output_dir={run_dir}"]
    assert main(["train", *settings]) == 0
    before = kept(run_dir)
    signalled = [*workspace.task("works", "signals"), "--overwrite"]
    env = {"TBA_FAULT_SIGNAL": "SIGINT", "TBA_FAULT_STEP": "0",
           "TBA_FAULT_ONCE": str(tmp_path / "signalled")}  # fmt: skip
    with environment(env):
        capsys.readouterr()
        assert main(["train", *settings, *signalled]) == 130
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("tba:")]
    assert line == (f"tba: interrupted by SIGINT during the evaluation of the base policy; this "
                    f"run had no checkpoint yet: the finished run in {run_dir} (final/, 1 "
                    "checkpoint, the newest step000003) is kept, as it was")  # fmt: skip
    assert kept(run_dir) == before


def fake_run(path: Path, step: int = 3) -> None:
    """The files of a finished run (no weights worth loading: what is moved is compared)."""
    (path / "checkpoints" / f"step{step:06d}").mkdir(parents=True)
    (path / "checkpoints" / f"step{step:06d}" / "state.json").write_text('{"step": 3}')
    (path / "final").mkdir()
    for name in ("config.json", "model.safetensors"):
        (path / "final" / name).write_text(name)
    for name in ("eval.json", "config.yaml", "metrics.jsonl"):
        (path / name).write_text(name)


def test_a_start_killed_while_replacing_a_run_gives_it_back_at_the_next(tmp_path):
    # Killed after the old run was set aside, before the new one had a checkpoint.
    run_dir = tmp_path / "run"
    (run_dir / REPLACED).mkdir(parents=True)
    fake_run(run_dir / REPLACED)
    before = {str(p.relative_to(run_dir / REPLACED)): p.read_bytes()
              for p in (run_dir / REPLACED).rglob("*") if p.is_file()}  # fmt: skip
    (run_dir / "config.yaml").write_text("the new run's")
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (run_dir / "notes.txt").write_text("mine")
    said = []
    settle_replacement(run_dir, said.append)
    after = {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*")
             if p.is_file() and p.name != "notes.txt"}  # fmt: skip
    assert after == before and (run_dir / "notes.txt").read_text() == "mine"
    assert said == [f"kept the run in {run_dir} that a killed start had set aside: the run meant "
                    "to replace it stopped before its first checkpoint"]  # fmt: skip
    # Killed half-way through setting it aside: what was moved comes back.
    (run_dir / MOVING).mkdir()
    (run_dir / "final").rename(run_dir / MOVING / "final")
    settle_replacement(run_dir, said.append)
    assert run_ended(run_dir) and not (run_dir / MOVING).exists()
    # Killed after the new run had a checkpoint: the old one goes.
    (run_dir / REPLACED).mkdir()
    (run_dir / REPLACED / "eval.json").write_text("the old run's")
    settle_replacement(run_dir, said.append)
    assert not (run_dir / REPLACED).exists() and (run_dir / "eval.json").read_text() == "eval.json"


# ------------------------------------------------------------------------------ the end


NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.slow
def test_an_end_cut_short_by_a_full_disk_is_finished_by_resuming_through_the_api(
    workspace, tmp_path, monkeypatch, capsys
):  # fmt: skip
    run_dir = tmp_path / "run"
    save_policy = tba.run.save_policy

    def full_disk(model, path):
        raise NO_SPACE

    monkeypatch.setattr(tba.run, "save_policy", full_disk)
    trained = trainer(workspace, run_dir)
    with pytest.raises(RunError) as raised:
        trained.train()
    assert str(raised.value) == (
        f"cannot write the trained policy in {run_dir / 'final'} (No space left on device); "
        "eval.json is written; its training is complete and checkpointed (step000003): "
        "trainer.train(resume_from_checkpoint=True) evaluates and saves it, without training")
    assert not (run_dir / "final").exists() and not (run_dir / "final.partial").exists()
    monkeypatch.setattr(tba.run, "save_policy", save_policy)  # space freed
    capsys.readouterr()
    result = trained.train(resume_from_checkpoint=True)
    assert "but its end was not saved: evaluating and saving it, without training" in (
        capsys.readouterr().err)  # fmt: skip
    assert result["steps"] == 3 and run_ended(run_dir)
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 3]


@pytest.mark.slow
def test_a_full_disk_writing_eval_json_is_one_line_and_resume_finishes(
    workspace, tmp_path, monkeypatch, capsys
):  # fmt: skip
    run_dir = tmp_path / "run"
    write_whole = tba.run.write_whole

    def full_disk(path, text):
        if path.name == "eval.json":
            raise NO_SPACE
        write_whole(path, text)

    monkeypatch.setattr(tba.run, "write_whole", full_disk)
    assert main(["train", *TINY_RUN, *workspace.task(), f"output_dir={run_dir}"]) == 1
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tba:")]
    assert line == (f"tba: error: cannot write {run_dir / 'eval.json'} (No space left on device); "
                    "its training is complete and checkpointed (step000003): `tba train --resume "
                    f"{run_dir}` evaluates and saves it, without training")  # fmt: skip
    monkeypatch.setattr(tba.run, "write_whole", write_whole)  # space freed
    assert main(["eval", str(run_dir)]) == 2
    assert f"finish it with `tba train --resume {run_dir}`" in capsys.readouterr().err
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert run_ended(run_dir) and json.loads((run_dir / "eval.json").read_text())["steps"] == 3
    assert main(["train", "--resume", str(run_dir)]) == 2  # ended now: nothing left to do
    assert "already reached its limit" in capsys.readouterr().err


@pytest.mark.slow
def test_a_final_policy_a_kill_left_half_written_is_saved_again(workspace, tmp_path, capsys):
    """Runs written before final/ was saved under a temporary name: a kill in the save left its
    config without weights; `tba eval` sends to `--resume`, which saves it whole."""
    run_dir = tmp_path / "run"
    assert main(["train", *TINY_RUN, *workspace.task(), f"output_dir={run_dir}"]) == 0
    for weights in (run_dir / "final").glob("model*"):
        weights.unlink()
    assert main(["eval", str(run_dir)]) == 2
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert run_ended(run_dir) and main(["eval", str(run_dir)]) == 0


# --------------------------------------------------------------------------------- signals


@contextmanager
def environment(values: dict[str, str]):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def signal_at(step: int, name: str, once: Path):
    """An evaluation function that sends this process `name` at `step`'s evaluation, once."""

    def signals(completions, trainer_state, **_):
        if trainer_state.global_step == step and not once.exists():
            once.touch()
            os.kill(os.getpid(), signal.Signals[name])
        return [1.0] * len(completions)

    return signals


@pytest.mark.slow
def test_sigterm_in_the_final_evaluation_through_the_api_is_finished_by_resuming(
    workspace, tmp_path, capsys
):  # fmt: skip
    run_dir = tmp_path / "run"
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    trained = trainer(workspace, run_dir, eval_func=signal_at(3, "SIGTERM", tmp_path / "once"))
    with pytest.raises(Interrupted) as raised:
        trained.train()
    assert raised.value.signum == signal.SIGTERM
    assert str(raised.value) == (
        "by SIGTERM during the final evaluation; its training is complete and checkpointed "
        "(step000003): trainer.train(resume_from_checkpoint=True) evaluates and saves it, "
        "without training")
    assert {number: signal.getsignal(number) for number in handlers} == handlers
    assert not (run_dir / "eval.json").exists() and not (run_dir / "final").exists()
    assert trained.train(resume_from_checkpoint=True)["steps"] == 3 and run_ended(run_dir)


@pytest.mark.slow
def test_ctrl_c_in_the_first_evaluation_is_one_line_and_the_next_start_replaces_it(
    workspace, tmp_path, capsys
):  # fmt: skip
    run_dir = tmp_path / "run"
    env = {"TBA_FAULT_SIGNAL": "SIGINT", "TBA_FAULT_STEP": "0",
           "TBA_FAULT_ONCE": str(tmp_path / "signalled")}  # fmt: skip
    settings = [*TINY_RUN, *workspace.task("works", "signals"), f"output_dir={run_dir}"]
    with environment(env):
        assert main(["train", *settings]) == 130
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tba:")]
        assert lines == ["tba: interrupted by SIGINT during the evaluation of the base policy; "
                         "the run had no checkpoint yet: nothing to resume; start it again"]
        assert main(["train", *settings]) == 0  # the same command again
    assert "it stopped before its first checkpoint" in capsys.readouterr().err


def test_a_signal_outside_the_loop_stops_at_once_and_in_it_after_the_step():
    with stop_on_interrupt() as stop:
        stop.after_step = True
        os.kill(os.getpid(), signal.SIGTERM)  # in the loop: noted, the step goes on
        assert stop.is_set() and stop.signal == signal.SIGTERM and not stop.aborting
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second one: at once
        assert stop.aborting and stop.signal == signal.SIGINT
    with stop_on_interrupt() as stop:
        assert stop.phase == "while starting"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # outside the loop: at once
        assert stop.aborting and stop.signal == signal.SIGTERM
    with stop_on_interrupt() as stop:
        stop.hold()  # Ray shutting down: not cut short
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.held == signal.SIGTERM and not stop.aborting
        with pytest.raises(KeyboardInterrupt):
            stop.release()  # then as it would have been
        assert stop.aborting and stop.signal == signal.SIGTERM


def test_ray_init_keeps_the_signal_handlers_of_a_process_that_has_them():
    """`ray.init` sets a SIGTERM handler that exits wherever the process is (a C stack dump in
    Ray's waits): a run's own handlers stay, during and after it."""
    set_by_ray = []

    class Utils:
        @staticmethod
        def set_sigterm_handler(handler):
            set_by_ray.append(handler)
            signal.signal(signal.SIGTERM, handler)

    class Ray:
        class _private:  # noqa: N801 - Ray's own name
            utils = Utils

    def ours(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        with ray_cluster._signals_wait_for(Ray):
            Ray._private.utils.set_sigterm_handler(lambda signum, frame: None)  # what init does
            signal.signal(signal.SIGINT, signal.default_int_handler)
        assert set_by_ray == [] and signal.getsignal(signal.SIGTERM) is ours
        assert Ray._private.utils.set_sigterm_handler is Utils.set_sigterm_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------ places that cannot be written


@pytest.fixture
def disk(tmp_path):
    """A directory that `seal()` makes read-only: a tmpfs remounted read-only as root (whom
    permissions do not stop), else one without write permission."""
    path = tmp_path / "disk"
    path.mkdir()
    root = os.geteuid() == 0
    if root and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)],
                               capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("needs to mount a tmpfs (root's writes ignore permissions)")

    def seal() -> None:
        if root:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        else:
            for directory in [path, *(p for p in path.rglob("*") if p.is_dir())]:
                directory.chmod(0o555)

    try:
        yield path, seal
    finally:
        if root:
            subprocess.run(["umount", "-l", str(path)], check=False)
        else:
            for directory in [path, *(p for p in path.rglob("*") if p.is_dir())]:
                directory.chmod(0o755)


@pytest.mark.slow
def test_tba_eval_of_a_read_only_run_says_so_before_scoring(workspace, disk, monkeypatch, capsys):
    path, seal = disk
    run_dir = path / "run"
    assert main(["train", *TINY_RUN, *workspace.task("works", "works"),
                 f"output_dir={run_dir}"]) == 0  # fmt: skip
    seal()

    def score_final(*args, **kwargs):
        raise AssertionError("scored before finding that the scores cannot be written")

    monkeypatch.setattr(tba.offline_eval, "score_final", score_final)
    capsys.readouterr()
    assert main(["eval", str(run_dir)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"tba: error: cannot write the scores {run_dir / 'eval_final.json'} (")
    assert line.endswith("tba eval writes them into the run directory: make it writable, or copy "
                         "the run somewhere you can write")  # fmt: skip


def test_tba_plot_into_a_place_that_cannot_be_written_is_one_line(tmp_path, disk, monkeypatch,
                                                                  capsys):  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 0.0,
                                                       "eval_pass@1": 0.5}) + "\n")  # fmt: skip
    path, seal = disk
    (path / "notes").write_text("mine\n")
    seal()
    for out, status, message in [
        (path / "plot.png", 2, f"cannot write the plot {path / 'plot.png'} ("),
        (path / "plots" / "plot.png", 2, f"cannot write the plot {path / 'plots' / 'plot.png'} ("),
        (path / "notes" / "plot.png", 2, f"{path / 'notes'} is a file, not a directory"),
        (tmp_path, 2, f"cannot write the plot {tmp_path}: it is a directory"),
    ]:
        assert main(["plot", str(run_dir), "--out", str(out)]) == status
        [line] = capsys.readouterr().err.strip().splitlines()
        assert message in line and line.startswith("tba: error:")

    def fails(*args, **kwargs):  # a write that fails after the check (the disk filled)
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "plot.png"))

    monkeypatch.setattr(tba.plots, "plot_run_dirs", fails)
    assert main(["plot", str(run_dir), "--out", str(tmp_path / "plot.png")]) == 1
    assert capsys.readouterr().err == (f"tba: error: No space left on device: "
                                       f"{tmp_path / 'plot.png'}\n")  # fmt: skip
