"""Configuration loading and the `tba` command line: bad input is one line and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from tba.cli import main
from tba.config import ConfigError, RunConfig, dump_config, load_config, reference_page
from tba.config.base import Section
from tba.limits import step_limit


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 3\ntrain:\n  beta: 0.1\n  group_size: 4\nbuffer:\n  capacity: 50\n")
    return path


@pytest.fixture
def malformed_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("seed: 1\ntrain: beta: 0.1\n")
    return path


def expect_config_error(*, path=None, overrides=(), naming):
    with pytest.raises(ConfigError) as caught:
        load_config(path, list(overrides))
    message = str(caught.value)
    assert "\n" not in message
    assert naming in message
    return message


# ---------------------------------------------------------------------------- load_config


def test_defaults_validate():
    config = load_config()
    assert isinstance(config, RunConfig)
    # The default task's preset: a math response cut off at the length limit is penalised.
    assert config == RunConfig(train={"truncated": "penalize"})
    assert RunConfig().train.truncated == "score"  # as TRL does, for the custom task
    assert config.train.group_size >= 2 and config.train.beta > 0
    assert config.task.name == "math"


def test_yaml_file_overrides_defaults(config_file):
    config = load_config(config_file)
    assert config.seed == 3
    assert config.train.beta == 0.1
    assert config.train.group_size == 4
    assert config.buffer.capacity == 50
    assert config.train.learning_rate == RunConfig().train.learning_rate  # untouched default


def test_overrides_win_over_the_yaml_file(config_file):
    config = load_config(config_file, ["train.beta=0.2", "policy.temperature=0.7"])
    assert config.train.beta == 0.2
    assert config.policy.temperature == 0.7
    assert config.train.group_size == 4  # from the file, next to the overridden key
    assert config.seed == 3


def test_override_values_are_parsed_as_yaml():
    config = load_config(None, ["train.max_minutes=null", "train.max_steps=5",
                                "output_dir=runs/x", "seed=7"])  # fmt: skip
    assert config.train.max_minutes is None
    assert config.output_dir == "runs/x"
    assert config.seed == 7


def test_an_empty_yaml_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == load_config()


def test_dump_config_round_trips(tmp_path):
    config = load_config(None, ["train.beta=0.3", "seed=5"])
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_unknown_top_level_key():
    message = expect_config_error(overrides=["bogus=1"], naming="'bogus'")
    assert "train" in message  # lists what is allowed


def test_unknown_nested_key():
    message = expect_config_error(overrides=["train.bogus=1"], naming="train.bogus")
    assert "group_size" in message


def test_unknown_key_in_the_yaml_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("buffer:\n  capasity: 10\n")
    expect_config_error(path=path, naming="buffer.capasity")


@pytest.mark.parametrize("value", ["abc", "true", "'8'", "[8]", "4.5"])
def test_wrong_type(value):
    expect_config_error(overrides=[f"train.group_size={value}"], naming="train.group_size")


def test_a_boolean_is_not_a_number():
    expect_config_error(overrides=["train.beta=true"], naming="train.beta")


def test_exponent_notation_is_a_float():
    config = load_config(None, ["train.learning_rate=1e-4", "train.beta=5E-2"])
    assert config.train.learning_rate == 1e-4
    assert config.train.beta == 0.05


def test_section_given_a_value():
    expect_config_error(overrides=["train=5"], naming="train")


@pytest.mark.parametrize("value", ["1.5", "-0.1"])
def test_recent_prob_outside_unit_interval(value):
    expect_config_error(overrides=[f"buffer.recent_prob={value}"], naming="buffer.recent_prob")


@pytest.mark.parametrize("value", ["0", "1"])
def test_group_size_below_two(value):
    expect_config_error(overrides=[f"train.group_size={value}"], naming="train.group_size")


@pytest.mark.parametrize("value", ["0", "-0.1"])
def test_beta_not_positive(value):
    expect_config_error(overrides=[f"train.beta={value}"], naming="train.beta")


def test_samples_per_prompt_below_group_size():
    expect_config_error(
        overrides=["train.group_size=8", "train.samples_per_prompt=4"],
        naming="samples_per_prompt",
    )


def test_samples_per_prompt_at_least_group_size_is_fine():
    config = load_config(None, ["train.group_size=8", "train.samples_per_prompt=8"])
    assert config.train.samples_per_prompt == 8


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    expect_config_error(path=missing, naming=str(missing))


def test_malformed_yaml(malformed_file):
    message = expect_config_error(path=malformed_file, naming=str(malformed_file))
    assert "malformed YAML" in message
    assert "line 2" in message


def test_yaml_file_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    expect_config_error(path=path, naming=str(path))


def test_override_without_equals_sign():
    expect_config_error(overrides=["train.beta"], naming="'train.beta'")


def test_override_into_a_value():
    expect_config_error(overrides=["seed=1", "seed.x=1"], naming="seed.x")


# ---------------------------------------------------------------------------- the CLI

# Every bad `train` command also names a policy directory that does not exist and an output
# directory under tmp_path: should validation ever let one through, the command fails fast
# (and the error line then does not name the key) instead of pretraining a real policy.
# (name, args before the guard, text the error line must contain); "{bad}" is a malformed file.
BAD_TRAIN_ARGS = [
    ("unknown_key", ["bogus=1"], "'bogus'"),
    ("unknown_nested_key", ["train.bogus=1"], "train.bogus"),
    ("wrong_type", ["train.group_size=abc"], "train.group_size"),
    ("recent_prob", ["buffer.recent_prob=1.5"], "buffer.recent_prob"),
    ("group_size", ["train.group_size=1"], "train.group_size"),
    ("beta", ["train.beta=0"], "train.beta"),
    ("missing_file", ["{missing}"], "config file not found"),
    ("malformed_yaml", ["{bad}"], "malformed YAML"),
    ("samples_per_prompt", ["train.samples_per_prompt=4"], "samples_per_prompt"),
    ("no_equals", ["seed=1", "train.beta"], "'train.beta'"),
]
# The slowest part of a subprocess is importing; run only these through a real interpreter.
SUBPROCESS_CASES = {
    "unknown_nested_key",
    "wrong_type",
    "recent_prob",
    "group_size",
    "beta",
    "missing_file",
    "malformed_yaml",
    "no_equals",
}


def train_args(args, tmp_path, malformed_file):
    files = {"{missing}": str(tmp_path / "missing.yaml"), "{bad}": str(malformed_file)}
    guard = [f"policy.model={tmp_path / 'no-such-model'}", f"output_dir={tmp_path / 'run'}"]
    return ["train", *(files.get(a, a) for a in args), *guard]


@pytest.mark.parametrize(
    ("args", "naming"), [case[1:] for case in BAD_TRAIN_ARGS], ids=[c[0] for c in BAD_TRAIN_ARGS]
)
def test_cli_bad_train_args_exit_2_in_process(args, naming, tmp_path, malformed_file, capsys):
    status = main(train_args(args, tmp_path, malformed_file))
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("tba: error: ")
    assert naming in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("args", "naming"),
    [case[1:] for case in BAD_TRAIN_ARGS if case[0] in SUBPROCESS_CASES],
    ids=[case[0] for case in BAD_TRAIN_ARGS if case[0] in SUBPROCESS_CASES],
)
def test_cli_bad_train_args_exit_2(args, naming, tmp_path, malformed_file):
    result = subprocess.run(
        [sys.executable, "-m", "tba.cli", *train_args(args, tmp_path, malformed_file)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tba: error:")
    assert naming in lines[0]


def test_cli_config_prints_yaml_with_the_override(capsys):
    status = main(["config", "train.beta=0.25", "seed=11"])
    captured = capsys.readouterr()
    assert status == 0
    printed = yaml.safe_load(captured.out)
    assert printed["train"]["beta"] == 0.25
    assert printed["seed"] == 11
    assert RunConfig.model_validate(printed) == load_config(None, ["train.beta=0.25", "seed=11"])


def test_a_first_setting_longer_than_a_file_name_may_be_is_a_setting(capsys):
    """A first argument past the file system's 255-byte name limit is never a file (asking
    whether it exists raises): read as the setting it is."""
    long_name = "run-" + "x" * 300
    assert main(["config", f"task.name={long_name}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tba: error: ") and "task.name" in err and err.count("\n") == 1
    assert main(["config", f"output_dir=runs/{long_name}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["output_dir"] == f"runs/{long_name}"


def test_cli_config_reads_the_file_before_overrides(config_file, capsys):
    assert main(["config", str(config_file), "train.beta=0.2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["seed"] == 3
    assert printed["train"]["beta"] == 0.2
    assert printed["train"]["group_size"] == 4


def test_cli_config_bad_override_exits_2(capsys):
    assert main(["config", "train.group_size=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("tba: error: ") and captured.err.count("\n") == 1


def test_example_configs_load_and_differ_from_the_defaults_only_as_they_say():
    configs = Path(__file__).parent.parent / "configs"
    defaults = load_config().model_dump()
    # The defaults, with the mode that `auto` decides for the embedded policy written out.
    asynchronous = load_config(configs / "math_async.yaml").model_dump()
    assert asynchronous["train"] == defaults["train"] | {"mode": "async"}
    assert {k: v for k, v in asynchronous.items() if k != "train"} == {
        k: v for k, v in defaults.items() if k != "train"
    }
    sync = load_config(configs / "math_sync.yaml").model_dump()
    assert sync["train"] == defaults["train"] | {"mode": "sync"}
    assert sync["searchers"] == defaults["searchers"] | {"count": 0}
    assert {k: v for k, v in sync.items() if k not in ("train", "searchers")} == {
        k: v for k, v in defaults.items() if k not in ("train", "searchers")
    }


def test_in_process_searcher_needs_the_sync_mode():
    with pytest.raises(ConfigError, match="searchers.count=0 .* needs train.mode=sync"):
        load_config(None, ["searchers.count=0", "train.mode=async"])
    assert load_config(None, ["searchers.count=0", "train.mode=sync"]).searchers.count == 0
    # `auto`, the default, is then sync (tests/test_mode_auto.py).
    assert load_config(None, ["searchers.count=0"]).train.mode == "auto"


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.mode=offline", "train.mode"),
        ("searchers.num_cpus=0", "searchers.num_cpus"),
        ("buffer.max_staleness=-1", "buffer.max_staleness"),
        ("ray.sync_timeout_s=0", "ray.sync_timeout_s"),
        ("searchers.workers=2", "searchers.workers"),
    ],
)
def test_runtime_settings_are_validated(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def _leaf_fields(model: type[BaseModel], prefix: str = ""):
    """Every setting and its default; a section of several kinds (`searchers.weight_transfer`):
    the field that picks the kind, then each kind's own settings."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section) and \
                annotation.variants():  # fmt: skip
            kind = annotation.shorthand
            yield f"{prefix}{name}.{kind}", getattr(field.default, kind)
            for variant in annotation.variants().values():
                yield from ((f"{prefix}{name}.{setting}", f.default)
                            for setting, f in variant.model_fields.items() if setting != kind)
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _leaf_fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field.default


def test_config_reference_lists_every_setting(capsys):
    assert main(["config", "--reference"]) == 0
    # The settings' table rows of the page (docs/configuration.md), under its section headings.
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    keys = [key for key, _ in _leaf_fields(RunConfig)]
    # The top-level settings come first, then each section's.
    keys = [key for key in keys if "." not in key] + [key for key in keys if "." in key]
    assert [row.split("`")[1] for row in rows] == keys
    assert all(row.count("|") == 4 and not row.endswith("|  |") for row in rows)


def test_the_configuration_reference_documents_every_setting_with_its_default():
    reference = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    for key, default in _leaf_fields(RunConfig):
        shown = "null" if default is None else default
        if isinstance(shown, str):  # a newline is shown as `\n`
            shown = shown.encode("unicode_escape").decode()
        assert f"| `{key}` | `{shown}` |" in reference, key


def test_the_configuration_reference_is_current():
    reference = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert reference == reference_page(), (
        "docs/configuration.md is out of date: `tba config --reference > docs/configuration.md`"
    )


# ------------------------------------------------------------------- what ends a run, by default

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("path", [None, ROOT / "configs/math_async.yaml",
                                  ROOT / "configs/math_sync.yaml"])  # fmt: skip
def test_the_default_job_ends_by_its_time_on_any_device(path):
    """The default job is 10 minutes of training, however many steps a device takes in them;
    its evaluations and checkpoints come every so many minutes, not steps."""
    config = load_config(path, [])
    assert config.train.max_minutes == 10
    assert step_limit(config.train, num_prompts=config.task.num_train) is None
    # Every half minute: `auto`'s marks for the embedded policy, whose evaluation takes seconds.
    assert config.eval.every is None and config.eval.every_minutes == "auto"
    assert config.checkpoint.every is None and config.checkpoint.every_minutes == 5


def test_step_limits_given_or_preset_still_end_a_run():
    assert step_limit(load_config(None, ["train.max_steps=30"]).train, 5000) == 30
    epochs = load_config(None, ["train.num_epochs=2", "train.max_minutes=null"]).train
    assert step_limit(epochs, 5000) == 2 * 5000 // 8
    # Tasks whose results were measured over a number of steps keep it.
    assert load_config(None, ["task.name=redteam"]).train.max_steps == 2500
    assert load_config(None, ["task.name=summarize"]).train.max_steps == 1000


def test_a_run_without_any_limit_is_refused_in_one_line(capsys):
    assert main(["config", "train.max_minutes=null"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "train.max_minutes, train.max_steps or train.num_epochs" in error
