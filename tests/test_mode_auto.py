"""`train.mode=auto`, the default: decided once as a run starts (`tba.policy.cpu.resolve_mode`,
`tba.run.with_concrete_mode`), sync where the run computes on fewer than 4 CPU cores alone with a
model of 50M parameters or more, async otherwise; the embedded default job stays async, and a
resumed run keeps the mode it was trained in."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tba.checkpoint import Checkpoint
from tba.config import dump_config, load_config
from tba.policy.cpu import SYNC_MIN_PARAMETERS, resolve_mode, usable_cpus
from tba.policy.model import build_tiny_llama
from tba.policy.tokenizer import build_char_tokenizer
from tba.run import trainer_threads, with_concrete_mode

SMOLLM2 = 134_515_008  # SmolLM2-135M-Instruct's parameters (tied embeddings counted once)
CPU = {"policy.device": "cpu", "searchers.device": "cpu", "task.reward_device": "cpu"}


def fake_policy(directory: Path, parameters: int) -> Path:
    """A model directory whose safetensors header declares `parameters` weights: the count is
    read from the header alone (`tba.policy.cpu.parameter_count`), so no tensor is written."""
    directory.mkdir()
    header = json.dumps({"weight": {"dtype": "F32", "shape": [parameters],
                                    "data_offsets": [0, 4 * parameters]}}).encode()  # fmt: skip
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return directory


@pytest.fixture
def smollm2_size(tmp_path) -> Path:
    return fake_policy(tmp_path / "smollm2", SMOLLM2)


@pytest.fixture
def tiny_size(tmp_path) -> Path:
    return fake_policy(tmp_path / "tiny", 800_000)


def decide(policy_dir: Path, cpus: int, *overrides: str):
    """The config of `overrides` on the CPU, decided as a run on `cpus` cores would, and the
    lines it logged."""
    lines: list[str] = []
    config = load_config(None, ["policy.device=cpu", "searchers.device=cpu",
                                "task.reward_device=cpu", *overrides])  # fmt: skip
    return with_concrete_mode(config, policy_dir, None, lines.append, cpus=cpus), lines


# ------------------------------------------------------------------------ the decision table


def test_a_large_model_on_two_cpu_cores_trains_synchronously_in_one_process(smollm2_size):
    assert load_config(None, []).train.mode == "auto"
    config, lines = decide(smollm2_size, 2)
    assert (config.train.mode, config.searchers.count) == ("sync", 0)
    assert lines == [
        "train.mode=auto: sync, searchers.count=0 (the model has 134.5M parameters and the run "
        "2 CPU cores: one process generates and trains, each phase with every core; asynchrony "
        "pays from 4 cores, on a GPU or under 50M parameters)"]  # fmt: skip


def test_a_tiny_model_on_two_cores_stays_asynchronous(tiny_size):
    config, lines = decide(tiny_size, 2)
    assert (config.train.mode, config.searchers.count) == ("async", 1)
    assert lines == ["train.mode=auto: async (the model has 0.8M parameters, fewer than 50M: its "
                     "steps are short enough that generating beside them pays)"]  # fmt: skip


def test_four_cores_or_more_stay_asynchronous(smollm2_size):
    for cpus in (4, 8):
        config, lines = decide(smollm2_size, cpus)
        assert (config.train.mode, config.searchers.count) == ("async", 1)
        assert lines == [f"train.mode=auto: async ({cpus} CPU cores: from 4, the searchers and "
                         "the trainer each have cores of their own)"]  # fmt: skip
    assert decide(smollm2_size, 3)[0].train.mode == "sync"


@pytest.mark.parametrize("key", list(CPU))
def test_any_device_off_the_cpu_keeps_it_asynchronous(smollm2_size, key):
    devices = CPU | {key: "cuda:0"}
    assert resolve_mode("auto", 1, False, devices, smollm2_size, 2) == (
        "async", 1, f"train.mode=auto: async ({key} is cuda:0: off the CPU, generating beside "
        "training pays)")  # fmt: skip
    assert resolve_mode("auto", 1, False, CPU | {key: "mps:0"}, smollm2_size, 2)[0] == "async"
    # As a run resolves the trainer's setting (without starting CUDA).
    config, lines = decide(smollm2_size, 2, "policy.device=cuda:0")
    assert config.train.mode == "async" and "policy.device is cuda:0" in lines[0]


def test_searcher_processes_set_are_kept_in_the_synchronous_mode(smollm2_size):
    config, lines = decide(smollm2_size, 2, "searchers.count=2")
    assert (config.train.mode, config.searchers.count) == ("sync", 2)
    assert lines[0].startswith("train.mode=auto: sync (the model has 134.5M parameters and the "
                               "run 2 CPU cores: generation, by the searchers.count=2 searcher "
                               "processes as set, and training take turns")  # fmt: skip
    # A weight transport named asks for searcher processes too (searchers.count=0 refuses it).
    config, _ = decide(smollm2_size, 2, "searchers.weight_transfer=shared")
    assert (config.train.mode, config.searchers.count) == ("sync", 1)


def test_an_in_process_searcher_with_auto_is_sync(tiny_size):
    config, lines = decide(tiny_size, 8, "searchers.count=0")
    assert (config.train.mode, config.searchers.count) == ("sync", 0)
    assert lines == ["train.mode=auto: sync (searchers.count=0: the searcher runs in the "
                     "trainer's process, between its steps)"]  # fmt: skip


@pytest.mark.parametrize("setting", [
    "ray.address=10.0.0.1:6379", "trainer.world_size=2", "buffer.fresh_uses=2"])  # fmt: skip
def test_runs_beyond_one_process_and_async_only_settings_stay_asynchronous(smollm2_size, setting):
    config, lines = decide(smollm2_size, 2, setting)
    assert (config.train.mode, config.searchers.count) == ("async", 1)
    assert lines[0].startswith(f"train.mode=auto: async ({setting}")


def test_a_model_of_unknown_size_stays_asynchronous(tmp_path):
    config, lines = decide(tmp_path, 2)  # no safetensors weights
    assert config.train.mode == "async" and "the model's size cannot be read" in lines[0]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_mode_set_is_kept_and_says_nothing_here(smollm2_size, tiny_size, mode):
    count = "searchers.count=0" if mode == "sync" else "searchers.count=1"
    for policy_dir in (smollm2_size, tiny_size):
        config, lines = decide(policy_dir, 2, f"train.mode={mode}", count)
        assert config.train.mode == mode and lines == []
        assert config.searchers.count == (0 if mode == "sync" else 1)


def test_the_threshold_is_the_constant(tmp_path):
    below = fake_policy(tmp_path / "below", SYNC_MIN_PARAMETERS - 1)
    at = fake_policy(tmp_path / "at", SYNC_MIN_PARAMETERS)
    assert resolve_mode("auto", 1, False, CPU, below, 2)[0] == "async"
    assert resolve_mode("auto", 1, False, CPU, at, 2)[:2] == ("sync", 0)


def test_the_cores_are_ray_num_cpus_where_set_else_this_processs(monkeypatch):
    assert usable_cpus(3) == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert usable_cpus() == 2


# ------------------------------------------------------------------ the run: default, resumed


def test_the_embedded_default_job_stays_asynchronous(tmp_path):
    """`tba train` without arguments: the built-in math policy (its architecture, at its
    defaults), on the two cores of a small CPU machine."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, seed=0)  # fmt: skip
    model.save_pretrained(tmp_path / "builtin")
    config = load_config(None, ["policy.device=cpu"])
    assert config.policy.model == "builtin:math" and config.train.mode == "auto"
    lines: list[str] = []
    decided = with_concrete_mode(config, tmp_path / "builtin", None, lines.append, cpus=2)
    assert (decided.train.mode, decided.searchers.count) == ("async", 1)
    assert config.train.mode == "auto"  # the caller's config is left as it was
    assert len(lines) == 1 and lines[0].startswith("train.mode=auto: async (the model has 1.1M "
                                                   "parameters, fewer than 50M")  # fmt: skip


def test_the_written_config_has_the_mode_decided(smollm2_size, tmp_path):
    config, _ = decide(smollm2_size, 2)
    (tmp_path / "config.yaml").write_text(dump_config(config))
    written = load_config(tmp_path / "config.yaml")
    assert (written.train.mode, written.searchers.count) == ("sync", 0)


@pytest.mark.parametrize("trained", [("sync", 0), ("async", 1), ("sync", 2)])
def test_a_resumed_auto_run_keeps_the_mode_it_was_trained_in(tiny_size, trained):
    """Decided again on another machine, `auto` could differ from the run's mode: the run goes
    on in its own, with its searcher processes."""
    mode, count = trained
    saved = load_config(None, [f"train.mode={mode}", f"searchers.count={count}"]).model_dump()
    checkpoint = Checkpoint(Path("step000002"), {"step": 2, "config": saved})
    lines: list[str] = []
    config = load_config(None, ["policy.device=cpu"])
    decided = with_concrete_mode(config, tiny_size, checkpoint, lines.append, cpus=2)
    assert (decided.train.mode, decided.searchers.count) == trained
    assert lines == [f"train.mode=auto: {mode} (the mode this run was trained in)"]
    # Resumed with the searcher in this process: sync, whatever the run had.
    in_process = load_config(None, ["policy.device=cpu", "searchers.count=0"])
    decided = with_concrete_mode(in_process, tiny_size, checkpoint, lines.append, cpus=2)
    assert (decided.train.mode, decided.searchers.count) == ("sync", 0)


def test_before_auto_is_decided_the_trainer_threads_are_those_of_the_likely_mode(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert trainer_threads(load_config(None, [])) == 7  # async: one core to the searcher
    assert trainer_threads(load_config(None, ["searchers.count=0"])) is None  # sync: all
