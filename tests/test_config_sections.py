"""The objectives' own sections of `train` (`train.tb`, `train.ppo`, `train.vineppo`), the old
names that keep working (`tba.config.aliases`: the objectives' settings, and the vLLM engine's
from before `searchers.engine` had settings), the named cross-setting rules and the one set of
dotted-key helpers (`tba.keys`)."""

from __future__ import annotations

import pytest
import yaml
from pydantic import Field

from tba import TBAConfig
from tba.cli import main
from tba.config import (
    ALIASES,
    BuiltinEngineSettings,
    ConfigError,
    RunConfig,
    TrainConfig,
    VllmEngineSettings,
    aliases,
    dump_config,
    load_config,
)
from tba.config.run import RUN_RULES
from tba.config.task import TASK_RULES
from tba.config.train import TRAIN_RULES
from tba.keys import NotASection, flatten, get_key, has_key, pop_key, set_key
from tba.objectives import OBJECTIVES, Objective
from tba.section import Section

MISMATCHES = [
    ("train.ppo.value_coef=0.3", "tb", "train.ppo.value_coef applies to train.loss=ppo, not "
                                       "train.loss=tb"),
    ("train.tb.log_z=learned", "ppo", "train.tb.log_z applies to train.loss=tb, not "
                                      "train.loss=ppo"),
    ("train.vineppo.rollouts=3", "ppo", "train.vineppo.rollouts applies to train.loss=vineppo, "
                                        "not train.loss=ppo"),
]  # fmt: skip


@pytest.fixture
def notices(monkeypatch, capsys):
    """The notices of old names printed from now on (each is printed once per process)."""
    monkeypatch.setattr(aliases, "_noticed", set())
    capsys.readouterr()
    return lambda: [line for line in capsys.readouterr().err.splitlines()
                    if line.startswith("notice: ")]  # fmt: skip


def one_line_error(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path, list(overrides))
    assert "\n" not in str(caught.value)
    return str(caught.value)


# ----------------------------------------------------------------- another objective's settings


@pytest.mark.parametrize(("override", "loss", "message"), MISMATCHES)
def test_another_objectives_setting_is_one_line_naming_both_in_overrides(override, loss,
                                                                          message):  # fmt: skip
    assert message in one_line_error(overrides=[f"train.loss={loss}", override])
    assert message in one_line_error(overrides=[override, f"train.loss={loss}"])


@pytest.mark.parametrize(("override", "loss", "message"), MISMATCHES)
def test_another_objectives_setting_is_one_line_naming_both_in_yaml(tmp_path, override, loss,
                                                                    message):  # fmt: skip
    dotted, value = override.split("=")
    section, key = dotted.removeprefix("train.").split(".")
    path = tmp_path / "run.yaml"
    path.write_text(f"train:\n  loss: {loss}\n  {section}:\n    {key}: {value}\n")
    assert message in one_line_error(path)


def test_another_objectives_setting_exits_2_in_one_line(capsys):
    assert main(["config", "train.ppo.value_coef=0.3"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "train.ppo.value_coef applies to train.loss=ppo, not train.loss=tb" in error


def test_an_objectives_settings_apply_with_its_loss():
    config = load_config(None, ["train.loss=ppo", "train.ppo.value_coef=0.3",
                                "train.ppo.value_model=critic"])  # fmt: skip
    assert config.train.ppo.value_coef == 0.3 and config.train.ppo.value_model == "critic"
    vine = load_config(None, ["train.loss=vineppo", "train.vineppo.rollouts=3"]).train.vineppo
    assert vine.rollouts == 3 and vine.max_states == 25 and vine.delimiter == "\n"
    assert load_config(None, ["train.tb.log_z=learned"]).train.tb.log_z == "learned"


def test_a_setting_at_its_default_is_no_error_and_dumps_load_again(tmp_path):
    # A dumped configuration (a run's config.yaml) lists every setting of every section.
    assert load_config(None, ["train.loss=ppo", "train.tb.log_z=vargrad"]).train.loss == "ppo"
    for overrides in (["train.loss=ppo", "train.ppo.value_coef=0.3"], ["task.name=redteam"],
                      ["task.name=redteam", "train.loss=grpo"]):  # fmt: skip
        config = load_config(None, overrides)
        path = tmp_path / "config.yaml"
        path.write_text(dump_config(config))
        assert load_config(path) == config
        assert RunConfig.model_validate(config.model_dump()) == config


def test_presets_set_an_objectives_settings_only_for_that_objective():
    tb = load_config(None, ["task.name=redteam"]).train
    assert tb.tb.log_z == "learned" and tb.tb.trust_region == "none"
    rloo = load_config(None, ["task.name=redteam", "train.loss=rloo"]).train
    assert rloo.loss == "rloo" and rloo.tb == TrainConfig().tb  # no error, TB's defaults
    assert rloo.beta == 0.3  # the task's other presets still apply


class WeightedSettings(Section):
    """A made-up objective's own settings."""

    value_weight: float = Field(1.0, gt=0, description="weight of a term of its loss")


def test_an_objective_entered_since_has_its_own_section(tmp_path, monkeypatch):
    """An objective entered in the registry after the config was made has its section
    `train.<name>`, validated against the class its entry names, checked against the loss, and
    dumped and loaded again like the others'."""
    rloo = OBJECTIVES["rloo"]
    monkeypatch.setitem(OBJECTIVES, "weighted", Objective(rloo.loss, rloo.needs, WeightedSettings))
    config = load_config(None, ["train.loss=weighted", "train.weighted.value_weight=2.5"])
    assert config.train.weighted == WeightedSettings(value_weight=2.5)
    assert load_config(None, ["train.loss=weighted"]).train.weighted == WeightedSettings()
    assert load_config(None, []).train.weighted == WeightedSettings()
    assert RunConfig.model_validate(config.model_dump()) == config
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config
    assert ("train.weighted.value_weight applies to train.loss=weighted, not train.loss=tb"
            in one_line_error(overrides=["train.weighted.value_weight=2.5"]))  # fmt: skip
    bad = ["train.loss=weighted", "train.weighted.value_weight=-1.0"]
    assert one_line_error(overrides=bad).startswith("invalid value for train.weighted.value_weight")
    unknown = ["train.loss=weighted", "train.weighted.weight=1.0"]
    assert "train.weighted.weight: not a setting of train.weighted" in one_line_error(
        overrides=unknown)  # fmt: skip


def test_train_loss_names_an_objective_of_the_registry_as_it_is(monkeypatch):
    assert "Input should be 'tb', 'dr_grpo'" in one_line_error(overrides=["train.loss=mine"])
    monkeypatch.setitem(OBJECTIVES, "mine", OBJECTIVES["rloo"])
    assert load_config(None, ["train.loss=mine"]).train.loss == "mine"


# ---------------------------------------------------------------------------------- old names


def test_old_names_in_overrides_work_with_one_notice(notices):
    config = load_config(None, ["train.loss=ppo", "train.value_coef=0.3", "train.gae_lambda=0.9",
                                "train.value_coef=0.4"])  # fmt: skip
    assert config.train.ppo.value_coef == 0.4 and config.train.ppo.gae_lambda == 0.9
    assert sorted(notices()) == [f"notice: train.{key} is now train.ppo.{key}"
                                 for key in ("gae_lambda", "value_coef")]  # fmt: skip
    load_config(None, ["train.loss=ppo", "train.value_coef=0.3"])
    assert notices() == []  # once per key and process


def test_old_names_in_yaml_work_with_a_notice(tmp_path, notices):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  loss: vineppo\n  vineppo_rollouts: 3\n  vineppo_delimiter: '.'\n")
    vine = load_config(path).train.vineppo
    assert vine.rollouts == 3 and vine.delimiter == "."
    assert notices() == [f"notice: train.vineppo_{key} is now train.vineppo.{key}"
                         for key in ("rollouts", "delimiter")]  # fmt: skip
    # An override by either name replaces the file's value.
    assert load_config(path, ["train.vineppo.rollouts=5"]).train.vineppo.rollouts == 5


def test_old_names_are_checked_under_their_new_names():
    error = one_line_error(overrides=["train.loss=ppo", "train.gae_lambda=1.5"])
    assert error.startswith("invalid value for train.ppo.gae_lambda")


def test_both_names_of_one_setting_in_a_file_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  loss: ppo\n  value_coef: 0.5\n  ppo:\n    value_coef: 0.4\n")
    assert "train.value_coef and train.ppo.value_coef are one setting" in one_line_error(path)


def test_an_old_name_of_another_objectives_setting_is_ignored_as_before(tmp_path):
    # Config files and run directories written before the rename list every setting, whatever
    # the loss: they load as they did.
    config = load_config(None, ["train.loss=grpo", "train.log_z=learned", "train.value_coef=1"])
    assert config.train.tb == TrainConfig().tb and config.train.ppo == TrainConfig().ppo
    path = tmp_path / "config.yaml"
    path.write_text("task:\n  name: redteam\ntrain:\n  loss: rloo\n  log_z: learned\n"
                    "  trust_region: none\n")  # fmt: skip
    assert load_config(path).train.loss == "rloo"


def test_an_old_name_keeps_the_task_preset_from_its_setting():
    tb = load_config(None, ["task.name=redteam", "train.log_z=vargrad"]).train.tb
    assert tb.log_z == "vargrad" and tb.trust_region == "none"


def test_old_names_as_attributes_read_and_assign_through(notices):
    train = load_config(None, ["train.loss=ppo"]).train
    assert train.value_coef == 0.1 and train.vineppo_max_states == 25
    train.value_coef = 0.3
    assert train.ppo.value_coef == 0.3
    with pytest.raises(ValueError, match="value_coef"):
        train.value_coef = -1.0  # validated as the new name is
    assert notices() == ["notice: train.value_coef is now train.ppo.value_coef",
                         "notice: train.vineppo_max_states is now "
                         "train.vineppo.max_states"]  # fmt: skip
    with pytest.raises(AttributeError):
        train.not_a_setting  # noqa: B018
    assert TrainConfig(loss="ppo", value_lr=1e-4).ppo.value_lr == 1e-4


def test_a_trl_script_assigns_an_old_name_on_its_tbaconfig():
    args = TBAConfig(output_dir="out", train={"loss": "ppo", "gae_lambda": 0.9})
    assert args.train.ppo.gae_lambda == 0.9
    args.train.value_coef = 0.3
    assert args.train.value_coef == args.train.ppo.value_coef == 0.3
    assert RunConfig.model_validate(args.model_dump()).train.ppo.value_coef == 0.3


def test_the_reference_lists_the_new_keys_and_the_renames(capsys):
    assert main(["config", "--reference"]) == 0
    page = capsys.readouterr().out
    rows = {line.split("`")[1] for line in page.splitlines() if line.startswith("| `")}
    assert {new for new in ALIASES.values()} <= rows
    assert not set(ALIASES) & rows
    renames = page.split("## Renamed keys")[1]
    assert all(f"- `{old}` → `{new}`" in renames for old, new in ALIASES.items())


def test_old_vllm_names_go_to_the_vllm_engines_section_with_a_notice(tmp_path, notices):
    config = load_config(None, ["searchers.engine=vllm",
                                "searchers.vllm.gpu_memory_utilization=0.5"])  # fmt: skip
    assert config.searchers.engine.gpu_memory_utilization == 0.5
    assert notices() == ["notice: searchers.vllm.gpu_memory_utilization is now "
                         "searchers.engine.gpu_memory_utilization"]  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text("searchers:\n  engine: vllm\n  vllm:\n    tensor_parallel_size: 2\n"
                    "    enforce_eager: true\n")  # fmt: skip
    engine = load_config(path).searchers.engine
    assert engine.tensor_parallel_size == 2 and engine.enforce_eager
    # An override by either name replaces the file's value.
    again = load_config(path, ["searchers.engine.tensor_parallel_size=1"]).searchers.engine
    assert again.tensor_parallel_size == 1 and again.enforce_eager
    both = ["searchers.engine=vllm", "searchers.vllm.dtype=float16",
            "searchers.engine.dtype=bfloat16"]  # fmt: skip
    assert "searchers.vllm.dtype and searchers.engine.dtype are one setting" in one_line_error(
        overrides=both)  # fmt: skip
    bad_dtype = ["searchers.engine=vllm", "searchers.vllm.dtype=int8"]
    assert one_line_error(overrides=bad_dtype).startswith(
        "invalid value for searchers.engine.dtype")  # checked under the new name


def old_run_config(engine: str, **vllm) -> dict:
    """A run directory's config.yaml as runs wrote it before the engine's section: the engine a
    name, and every vLLM setting under `searchers.vllm`, at its default or as `vllm` sets it."""
    data = yaml.safe_load(dump_config(load_config(None, [])))
    data["searchers"]["engine"] = engine
    data["searchers"]["vllm"] = {"gpu_memory_utilization": 0.3, "kv_cache_gb": None,
                                 "max_model_len": None, "dtype": "auto",
                                 "tensor_parallel_size": 1, "enforce_eager": False} | vllm
    return data


def test_a_config_yaml_from_before_the_engines_section_loads_as_it_did(tmp_path):
    """With the built-in engine its vLLM settings never had an effect: dropped, whatever their
    values; with the vLLM engine they are its settings."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old_run_config("builtin", gpu_memory_utilization=0.9)))
    assert load_config(path) == load_config(None, [])
    path.write_text(yaml.safe_dump(old_run_config("vllm", kv_cache_gb=0.25)))
    engine = load_config(path).searchers.engine
    assert engine == VllmEngineSettings(kv_cache_gb=0.25)
    assert load_config(None, ["searchers.vllm.enforce_eager=true"]).searchers.engine == (
        BuiltinEngineSettings()
    )


# ------------------------------------------------------------------------- rules and helpers


def test_every_cross_setting_rule_is_a_named_documented_function():
    for rule in (*TRAIN_RULES, *TASK_RULES, *RUN_RULES):
        assert rule.__name__.startswith("_") and rule.__doc__, rule
    names = {rule.__name__ for rule in (*TRAIN_RULES, *TASK_RULES, *RUN_RULES)}
    assert {"_group_of_one_needs_generation_baseline", "_lora_needs_one_rank",
            "_objective_settings_match_the_loss", "_check_searcher_devices"} <= names  # fmt: skip


def test_dotted_key_helpers():
    data = {"train": {"ppo": {"value_coef": 0.1}, "beta": None}, "seed": 1}
    assert get_key(data, "train.ppo.value_coef") == 0.1
    assert get_key(data, "train.tb.log_z") is None and get_key(data, "seed.x", 5) == 5
    assert has_key(data, "train.beta") and not has_key(data, "train.tb")
    set_key(data, "train.tb.log_z", "learned")
    assert data["train"]["tb"] == {"log_z": "learned"}
    assert flatten(data) == {"train.ppo.value_coef": 0.1, "train.beta": None,
                             "train.tb.log_z": "learned", "seed": 1}  # fmt: skip
    assert pop_key(data, "train.tb.log_z") == "learned" and pop_key(data, "train.x.y") is None
    with pytest.raises(NotASection) as caught:
        set_key(data, "seed.x", 2)
    assert caught.value.section == "seed" and isinstance(caught.value, ConfigError)
