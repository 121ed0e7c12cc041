"""Dotted keys (`train.ppo.value_coef`) in nested dicts of settings: the one set of helpers that
the loading of configs, TRL's arguments, the Python API and checkpoints share."""

from __future__ import annotations

from typing import Any

from tba.errors import ConfigError

_MISSING = object()  # what `get_key` returns for a key not given, whatever the values


class NotASection(ConfigError):
    """A dotted key runs through a value, not a mapping of settings: `section` is the dotted
    path of that value, `value` what it holds."""

    def __init__(self, section: str, value: Any) -> None:
        super().__init__(f"{section} must be a mapping of settings")
        self.section, self.value = section, value


def get_key(data: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """The value at `dotted`, or `default` where a part of it is missing (or not a mapping)."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def has_key(data: dict[str, Any], dotted: str) -> bool:
    """Whether `dotted` is given in `data` (a value of None included)."""
    return get_key(data, dotted, _MISSING) is not _MISSING


def set_key(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` to `value`, making the mappings on the way; `NotASection` where one of them
    is given a value."""
    *parents, leaf = dotted.split(".")
    node = data
    for number, part in enumerate(parents, start=1):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise NotASection(".".join(parents[:number]), child)
        node = child
    node[leaf] = value


def pop_key(data: dict[str, Any], dotted: str) -> Any:
    """Remove `dotted` from `data` and return its value (None where it is not given)."""
    *parents, leaf = dotted.split(".")
    node = get_key(data, ".".join(parents)) if parents else data
    return node.pop(leaf, None) if isinstance(node, dict) else None


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` as `{"a.b": 1}`: every value that is not a mapping under its dotted
    key (an empty mapping is a value)."""
    flat: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{name}.")
        else:
            flat[f"{prefix}{name}"] = value
    return flat
