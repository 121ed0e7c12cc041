"""What every section of the configuration is: a `Section` (`tba.section`, below the
objectives too, whose own settings are sections of `train`), and how a section of several kinds
reads its value."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from tba.section import Section


def expand_shorthand(section: type[Section], value: Any) -> Any:
    """A bare value given for a section of several kinds, as the mapping it stands for."""
    if section.shorthand is not None and not isinstance(value, dict | BaseModel):
        return {section.shorthand: value}
    return value


def kind_settings(section: type[Section], value: Any, key: str, noun: str) -> Any:
    """A value given for `section`, a section of several kinds, as its kind's settings: a bare
    value stands for the mapping `{shorthand: value}`; a mapping is validated against the class
    its kind names (`section.variants()`), as a union discriminated on `shorthand` would be. What
    is wrong is a `ValueError` of one line naming the setting under `key` (`noun`: what a kind
    is called in it, "transport", "engine")."""
    if isinstance(value, section):
        return value
    value = expand_shorthand(section, value)
    if not isinstance(value, dict):
        return value  # pydantic says what is wrong with it
    field = section.shorthand
    kinds = section.variants()
    name = value.get(field, section.model_fields[field].default)
    if not isinstance(name, str) or name not in kinds:
        raise ValueError(f"{key}.{field}: unknown {noun} {name!r:.80}; known: "
                         f"{', '.join(kinds)}")  # fmt: skip
    try:
        return kinds[name].model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        if first["type"] == "extra_forbidden":
            allowed = ", ".join(kinds[name].model_fields)
            raise ValueError(f"{key}.{where}: not a setting of the {name!r} {noun} (its "
                             f"settings: {allowed})") from None  # fmt: skip
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{key}.{where}: {message} (got {first.get('input')!r:.80})") from None


def is_section(field) -> bool:
    """Whether a model's field holds a section of settings (a model), not a value."""
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
