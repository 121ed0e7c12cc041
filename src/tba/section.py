"""What every section of settings is: a strict pydantic model.

It sits below both the configuration (`tba.config`, a tree of sections) and the objectives
(`tba.objectives`, each of which may define a section of its own, `train.<objective>`), so that
the two share one definition of what a setting accepts.
"""

from __future__ import annotations

from typing import ClassVar

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
