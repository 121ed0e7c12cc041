"""What every section of the configuration is."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # strict: `true` is not a number and `"8"` is not an int; a typo must not pass as a value.
    # Every number finite: `.inf` as a learning rate trains one step, then fails somewhere deep.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True,
                              allow_inf_nan=False)  # fmt: skip


def is_section(field) -> bool:
    """Whether a model's field holds a section of settings (a model), not a value."""
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
