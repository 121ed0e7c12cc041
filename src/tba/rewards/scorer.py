"""Calling the user's reward functions without letting one bad call cost the run.

A reward function is `fn(prompts, completions, **columns) -> list[float]`, one finite number per
completion. A function that takes `log_extra` (by name or through `**kwargs`) gets TRL's
callable `log_extra(column, values)`: one value per completion, kept with each sample as
`extras[column]` (e.g. the red-teaming reward's `toxicity`). Where the prompt is a conversation,
the completion comes as TRL gives it, `[{"role": "assistant", "content": text}]`
(`as_reward_inputs`).

When a call raises, does not return within `timeout_s`, returns None, a list of the wrong length,
or None/NaN/inf for some completions, the completions it failed on are dropped and counted (never
scored as 0, which would teach the policy that they were wrong), and the fault is reported with
the function's name and the reason. A function whose last `max_failures` calls all failed stops
the run with `RewardError`: it is broken, not unlucky.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from tba.core import Prompt, RewardFn
from tba.errors import RewardError


class _Timeout(Exception):
    """The reward call did not return in time."""


def call_with_timeout(fn: RewardFn, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), or `_Timeout` after `timeout_s`. A hung call is left behind in a daemon
    thread (Python cannot kill a thread), so it never blocks the process from exiting."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = call_reward(fn, *args, **kwargs)
        except BaseException as error:  # handed to the caller's thread below
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True, name=f"reward-{_name(fn)}")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Timeout
    if "error" in result:
        raise result["error"]
    return result["value"]


def call_reward(fn: RewardFn, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), run to completion when `fn` is an `async def`."""
    value = fn(*args, **kwargs)
    return asyncio.run(value) if inspect.isawaitable(value) else value


def as_reward_inputs(
    prompts: Sequence[Prompt], completions: list[str]
) -> tuple[list[Prompt], list]:
    """Prompts and completions as the reward functions get them (TRL's conversational format):
    after a text prompt, the completion's text; after a conversation, the completion as the
    assistant's message. A completion that continued the prompt's own assistant message (a
    prefill) gets that message's text in front, and the prompt goes without it."""
    shaped_prompts: list[Prompt] = []
    shaped: list = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if isinstance(prompt, str):
            shaped_prompts.append(prompt)
            shaped.append(completion)
            continue
        prefilled = prompt[-1]["role"] == "assistant"
        prefill = prompt[-1]["content"] if prefilled else ""
        shaped_prompts.append(prompt[:-1] if prefilled else prompt)
        shaped.append([{"role": "assistant", "content": prefill + completion}])
    return shaped_prompts, shaped


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _takes(fn: RewardFn, name: str) -> bool:
    """Whether `fn` accepts the keyword argument `name` (explicitly or through **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def _as_reward(value: Any) -> float:
    """A finite float (True counts as 1), or NaN for anything else (None, NaN, inf, a string)."""
    if not isinstance(value, numbers.Real):
        return math.nan
    value = float(value)
    return value if math.isfinite(value) else math.nan


def total_rewards(parts: Iterable[Sequence[float]]) -> list[float]:
    """Per completion, the sum of the values of every reward function (`parts`: one list per
    function), added exactly (`math.fsum`)."""
    return [math.fsum(values) for values in zip(*parts)]


class RewardScorer:
    """Sums the reward functions per completion; NaN marks a completion to drop."""

    def __init__(self, reward_fns: Sequence[RewardFn], timeout_s: float, max_failures: int) -> None:
        self.reward_fns = list(reward_fns)
        self.timeout_s = timeout_s
        self.max_failures = max_failures
        self._failed_in_a_row: Counter[str] = Counter()

    def score(
        self, prompts: list[Prompt], completions: list[str], columns: dict[str, list]
    ) -> tuple[list[float], dict[str, list[float]], list[tuple[str, str, int]], dict[str, list]]:
        """(totals, values per function, faults, extra columns). A fault is (function, reason,
        completions affected); a total is NaN where some function gave no usable value."""
        prompts, completions = as_reward_inputs(prompts, completions)
        parts: dict[str, list[float]] = {}
        faults: list[tuple[str, str, int]] = []
        extras: dict[str, list] = {}

        def log_extra(column: str, values: list) -> None:
            if len(values) == len(completions):  # one per completion, or not at all
                extras[column] = list(values)

        for fn in self.reward_fns:
            name = _name(fn)
            kwargs = columns | ({"log_extra": log_extra} if _takes(fn, "log_extra") else {})
            values, reason = self._call(fn, prompts, completions, kwargs)
            parts[name] = values
            bad = sum(math.isnan(v) for v in values)
            if reason is not None:
                faults.append((name, reason, bad))
            failed = bad == len(values)  # nothing usable came back
            self._failed_in_a_row[name] = self._failed_in_a_row[name] + 1 if failed else 0
            if self._failed_in_a_row[name] >= self.max_failures:
                raise RewardError(
                    f"reward function {name!r} failed on its last {self.max_failures} calls "
                    f"(searchers.max_reward_failures); last: {reason}"
                )
        return total_rewards(parts.values()), parts, faults, extras

    def _call(
        self, fn: RewardFn, prompts: list[str], completions: list[str], columns: dict[str, list]
    ) -> tuple[list[float], str | None]:
        """One value per completion (NaN where unusable), and what went wrong, if anything."""
        unusable = [math.nan] * len(completions)
        try:
            returned = call_with_timeout(fn, self.timeout_s, prompts, completions, **columns)
        except _Timeout:
            return unusable, f"did not return within {self.timeout_s:g} s"
        except Exception as error:
            return unusable, f"raised {type(error).__name__}: {error}"
        if returned is None:
            return unusable, "returned None"
        try:
            returned = list(returned)
        except TypeError:
            return unusable, f"returned a {type(returned).__name__}, not a list"
        if len(returned) != len(completions):
            return unusable, f"returned {len(returned)} values for {len(completions)} completions"
        values = [_as_reward(v) for v in returned]
        bad = sum(math.isnan(v) for v in values)
        if bad:
            example = next(v for v, f in zip(returned, values) if math.isnan(f))
            return values, f"returned {example!r} (not a finite number) for {bad} completions"
        return values, None
