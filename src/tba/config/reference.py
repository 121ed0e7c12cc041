"""The configuration as text: a resolved one as YAML (`dump_config`), and every setting's
reference, docs/configuration.md (`reference_page`, `tba config --reference`)."""

from __future__ import annotations

import yaml
from pydantic import BaseModel

from tba.config.aliases import ALIASES
from tba.config.base import Section, is_section
from tba.config.presets import TASK_PRESETS
from tba.config.run import RunConfig


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(), sort_keys=False)


def reference_table(model: type[BaseModel] = RunConfig, prefix: str = "") -> str:
    """Every setting as a Markdown table row: `| key | default | meaning |`; a section of
    several kinds, its kinds' settings one after another, each marked with its kind."""
    rows = []
    for name, field in model.model_fields.items():
        if is_section(field) and field.annotation.variants():
            rows.append(_variant_rows(field, f"{prefix}{name}."))
        elif is_section(field):
            rows.append(reference_table(field.annotation, f"{prefix}{name}."))
        else:
            rows.append(_reference_row(f"{prefix}{name}", field))
    return "\n".join(rows)


def _variant_rows(field, prefix: str) -> str:
    """A section of several kinds: the field that picks the kind (its default the section's
    default), with each kind's meaning, then each kind's own settings."""
    section, default = field.annotation, field.default
    kind = section.shorthand
    meanings = "; ".join(variant.model_fields[kind].description or ""
                         for variant in section.variants().values())  # fmt: skip
    rows = [f"| `{prefix}{kind}` | `{getattr(default, kind)}` | {field.description}. "
            f"{meanings} |"]
    for name, variant in section.variants().items():
        for setting, setting_field in variant.model_fields.items():
            if setting != kind:
                rows.append(_reference_row(f"{prefix}{setting}", setting_field,
                                           f"(`{kind}={name}`) "))  # fmt: skip
    return "\n".join(rows)


def reference_page() -> str:
    """docs/configuration.md: every setting by section, with its default and meaning, and the
    defaults each task changes (`TASK_PRESETS`)."""
    header = "| key | default | meaning |\n|---|---|---|"
    fields = RunConfig.model_fields
    parts = [
        "# Configuration reference",
        "",
        "Every setting of a run, its default and its meaning. Generated from the code by "
        "`tba config --reference > docs/configuration.md`; a test keeps it current.",
        "",
        "A run is configured by a YAML file (`tba train CONFIG.yaml`) and `section.key=value` "
        "overrides (values parsed as YAML), on top of these defaults; `tba config [CONFIG.yaml] "
        "[key=value ...]` prints the resolved configuration. Every value is typed and checked: "
        "an unknown key, a wrong type or a value out of range is one line naming the key and "
        "what is allowed.",
        "",
        "## Top level",
        "",
        header,
        *(_reference_row(name, f) for name, f in fields.items() if not is_section(f)),
    ]
    for name, field in fields.items():
        if is_section(field):
            doc = field.annotation.__doc__
            parts += ["", f"## `{name}`", ""]
            if doc and doc != Section.__doc__:
                parts += [" ".join(doc.split()), ""]
            parts += [header, reference_table(field.annotation, f"{name}.")]
    parts += ["", "## Task presets", "", "Defaults a task changes, where the file and the "
              "overrides leave a key unset:", ""]  # fmt: skip
    for task, preset in TASK_PRESETS.items():
        settings = ", ".join(f"`{key}={value}`" for key, value in preset.items())
        parts.append(f"- `task.name={task}`: {settings}")
    renamed = ("Older names that still work, with a notice on stderr (an old name of another "
               "objective's setting than `train.loss`'s, or of the vLLM engine's with another "
               "engine, is ignored, as it always was). An "
               "override by either name replaces the value a file gives the other; both names "
               "in one file, or on one command line, are an error:")  # fmt: skip
    parts += ["", "## Renamed keys", "", renamed, ""]
    parts += [f"- `{old}` → `{new}`" for old, new in ALIASES.items()]
    return "\n".join(parts) + "\n"


def _reference_row(key: str, field, note: str = "") -> str:
    default = "null" if field.default is None else field.default
    if isinstance(default, str):  # a newline shown as `\n`, not as a break in the table
        default = default.encode("unicode_escape").decode()
    return f"| `{key}` | `{default}` | {note}{field.description or ''} |"
