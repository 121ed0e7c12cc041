"""What every section of the configuration is."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # strict: `true` is not a number and `"8"` is not an int; a typo must not pass as a value.
    # Every number finite: `.inf` as a learning rate trains one step, then fails somewhere deep.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True,
                              allow_inf_nan=False)  # fmt: skip
    # A section of several kinds (a union discriminated on one field): that field's name, which
    # a bare value given for the whole section sets (`searchers.weight_transfer=broadcast` is
    # `searchers.weight_transfer.type=broadcast`); None for a section of one kind.
    shorthand: ClassVar[str | None] = None

    @classmethod
    def variants(cls) -> dict[str, type[Section]]:
        """A section of several kinds: each kind's class, by the value of `shorthand`."""
        return {}


def expand_shorthand(section: type[Section], value: Any) -> Any:
    """A bare value given for a section of several kinds, as the mapping it stands for."""
    if section.shorthand is not None and not isinstance(value, dict | BaseModel):
        return {section.shorthand: value}
    return value


def is_section(field) -> bool:
    """Whether a model's field holds a section of settings (a model), not a value."""
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
