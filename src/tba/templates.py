"""Prompt templates: a prompt rendered from a dataset row, `{column}` fields replaced by the row's
values (`{{` and `}}` for literal braces), e.g. `Problem:\\n{question}\\n\\nSolution:`."""

from __future__ import annotations

import string


def template_fields(template: str) -> list[str]:
    """The row fields a prompt template names (`{question}` -> `question`); ValueError (one line)
    for a field that is not named after a column."""
    fields = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        root = name.split(".")[0].split("[")[0]
        if not root or root.isdigit():
            raise ValueError(
                "fields of a prompt template must be named after the row's columns, e.g. "
                "{question}; write a literal brace as {{ or }}"
            )
        fields.append(root)
    return fields


def render(template: str, row: dict) -> str:
    return template.format_map(row)
