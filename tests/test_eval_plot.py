"""After a run: `tba eval` scores the final policy or every snapshot as training scored them,
`tba plot` draws several runs on one figure; during a run, `report_to=[wandb]` logs every metric
record to a Weights & Biases run (offline here)."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import matplotlib.image
import pytest
from wandb.proto.wandb_internal_pb2 import Record

from tba import TBAConfig, TBATrainer, plots
from tba.cli import main
from tba.config import ConfigError
from tba.plots import metric_curve
from tba.policy.model import build_tiny_llama
from tba.run_dir import read_metrics
from tba.tracking import require_trackers

FAST = ["train.mode=sync", "searchers.count=0", "train.num_prompts=2", "train.group_size=4",
        "train.max_steps=3", "policy.max_new_tokens=12", "policy.num_threads=1", "eval.every=2",
        "task.num_eval=8", "task.num_eval_pass_k=4", "eval.pass_k=2"]  # fmt: skip
BUILTIN = ["pretrain.num_examples=64", "pretrain.steps=4", "pretrain.batch_size=16",
           "task.num_train=32"]  # fmt: skip
# A reward that any change of the text changes: the policy's curve moves from step to step.
REWARDS = """
def scrambled(prompts, completions, **kwargs):
    return [(sum(map(ord, c)) % 97) / 97 for c in completions]
"""


@pytest.fixture(scope="module")
def math_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("math")
    overrides = [*FAST, *BUILTIN, f"pretrain.cache_dir={root / 'cache'}",
                 f"output_dir={root / 'run'}"]  # fmt: skip
    assert main(["train", *overrides]) == 0
    return root / "run"


def tiny_policy(tokenizer):
    return build_tiny_llama(
        len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, hidden_size=32, num_layers=2, num_heads=2, seed=0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory, tokenizer) -> Path:
    """`task.name=custom` from files, evaluated every step, a snapshot after every step (and
    one more as the run ends)."""
    root = tmp_path_factory.mktemp("custom")
    tiny_policy(tokenizer).save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    (root / "my_rewards.py").write_text(REWARDS)
    for split, count in (("train", 12), ("test", 4)):
        rows = [{"prompt": f"{split} {i}\n"} for i in range(count)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [*FAST, "task.name=custom", f"task.train_path={root / 'train.jsonl'}",
                 f"task.eval_path={root / 'test.jsonl'}",
                 f"task.reward_funcs=[{root / 'my_rewards.py'}:scrambled]",
                 f"policy.model={root / 'policy'}", "train.learning_rate=0.01", "eval.every=1",
                 "eval.snapshot_minutes=0.0001", f"output_dir={root / 'run'}"]  # fmt: skip
    assert main(["train", *overrides]) == 0
    return root / "run"


def test_eval_scores_the_final_policy_as_the_run_did(math_run, capsys):
    assert main(["eval", str(math_run)]) == 0
    saved = json.loads((math_run / "eval_final.json").read_text())
    final = json.loads((math_run / "eval.json").read_text())["final"]
    assert set(saved["metrics"]) == {"eval_pass@1", "pass@2", "sampled_pass@1"}
    assert saved["metrics"] == pytest.approx(final)
    assert (saved["step"], saved["samples"], saved["overrides"]) == (3, 3 * 2 * 4, [])
    assert saved["value"] == saved["metrics"]["eval_pass@1"]
    table = capsys.readouterr().out
    assert "eval_pass@1" in table and f"{saved['value']:.3f}" in table


def test_eval_applies_overrides_and_reports_bad_input_in_one_line(math_run, tmp_path, capsys):
    assert main(["eval", str(math_run), "task.num_eval=4", "eval.batch_size=3"]) == 0
    saved = json.loads((math_run / "eval_final.json").read_text())
    assert saved["overrides"] == ["task.num_eval=4", "eval.batch_size=3"]
    assert (saved["value"] * 4).is_integer()  # four problems
    capsys.readouterr()
    assert main(["eval", str(math_run), "task.no_such_key=1"]) == 2
    assert main(["eval", str(math_run), "--snapshots"]) == 2
    assert "no snapshots" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"tba: error: {tmp_path / 'nowhere'}: no run there (config.yaml not found)"
    )


def test_eval_of_a_custom_task(custom_run):
    assert main(["eval", str(custom_run)]) == 0
    saved = json.loads((custom_run / "eval_final.json").read_text())
    final = json.loads((custom_run / "eval.json").read_text())["final"]
    assert set(final) == {"eval_reward"} and saved["metrics"] == pytest.approx(final)
    assert saved["value"] == saved["metrics"]["eval_reward"]


def test_eval_snapshots_scores_the_base_and_every_snapshot_as_the_run_did(custom_run):
    assert main(["eval", str(custom_run), "--snapshots", "policy.num_threads=1"]) == 0
    saved = json.loads((custom_run / "eval_snapshots.json").read_text())
    points = saved["points"]
    assert saved["overrides"] == ["policy.num_threads=1"]
    assert [p["step"] for p in points] == [0, 1, 2, 3, 3]  # base, each step, the run's end
    assert [p["samples"] for p in points] == [0, 8, 16, 24, 24]
    minutes = [p["minutes"] for p in points]
    assert minutes == sorted(minutes) and minutes[0] == 0.0
    # The same weights on the same prompts: what the run measured at every step (it evaluated
    # every step), and the curve moves, so each point is its own snapshot's.
    in_run = {r["step"]: r["eval_reward"] for r in read_metrics(custom_run / "metrics.jsonl")
              if "eval_reward" in r}  # fmt: skip
    values = [p["value"] for p in points]
    assert values == pytest.approx([in_run[p["step"]] for p in points])
    assert len(set(values)) > 1


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file: a LevelDB-style log (32 KiB blocks; records of
    a 7-byte header, checksum, length and type, split across blocks) of protobuf `Record`s."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, position, pending = [], 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # the rest of a block too short for a header: padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_the_python_api_reports_to_wandb_offline_and_scores_its_run(
    tmp_path, tokenizer, monkeypatch, capfd
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "tba-tests")
    rows = [{"prompt": f"Q{i}\n", "level": 0.5} for i in range(8)]

    def short_is_good(prompts, completions, level, **kwargs):
        return [-len(c) / 8 + level_ for c, level_ in zip(completions, level)]

    settings = TBAConfig.from_overrides([*FAST, f"output_dir={tmp_path / 'run'}"]).model_dump()
    trainer = TBATrainer(model=tiny_policy(tokenizer), reward_funcs=short_is_good,
                         train_dataset=rows, processing_class=tokenizer,
                         args=TBAConfig(**settings | {"report_to": ["wandb"]}))  # fmt: skip
    results = trainer.train()
    assert "wandb:" not in "".join(capfd.readouterr())  # W&B itself printed nothing

    run_dir = Path(results["run_dir"])
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(path)
    (run,) = [r.run for r in records if r.HasField("run")]
    assert (run.display_name, run.project) == ("run", "tba-tests")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["report_to"] == ["wandb"] and config["train"]["max_steps"] == 3
    history: dict[int, dict] = {}
    for record in records:
        if record.HasField("history"):
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # fmt: skip
            history.setdefault(items["_step"], {}).update(items)
    logged = read_metrics(run_dir / "metrics.jsonl")
    assert sorted(history) == sorted({r["step"] for r in logged}) == [0, 1, 2, 3]
    for record in logged:
        for key in ("loss", "reward_mean", "eval_reward"):
            if key in record:
                assert history[record["step"]][key] == pytest.approx(record[key])
    assert "eval_reward" in history[0] and "loss" in history[3]
    assert any(r.HasField("exit") for r in records)  # finished

    assert trainer.evaluate() == pytest.approx(results["final"])
    # Its task lives in Python: the command line cannot rebuild it, and says where to score it.
    assert main(["eval", str(run_dir)]) == 2
    assert "trainer.evaluate()" in capfd.readouterr().err


def test_a_tracker_without_its_package_is_one_line(monkeypatch, tmp_path, capsys):
    find_spec = importlib.util.find_spec

    def without_wandb(name: str, *args):
        return None if name == "wandb" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_wandb)
    with pytest.raises(ConfigError, match=r"report_to=\[wandb\] needs `pip install wandb`"):
        require_trackers(["tensorboard", "wandb"])
    overrides = [*FAST, *BUILTIN, "policy.model=/nowhere", "report_to=[wandb]",
                 f"output_dir={tmp_path}"]  # fmt: skip
    assert main(["train", *overrides]) == 2  # before any model is looked for
    assert "pip install wandb" in capsys.readouterr().err


def test_plot_draws_several_runs_on_one_figure(math_run, custom_run, tmp_path, capsys,
                                               monkeypatch):  # fmt: skip
    labels: list[list[str]] = []
    plot_runs = plots.plot_runs

    def labelled(runs: dict, *args) -> None:
        labels.append(list(runs))
        plot_runs(runs, *args)

    monkeypatch.setattr(plots, "plot_runs", labelled)
    other = tmp_path / "other"
    other.mkdir()
    records = [{"step": 0, "time": 0.0, "eval_pass@1": 0.25},
               {"step": 1, "time": 30.0, "samples_in": 8, "reward_mean": 0.1},
               {"step": 2, "time": 60.0, "samples_in": 8, "eval_pass@1": 0.5}]  # fmt: skip
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert metric_curve(records, "eval_pass@1", "samples") == ([0, 16], [0.25, 0.5])
    assert metric_curve(records, "eval_pass@1", "minutes") == ([0.0, 1.0], [0.25, 0.5])

    out = tmp_path / "plots" / "runs.png"
    assert main(["plot", str(math_run), str(other), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out} (eval_pass@1 against minutes)"
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 300 and image.std() > 0.01  # a drawn figure, not a blank page
    # Each run's headline metric, one panel each; runs of the same name labelled by path.
    runs = [str(math_run), str(other), str(custom_run)]
    assert main(["plot", *runs, "--out", str(out), "--x", "steps"]) == 0
    assert capsys.readouterr().out.strip() == f"{out} (eval_pass@1, eval_reward against steps)"
    assert labels == [["run", "other"], runs]
    assert main(["plot", str(math_run), "--out", str(out), "--metric", "pass@1",
                 "--metric", "loss"]) == 0  # fmt: skip
    assert "eval_pass@1, loss against minutes" in capsys.readouterr().out
    assert main(["plot", str(math_run), "--metric", "nope", "--out", str(out)]) == 2
    assert "held-out metrics recorded: eval_pass@1, pass@2, sampled_pass@1" in (
        capsys.readouterr().err
    )
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
