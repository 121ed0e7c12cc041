"""Faults of a run's life as a user meets them, through `tba` (its `main`, in this process, or a
process of its own) and, where Python is involved, through `TBATrainer`:

1. a text from outside holding `[/...]` (a reward function's exception, a path) was read as rich
   markup and ended the run: every console tba makes prints text as it is;
2. a `tba train --overwrite` killed before its first checkpoint left the finished run in
   `.replaced/`: `tba eval` said to start it again, and `--resume` read the killed command's
   config and trained the old run on with it; the run is now put back before anything reads it;
3. `tba eval` and `--resume` imported the code a run directory names without a word: it runs
   now only as the user's own `tba train` recorded it there, or with --trust-code;
4. SIGTERM after Ray shut down took the default action, SIGHUP was not handled, Ctrl-C at an
   asynchronous start could end in a C crash;
5. a wrong Ray address was a traceback, an unreachable one a hang;
6. `tba config KEY` said "config file not found", a name too long for the file system exited 1.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tba.interrupts
import tba.run
from benchmarks.fault_harness import FAST, Workspace, error_lines, stepped
from tba import TBAConfig, TBATrainer
from tba.cli import main
from tba.config import dump_config, load_config
from tba.console import plain_console
from tba.interrupts import stop_on_interrupt
from tba.run_dir import LOCK_FILE, REPLACED, read_metrics, run_ended, set_aside
from tba.runtime import ray_cluster
from tba.tasks.custom import named_code
from tba.trust import CODE_RECORD, record_code

ASYNC = ["train.mode=async", "searchers.count=1"]
JUDGE = '''
import pathlib

# Importing this file leaves a mark: whether tba ran it.
pathlib.Path(__file__).with_suffix(".imported").touch()


def works(completions, **kwargs):
    return [float(len(c) % 2) for c in completions]


def fails_once(completions, **kwargs):
    marker = pathlib.Path(__file__).with_suffix(".failed")
    if not marker.exists():
        marker.touch()
        raise ValueError("[/srv/judge/server.cc:42] down")
    return [float(len(c) % 2) for c in completions]
'''


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Workspace:
    """A tiny policy, rows and reward functions (`benchmarks.faults`), `judge.py`, and a signing
    key of this test's own (`tba.trust`)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home-config"))
    monkeypatch.setenv("COLUMNS", "400")  # log lines unwrapped, to read what they say
    workspace = Workspace(tmp_path / "ws")
    (workspace.root / "judge.py").write_text(JUDGE)
    return workspace


def judge(workspace: Workspace, reward: str = "works") -> list[str]:
    path = workspace.root / "judge.py"
    return [f"policy.model={workspace.policy}", "task.name=custom",
            f"task.train_path={workspace.data}", f"task.reward_funcs=[{path}:{reward}]",
            f"task.eval_func={path}:works"]  # fmt: skip


def tba_main(args: list[str], capsys) -> tuple[int, list[str]]:
    """`tba ARGS` in this process: its exit status and the lines it wrote to stderr."""
    capsys.readouterr()
    status = main(args)
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def said(lines: list[str], text: str) -> bool:
    return any(text in line for line in lines)


def finished_run(workspace: Workspace, run: Path, *settings: str, recorded: bool = True) -> None:
    """The files of a finished run of `judge.py`'s task (its final policy the tiny policy), as
    this user's `tba train` leaves them (`recorded`: with its record of the code it imported)."""
    config = load_config(None, [*FAST, *judge(workspace), f"output_dir={run}", *settings])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(config))
    shutil.copytree(workspace.policy, run / "final")
    records = [{"step": 0, "time": 0.0, "eval_pass@1": 0.0},
               {"step": 3, "time": 6.0, "loss": 1.0, "samples_in": 8}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "eval.json").write_text(json.dumps({"interrupted": False, "steps": 3}))
    if recorded:
        record_code(run, list(named_code(config.task)))


def files_of(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*")
            if p.is_file() and p.name != LOCK_FILE}  # fmt: skip


# ------------------------------------------------------------------- 1. text, never markup


def test_consoles_print_brackets_and_colons_as_they_are(capsys):
    console = plain_console()
    console.log("reward_fault: reason=raised ValueError: [/srv/judge/server.cc:42] down :fire:")
    err = capsys.readouterr().err
    assert "[/srv/judge/server.cc:42] down :fire:" in err


def test_tba_eval_of_a_run_under_a_bracketed_path_prints_it(workspace, tmp_path, capsys):
    run = tmp_path / "runs[" / "x]" / "run"  # output_dir=.../runs[/x]/run
    finished_run(workspace, run)
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    out, err = capsys.readouterr()
    assert f"{run}:finalpolicy" in "".join(out.split())  # the table's title, however wrapped
    assert f"wrote {run / 'eval_final.json'}" in err


@pytest.mark.slow
def test_a_reward_whose_error_holds_brackets_drops_one_batch(workspace, tmp_path, capsys):
    run = tmp_path / "out[" / "x]" / "run"  # a bracketed output_dir too
    status, lines = tba_main(["train", *FAST, *judge(workspace, "fails_once"), f"output_dir={run}"],
                        capsys)  # fmt: skip
    assert status == 0, lines
    faults = [e for e in read_metrics(run / "events.jsonl") if e["event"] == "reward_fault"]
    assert [f["reason"] for f in faults] == ["raised ValueError: [/srv/judge/server.cc:42] down"]
    assert said(lines, "[/srv/judge/server.cc:42] down") and run_ended(run)


@pytest.mark.slow
def test_tba_trainer_with_a_reward_whose_error_holds_brackets(workspace, tmp_path):
    calls = []

    def fails_once(completions, **_):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("[/srv/judge/server.cc:42] down")
        return [float(len(c) % 2) for c in completions]

    config = TBAConfig.from_overrides([*FAST, f"output_dir={tmp_path / '[bold]' / 'run'}"])
    rows = [{"prompt": f"Q{i}\n"} for i in range(8)]
    result = TBATrainer(str(workspace.policy), fails_once, args=config,
                        train_dataset=rows).train()  # fmt: skip
    assert result.global_step == 3 and len(calls) > 1


# -------------------------------------------------- 2. a replacement cut short by a kill


def killed_replacement(run: Path) -> None:
    """What `tba train --overwrite ... train.max_steps=8` killed before its first checkpoint
    leaves: the finished run in `.replaced/`, the new run's config.yaml and first metrics."""
    set_aside(run, "the finished run", print)
    text = (run / REPLACED / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("max_steps: 3", "max_steps: 8"))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 0.0}) + "\n")


def test_tba_eval_after_a_killed_replacement_scores_the_run_put_back(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    finished_run(workspace, run)
    before = files_of(run)
    killed_replacement(run)
    status, lines = tba_main(["eval", str(run)], capsys)
    assert status == 0, lines
    assert said(lines, f"kept the run in {run} that a killed start had set aside")
    assert not (run / REPLACED).exists()
    after = files_of(run)
    assert {name: after[name] for name in before} == before  # eval_final.json is new


def test_resume_after_a_killed_replacement_reads_the_run_put_back(workspace, tmp_path, capsys,
                                                                  monkeypatch):  # fmt: skip
    run = tmp_path / "run"
    finished_run(workspace, run)
    killed_replacement(run)
    resumed = []

    def train(config, console, **kwargs):
        resumed.append(config)
        return run

    monkeypatch.setattr(tba.run, "train", train)
    status, lines = tba_main(["train", "--resume", str(run)], capsys)
    assert status == 0, lines
    assert [config.train.max_steps for config in resumed] == [3]  # the run's own, not 8
    assert said(lines, f"kept the run in {run} that a killed start had set aside")


def test_plot_after_a_killed_replacement_draws_the_run_put_back(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    finished_run(workspace, run)
    killed_replacement(run)
    status, lines = tba_main(["plot", str(run), "--out", str(tmp_path / "plot.png"), "--x", "steps",
                         "--metric", "eval_pass@1"], capsys)  # fmt: skip
    assert status == 0, lines
    assert not (run / REPLACED).exists() and len(read_metrics(run / "metrics.jsonl")) == 2


@pytest.mark.slow
def test_a_replacement_killed_with_sigkill_then_eval_and_resume(workspace, tmp_path, capsys):
    run = tmp_path / "run"
    settings = [*FAST, *workspace.task("works", "signals"), f"output_dir={run}"]
    assert main(["train", *settings]) == 0
    before = files_of(run)
    env = os.environ | {"TBA_FAULT_SIGNAL": "SIGKILL", "TBA_FAULT_STEP": "0",
                        "TBA_FAULT_ONCE": str(tmp_path / "killed")}  # fmt: skip
    killed = subprocess.run([sys.executable, "-m", "tba.cli", "train", *settings,
                             "train.max_steps=8", "--overwrite"], env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL and (run / REPLACED).is_dir()
    status, lines = tba_main(["eval", str(run)], capsys)
    assert status == 0, lines
    status, lines = tba_main(["train", "--resume", str(run)], capsys)
    assert status == 2 and said(lines, "already reached its limit, train.max_steps=3 (step 3)")
    after = files_of(run)
    assert {name: after[name] for name in before} == before


# ------------------------------------------------------- 3. code named by a run directory


def test_tba_eval_imports_a_run_s_code_only_if_trusted(workspace, tmp_path, capsys):
    run = tmp_path / "handed-over"
    finished_run(workspace, run, recorded=False)
    path = workspace.root / "judge.py"
    status, lines = tba_main(["eval", str(run)], capsys)
    assert status == 2
    assert lines == [f"tba: error: {run / 'config.yaml'} names code that your own `tba train` did "
                     f"not record in this run directory, and that would run now: {path} "
                     "(task.reward_funcs, task.eval_func); if you trust it, add --trust-code (in "
                     "Python: trust_code=True)"]  # fmt: skip
    assert not path.with_suffix(".imported").exists()  # nothing of it ran
    status, lines = tba_main(["eval", str(run), "--trust-code"], capsys)
    assert status == 0, lines
    assert said(lines, f"importing {path} (task.reward_funcs, task.eval_func), trusted with "
                "--trust-code")  # fmt: skip
    assert path.with_suffix(".imported").exists()


def test_tba_eval_imports_the_code_its_own_run_recorded(workspace, tmp_path, capsys,
                                                        monkeypatch):  # fmt: skip
    run = tmp_path / "mine"
    finished_run(workspace, run)
    path = workspace.root / "judge.py"
    status, lines = tba_main(["eval", str(run)], capsys)
    assert status == 0, lines
    assert said(lines, f"importing {path} (task.reward_funcs, task.eval_func), as this run "
                "recorded it")  # fmt: skip
    # The file changed since the run recorded it: asked again.
    path.write_text(JUDGE + "\n# edited\n")
    assert tba_main(["eval", str(run)], capsys)[0] == 2
    # A record signed with another user's key (a run directory copied from elsewhere).
    record_code(run, [str(path)])
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another-user"))
    status, lines = tba_main(["eval", str(run)], capsys)
    assert status == 2 and said(lines, "add --trust-code")
    # A record forged by hand.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home-config"))
    record = json.loads((run / CODE_RECORD).read_text())
    record["code"][str(path)] = "0" * 64
    (run / CODE_RECORD).write_text(json.dumps(record))
    assert tba_main(["eval", str(run)], capsys)[0] == 2
    # Code the user names on the command line is the user's own.
    other = workspace.root / "other.py"
    other.write_text(JUDGE)
    status, lines = tba_main(["eval", str(run), f"task.reward_funcs=[{other}:works]",
                         f"task.eval_func={other}:works"], capsys)  # fmt: skip
    assert status == 0, lines


def test_resume_refuses_a_run_s_code_before_anything(workspace, tmp_path, capsys, monkeypatch):
    run = tmp_path / "handed-over"
    finished_run(workspace, run, recorded=False)

    def train(*args, **kwargs):
        raise AssertionError("trained a run whose code was not trusted")

    monkeypatch.setattr(tba.run, "train", train)
    status, lines = tba_main(["train", "--resume", str(run)], capsys)
    assert status == 2 and len(lines) == 1 and lines[0].endswith("add --trust-code (in Python: "
                                                                 "trust_code=True)")  # fmt: skip
    assert not (workspace.root / "judge.imported").exists()
    resumed = []
    monkeypatch.setattr(tba.run, "train", lambda config, console, **_: resumed.append(1) or run)
    status, lines = tba_main(["train", "--resume", str(run), "--trust-code"], capsys)
    assert status == 0 and resumed == [1], lines
    assert said(lines, f"importing {workspace.root / 'judge.py'} (task.reward_funcs, "
                "task.eval_func), trusted with --trust-code")  # fmt: skip


# ------------------------------------------------------------------------------ 4. signals


def caught_signals() -> set[int]:
    """The signals the kernel delivers to a handler of this process (/proc: SigCgt)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("SigCgt"))  # fmt: skip
    mask = int(line.split()[1], 16)
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


class NoRay:
    """What `_signals_wait_for` reads of Ray: nothing."""


@pytest.fixture
def hangup_default():
    """SIGHUP at its default, whatever started the tests (`nohup` leaves it ignored, and a run
    keeps it so); a process started meanwhile inherits it."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_the_run_s_handlers_are_put_back_after_ray_resets_them_in_c(hangup_default):
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    with stop_on_interrupt():
        with ray_cluster._signals_wait_for(NoRay):  # around ray.shutdown()
            libc.signal(signal.SIGTERM, 0)  # SIG_DFL, in C, as ray.shutdown() leaves it
            assert signal.SIGTERM not in caught_signals()
        assert {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} <= caught_signals()


def test_a_signal_while_ray_starts_waits_for_it():
    """An exception raised inside `ray.init` left Ray half started (a C crash at exit)."""
    with stop_on_interrupt() as stop:
        with ray_cluster._signals_wait_for(NoRay) as waiting:
            os.kill(os.getpid(), signal.SIGINT)  # Ray starting: noted, not raised
            assert waiting == [signal.SIGINT] and stop.signal is None
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(waiting[0])  # as ray_session does once Ray has started
        assert stop.aborting and stop.signal == signal.SIGINT


def test_sighup_stops_a_run_as_sigterm_does_and_nohup_is_kept(monkeypatch, hangup_default):
    left = []
    monkeypatch.setattr(tba.interrupts, "leave_terminal", lambda: left.append(True))
    with stop_on_interrupt() as stop:
        stop.after_step = True
        os.kill(os.getpid(), signal.SIGHUP)  # in the loop: noted, the step goes on
        assert stop.is_set() and stop.signal == signal.SIGHUP and not stop.aborting
        assert left == [True]  # what it prints from now on goes nowhere
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup` starts a process
    try:
        with stop_on_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_after_a_hangup_the_run_prints_to_no_terminal():
    """Writing to a terminal that hung up fails (EIO): what is printed after a SIGHUP goes to
    /dev/null instead, unless it goes to a file or a pipe."""
    script = ("import os; from tba.interrupts import leave_terminal; leave_terminal(); "
              "os.write(2, b'after')")  # fmt: skip
    piped = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert piped.stderr == b"after"
    main_end, terminal = os.openpty()
    try:
        done = subprocess.run([sys.executable, "-c", script], stderr=terminal, timeout=120)
        os.set_blocking(main_end, False)
        with pytest.raises(BlockingIOError):
            os.read(main_end, 100)
        assert done.returncode == 0
    finally:
        os.close(main_end)
        os.close(terminal)


def tba_process(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tba.cli", *args], stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env=os.environ | {"COLUMNS": "400"} | (env or {}))  # fmt: skip


@pytest.mark.slow
def test_sigterm_in_an_asynchronous_run_s_final_evaluation(workspace, tmp_path):
    run = tmp_path / "run"
    env = {"TBA_FAULT_SIGNAL": "SIGTERM", "TBA_FAULT_STEP": "3",
           "TBA_FAULT_ONCE": str(tmp_path / "signalled")}  # fmt: skip
    process = tba_process(["train", *FAST, *ASYNC, *workspace.task("works", "signals"),
                           f"output_dir={run}"], env)  # fmt: skip
    _, err = process.communicate(timeout=400)
    assert process.returncode == 143, err
    assert error_lines(err) == [
        "tba: interrupted by SIGTERM during the final evaluation; its training is complete and "
        f"checkpointed (step000003): `tba train --resume {run}` evaluates and saves it, without "
        "training"]
    assert not (run / LOCK_FILE).exists()


@pytest.mark.slow
def test_sighup_to_an_asynchronous_run_s_process_group_saves_it(workspace, tmp_path,
                                                             hangup_default):
    """A closed terminal: SIGHUP to the trainer and all it started, once it has taken a step."""
    run = tmp_path / "run"
    process = tba_process(["train", *FAST, *ASYNC, *workspace.task(), f"output_dir={run}",
                           "train.max_steps=100000", "train.max_minutes=5"])  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and not stepped(run) and process.poll() is None:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGHUP)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 129, err
    assert run_ended(run) and json.loads((run / "eval.json").read_text())["stopped_by"] == "SIGHUP"
    assert not (run / LOCK_FILE).exists()


@pytest.mark.slow
def test_ctrl_c_at_an_asynchronous_start_never_crashes(workspace, tmp_path):
    """Ctrl-C (SIGINT to the process group) while the trainer loads, Ray starts and the
    searchers start, a few times, at a few moments after the run directory is made: one line,
    status 130, never a C crash (a Ctrl-C inside `ray.init` once left Ray half started)."""
    for attempt, delay in enumerate((0.5, 3.0, 6.0)):
        run = tmp_path / f"run{attempt}"
        process = tba_process(["train", *FAST, *ASYNC, *workspace.task(), f"output_dir={run}"])
        deadline = time.time() + 300
        while time.time() < deadline and not (run / "config.yaml").exists():
            time.sleep(0.1)
        time.sleep(delay)
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=300)
        assert process.returncode == 130, (delay, err)
        if (run / "eval.json").exists():  # it got as far as its loop: stopped there, and saved
            assert json.loads((run / "eval.json").read_text())["stopped_by"] == "SIGINT"
        else:
            assert error_lines(err)[-1].startswith("tba: interrupted by SIGINT"), (delay, err)
        assert not any(line.startswith(("***", "Fatal Python", "Segmentation"))
                       for line in err.splitlines()), err  # fmt: skip


# ---------------------------------------------------------------------------- 5. Ray's address


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("address", ["127.0.0.1:abc", "localhost", "not an address"])
def test_a_malformed_ray_address_is_one_line_before_the_run_directory(workspace, tmp_path,
                                                                      capsys, address):  # fmt: skip
    run = tmp_path / "run"
    status, lines = tba_main(["train", *FAST, *ASYNC, *workspace.task(), f"output_dir={run}",
                         f"ray.address={address}"], capsys)  # fmt: skip
    assert status == 2 and lines == [
        "tba: error: invalid value for ray.address: a Ray cluster to join is host:port (its GCS "
        "server, e.g. 10.0.0.5:6379), ray://host:port (its client server, e.g. "
        f"ray://10.0.0.5:10001), auto or local (got {address!r})"]
    assert not run.exists()


def test_a_malformed_ray_address_variable_names_it(workspace, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "not an address")
    status, lines = tba_main(["train", *FAST, *ASYNC, *workspace.task(),
                         f"output_dir={tmp_path / 'run'}"], capsys)  # fmt: skip
    assert status == 2 and lines[0].startswith("tba: error: invalid RAY_ADDRESS: ")
    # A run without Ray does not read it.
    assert ray_cluster.check_cluster(load_config(None, FAST)) is None


def test_a_ray_address_where_nothing_answers_is_one_line_in_seconds(workspace, tmp_path, capsys):
    run, address = tmp_path / "run", f"127.0.0.1:{free_port()}"
    start = time.time()
    status, lines = tba_main(["train", *FAST, *ASYNC, *workspace.task(), f"output_dir={run}",
                         f"ray.address={address}"], capsys)  # fmt: skip
    assert status == 1 and time.time() - start < 30
    assert lines == [f"tba: error: cannot join the Ray cluster at {address} (ray.address): "
                     f"nothing answers at {address} (Connection refused); is it up (`ray status "
                     f"--address {address}`), and is that its address?"]  # fmt: skip
    assert not run.exists()


# ----------------------------------------------------------------------- 6. two unclear lines


def test_a_setting_without_its_value_says_so(capsys):
    status, lines = tba_main(["config", "train.max_steps"], capsys)
    assert status == 2 and lines == ["tba: error: train.max_steps is a setting without a value: "
                                     "a setting is key=value (e.g. train.max_steps=VALUE)"]


def test_an_output_dir_name_too_long_is_one_line_with_status_2(workspace, tmp_path, capsys):
    name = "x" * 300
    status, lines = tba_main(["train", *FAST, *workspace.task(), f"output_dir={tmp_path / name}"],
                        capsys)  # fmt: skip
    assert status == 2 and lines == [
        f"tba: error: output_dir {tmp_path / name} cannot be used: its name {'x' * 24}... is "
        "300 bytes long, and a file system allows 255: choose a shorter output_dir"]
