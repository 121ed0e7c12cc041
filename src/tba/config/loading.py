"""Reading a configuration: defaults, the task's presets, a YAML file and `key=value` overrides,
validated into a `RunConfig`; what is wrong is one line (`ConfigError`) naming the key."""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tba.config.aliases import ALIASES, objective_of, other_name
from tba.config.base import Section, expand_shorthand, is_section
from tba.config.presets import TASK_PRESETS
from tba.config.run import RunConfig
from tba.config.task import TaskConfig
from tba.config.train import TrainConfig
from tba.errors import ConfigError, first_line
from tba.keys import NotASection, get_key, has_key, pop_key, set_key


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Defaults (the task's own where `TASK_PRESETS` has some), then the YAML file (if any), then
    `a.b=value` overrides (values parsed as YAML)."""
    data = apply_overrides(_read_yaml(Path(path)) if path is not None else {}, overrides)
    _check_sections(data)
    task = data.get("task", {}).get("name") if isinstance(data.get("task"), dict) else None
    loss = get_key(data, "train.loss", TrainConfig.model_fields["loss"].default)
    for key, value in TASK_PRESETS.get(task or TaskConfig().name, {}).items():
        if objective_of(key) not in (None, loss):  # another objective's setting: not this run's
            continue
        if not has_key(data, key) and not has_key(data, other_name(key) or key):
            _set_nested(data, key, value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(first_error_line(error)) from None


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """`data` (nested settings) with `a.b=value` strings applied in order (values parsed as
    YAML; a key given twice: the last one). A renamed setting's override replaces the value of
    its other name in `data` (`ALIASES`); both names in one list of overrides is an error, as
    both in one file is."""
    given: set[str] = set()
    for override in overrides:
        key, value = _parse_override(override)
        other = other_name(key)
        if other in given:
            old, new = (key, other) if key in ALIASES else (other, key)
            raise ConfigError(f"{old} and {new} are one setting (renamed): give it once, as {new}")
        if other is not None and has_key(data, other):
            pop_key(data, other)
        _set_nested(data, key, value)
        given.add(key)
    return data


def quoted(value: Any, limit: int = 80) -> str:
    """`repr(value)` for an error line, `shortened`."""
    return shortened(repr(value), limit)


def shortened(text: str, limit: int = 80) -> str:
    """`text` for an error line, cut to `limit` characters with the length of the whole when
    longer: a value of megabytes is not echoed whole."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-4` as a string; read it as the float every user means. A key given twice
    in one mapping (a second `train:` section, a setting repeated) is an error, not a silent
    replacement of the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice (first on line {seen[key] + 1})",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _read_yaml(path: Path) -> dict[str, Any]:
    if not _is_file(path):
        raise ConfigError(f"config file not found: {shortened(str(path))}")
    try:
        data = _parse_yaml(_decoded(path))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(error, "problem", None) or first_line(error)
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings, got {type(data).__name__}")
    return data


def _is_file(path: Path) -> bool:
    """`path.is_file()`, False also for a name the system refuses (too long: a setting of
    megabytes given where a config file is expected)."""
    try:
        return path.is_file()
    except OSError:
        return False


# Byte-order marks and the encodings they announce, the longest first (UTF-32 LE's begins with
# UTF-16 LE's): what Windows editors save as "Unicode" reads as what it unambiguously is.
_MARKED_ENCODINGS = (
    (codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)  # fmt: skip


def _decoded(path: Path) -> str:
    """The text of the config file `path`: UTF-8, or UTF-8, UTF-16 or UTF-32 with a byte-order
    mark. Anything else (Latin-1, UTF-16 without a mark) is one line naming the file, where it
    stops being text of its encoding, and what to do."""
    raw = path.read_bytes()
    encoding = next((name for mark, name in _MARKED_ENCODINGS if raw.startswith(mark)), "utf-8")
    name = encoding.removesuffix("-sig").upper()
    said = "" if encoding == "utf-8" else ", as its byte-order mark says"
    guess = ": Latin-1 or another 8-bit encoding?" if encoding == "utf-8" else ""
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(
            f"{path} is not {name} text{said} (byte 0x{raw[error.start]:02x} on line {line}, its "
            f"byte {column}{guess}): save the file as UTF-8"
        ) from None
    if "\x00" in text:  # UTF-16 or UTF-32 without a byte-order mark reads as UTF-8 with NULs
        raise ConfigError(f"{path} is not {name} text{said}: it holds NUL bytes (UTF-16 or "
                          "UTF-32 without a byte-order mark?); save the file as UTF-8")  # fmt: skip
    return text


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {quoted(text)} must look like key=value "
                          "(e.g. train.beta=0.05)")  # fmt: skip
    try:
        value = _parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _set_nested(data: dict[str, Any], dotted_key: str, value: Any) -> None:
    """`keys.set_key`, with a section given a value named as the user wrote it (a section of
    several kinds given its kind alone first becomes the mapping it stands for)."""
    try:
        set_key(data, dotted_key, value)
    except NotASection as error:
        section = _section_type(error.section)
        if section is not None and section.shorthand is not None:
            set_key(data, error.section, expand_shorthand(section, error.value))
            set_key(data, dotted_key, value)
            return
        if _section_fields(error.section):  # a section the file left empty, or gave a value
            raise ConfigError(section_message(error.section, error.value)) from None
        part = error.section.rpartition(".")[2]
        raise ConfigError(f"{dotted_key}: {part} is a value, not a section") from None


def _check_sections(
    data: dict[str, Any], model: type[BaseModel] | None = None, prefix: str = ""
) -> None:
    """Every section given (`train`, `task.redteam`, ...) is a mapping of settings: one that is
    a value or empty is named as the user wrote it, before defaults are filled in under it."""
    for name, field in (model or RunConfig).model_fields.items():
        if is_section(field) and name in data:
            data[name] = expand_shorthand(field.annotation, data[name])
            if not isinstance(data[name], dict):
                raise ConfigError(section_message(prefix + name, data[name]))
            _check_sections(data[name], field.annotation, f"{prefix}{name}.")


def section_message(key: str, value: Any) -> str:
    """What to say of a section given something other than a mapping of settings."""
    if value is None:
        return (f"{key} is empty: a section needs settings under it ({key}.KEY: value), none "
                "are given (all commented out?); remove the section or give it a setting")
    return (f"{key} is a section of settings, not a value (got {quoted(value, 40)}): set its keys, "
            f"e.g. {key}.{next(iter(_section_fields(key)), 'KEY')}=...")


def first_error_line(error: ValidationError) -> str:
    """One line: the dotted key, what is wrong (for a value of several kinds, what each kind
    wants), and what was given."""
    errors = error.errors()
    first = errors[0]
    key = _setting_key(first["loc"])
    if first["type"] != "extra_forbidden":
        # A setting of several kinds (`Annotated[float, ...] | Literal["auto"]`) fails once per
        # kind, each under a location pydantic names after the kind: one message for them all.
        wanted = [e["msg"] for e in errors if _setting_key(e["loc"]) == key]
        first = {**first, "msg": ", or ".join(dict.fromkeys(wanted))}
    if first["type"] == "extra_forbidden":
        parent = ".".join(str(part) for part in first["loc"][:-1])
        allowed = sorted(_section_fields(parent))
        return f"unknown config key {quoted(key)}; allowed here: {', '.join(allowed)}"
    message = first["msg"].removeprefix("Value error, ")
    if message.startswith(f"{key}."):  # a section of several kinds names its own setting
        return f"invalid value for {message}"
    given = first.get("input")
    if first["type"] == "model_type" and not isinstance(given, dict):  # a section, given a value
        return section_message(key, given)
    shown = "" if isinstance(given, dict) else f" (got {quoted(given)})"
    return f"invalid value for {key}: {message}{shown}"


def is_section_type(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _setting_key(loc: tuple) -> str:
    """The dotted key of an error's location, without the parts pydantic adds for the kinds of
    a union (`constrained-float`, `literal['auto']`): section and setting names, and list
    indices."""
    parts: list[str] = []
    model: type[BaseModel] | None = RunConfig
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif model is not None and part in model.model_fields:
            parts.append(part)
            annotation = model.model_fields[part].annotation
            model = annotation if is_section_type(annotation) else None
        elif model is not None:  # an unknown key: named as written
            parts.append(part)
            model = None
    return ".".join(parts) or "config"


def _section_type(dotted: str) -> type[BaseModel] | None:
    """The class of the section `dotted` ("" the top level); None if it is no section."""
    model: type[BaseModel] = RunConfig
    for part in filter(None, dotted.split(".")):
        if part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        if not is_section_type(annotation):
            return None
        model = annotation
    return model


def _section_fields(dotted: str) -> list[str]:
    """The settings of the section `dotted` ("" the top level); none if it is no section (of a
    section of several kinds, every kind's)."""
    model = _section_type(dotted)
    if model is None:
        return []
    kinds = model.variants().values() if issubclass(model, Section) else ()
    return list(dict.fromkeys([*model.model_fields, *(f for k in kinds for f in k.model_fields)]))
