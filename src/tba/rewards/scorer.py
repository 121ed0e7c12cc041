"""Calling the user's reward functions, TRL's contract, without letting one bad call cost the run.

A reward function is called with keyword arguments, as TRL's `GRPOTrainer` calls it:

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
       log_metric=..., **columns) -> list[float | None]

`columns` are the dataset's other columns, one value per completion. A function receives the
keywords it names, or all of them with `**kwargs`; it may be `async def`. Where the prompt is a
conversation, the completion comes as TRL gives it, `[{"role": "assistant", "content": text}]`
(`as_reward_inputs`). `trainer_state.global_step` is the optimizer step at which the weights that
wrote the completions were published (`max_steps` the run's step limit, 0 when time ends the
run). `log_extra(column, values)` keeps one value per completion with each sample as
`extras[column]` (e.g. the red-teaming reward's `toxicity`); `log_metric(name, value)` a number
for the whole call, averaged into the step's metrics under `name`, as TRL reports it.

A function returns one value per completion: a finite number, or None for a completion it does
not score (TRL's convention for functions that apply to some rows only). What TRL accepts is
read as numbers: a list or tuple of Python, numpy or torch numbers or booleans, a numpy array or
a torch tensor (`as_values`). A completion's reward is the sum of the values it got, each times
the function's weight (`task.reward_weights`, default 1); a completion no function scores is
dropped and counted (`unscored`).

When a call raises, does not return within `timeout_s`, returns something that is not a list of
that length, or NaN or inf for some completions, the completions it failed on are dropped and
counted (never scored as 0, which would teach the policy that they were wrong), and the fault is
reported with the function's name and the reason. A function whose last `max_failures` calls all
failed stops the run with `RewardError`: it is broken, not unlucky.

A value that is not a number at all (a string, even one that reads as a number like `"1"`, a
list, a dict) is a bug in the function, not a fault of a completion: it stops the run at once
with `RewardError` naming the value, as TRL's `torch.tensor` stops on it. Dropping those
completions would train on the rest alone: a function returning `"1"` for right answers and
`0.0` otherwise would teach only its zeros.
"""

from __future__ import annotations

import asyncio
import decimal
import inspect
import math
import numbers
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tba.core import Prompt, RewardFn
from tba.errors import ConfigError, RewardError


@dataclass(frozen=True)
class TrainerState:
    """What reward functions get as `trainer_state`: how far training was when the weights that
    wrote the completions were published."""

    global_step: int
    max_steps: int  # 0: no step limit (the run ends by time)


@dataclass
class Scores:
    """The rewards of a batch of completions."""

    totals: list[float]  # weighted sum of the values each completion got; NaN: drop it
    parts: dict[str, list[float | None]]  # per function: its value, None (not scored), NaN (failed)
    faults: list[tuple[str, str, int]]  # (function, reason, completions it failed on)
    extras: dict[str, list]  # columns logged with `log_extra`
    unscored: int  # completions that no function scored (dropped)
    metrics: dict[str, float] = field(default_factory=dict)  # `log_metric`: each name's mean


class _Timeout(Exception):
    """The reward call did not return in time."""


def call_with_timeout(fn: RewardFn, timeout_s: float, **kwargs: Any) -> Any:
    """fn(**kwargs), or `_Timeout` after `timeout_s`. A hung call is left behind in a daemon
    thread (Python cannot kill a thread), so it never blocks the process from exiting."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = call_reward(fn, **kwargs)
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


def call_reward(fn: RewardFn, **kwargs: Any) -> Any:
    """fn(**kwargs) with the keywords `fn` takes (all of them when it has `**kwargs`), run to
    completion when `fn` is an `async def`."""
    value = fn(**accepted_keywords(fn, kwargs))
    return asyncio.run(value) if inspect.isawaitable(value) else value


def accepted_keywords(fn: RewardFn, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords `fn` names, or all of them when it takes `**kwargs` (or has no signature)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {key: value for key, value in kwargs.items() if key in parameters}


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


def as_values(returned: Any) -> list | None:
    """What a reward function returned, as a list of its values: a numpy array or a torch
    tensor (on any device) becomes Python numbers; None where it is not a sequence of values."""
    to_list = getattr(returned, "tolist", None)  # numpy arrays, torch tensors
    if callable(to_list) and not isinstance(returned, list | tuple | str | bytes):
        returned = to_list()
    if isinstance(returned, str | bytes | dict) or not hasattr(returned, "__iter__"):
        return None
    return list(returned)


# What `_number` gives for a value that is no number (a string, a list, an array of several).
NOT_A_NUMBER = object()


def _number(value: Any) -> float | None | object:
    """A float (True counts as 1, NaN and inf stay), from a Python, numpy or torch number (a
    one-element array or tensor too) or a `Decimal`; None stays None (not scored);
    `NOT_A_NUMBER` for anything else: a string is not read as a number, as in TRL."""
    if value is None:
        return None
    if isinstance(value, str | bytes):
        return NOT_A_NUMBER
    if isinstance(value, decimal.Decimal):
        return float(value)
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:  # numpy scalars (numpy booleans are not `numbers.Real`), 0-d tensors
            value = value.item()
        except (ValueError, RuntimeError):  # an array of several values
            return NOT_A_NUMBER
    if not isinstance(value, numbers.Real):
        return NOT_A_NUMBER
    return float(value)


def _as_reward(value: Any) -> float | None:
    """A finite float (`_number`); None stays None (not scored); NaN for anything else (NaN,
    inf, a string)."""
    value = _number(value)
    if value is None:
        return None
    if value is NOT_A_NUMBER or not math.isfinite(value):  # type: ignore[arg-type]
        return math.nan
    return value  # type: ignore[return-value]


def not_a_number_error(name: str, returned: list, count: int) -> RewardError | None:
    """The error for a function that returned something that is no number for some completions
    (None when all its values are numbers or None): it is the function's bug, and dropping those
    completions alone would train on the others' values."""
    wrong = [value for value in returned if _number(value) is NOT_A_NUMBER]
    if not wrong:
        return None
    example = wrong[0]
    what = f"{example!r:.60}, a {type(example).__name__},"
    advice = "rewards are numbers (or None for a completion not scored), as in TRL"
    if isinstance(example, str):
        try:
            readable = math.isfinite(float(example))
        except ValueError:
            readable = False
        if readable:
            advice += f", which reads no string as a number: return float({example!r})"
    return RewardError(f"reward function {name!r} returned {what} for {len(wrong)} of {count} "
                       f"completions: {advice}")  # fmt: skip


def check_reward_weights(weights: Sequence[float] | None, count: int) -> None:
    """`task.reward_weights`, when given, has one weight per reward function."""
    if weights is not None and len(weights) != count:
        raise ConfigError(f"task.reward_weights has {len(weights)} weights for {count} reward "
                          "functions: give one weight per function")  # fmt: skip


def _failed(value: float | None) -> bool:
    return value is not None and math.isnan(value)


class RewardScorer:
    """Calls every reward function on a batch of completions and adds their weighted values."""

    def __init__(
        self,
        reward_fns: Sequence[RewardFn],
        *,
        weights: Sequence[float] | None = None,
        timeout_s: float = 60.0,
        max_failures: int = 5,
        call_again: bool = False,
    ) -> None:
        """`call_again`: a function that fails on every completion of a call is called once more
        (a cold start, a passing outage) before its values are taken as failed."""
        self.reward_fns = list(reward_fns)
        check_reward_weights(weights, len(self.reward_fns))
        self.weights = list(weights) if weights is not None else [1.0] * len(self.reward_fns)
        self.timeout_s = timeout_s
        self.max_failures = max_failures
        self.call_again = call_again
        self._failed_in_a_row: Counter[str] = Counter()

    def score(
        self,
        prompts: list[Prompt],
        completions: list[str],
        completion_ids: list[list[int]],
        columns: dict[str, list],
        trainer_state: TrainerState | None = None,
    ) -> Scores:
        """The rewards of `completions` (see the module docstring)."""
        prompts, shaped = as_reward_inputs(prompts, completions)
        extras: dict[str, list] = {}

        def log_extra(column: str, values: list) -> None:
            if len(values) == len(shaped):  # one per completion, or not at all
                extras[column] = list(values)

        logged: dict[str, list[float]] = {}

        def log_metric(name: str, value: float) -> None:
            value = _as_reward(value)  # a number, or nothing
            if value is not None and not math.isnan(value):
                logged.setdefault(str(name), []).append(value)

        arguments = {**columns, "prompts": prompts, "completions": shaped,
                     "completion_ids": completion_ids, "trainer_state": trainer_state,
                     "log_extra": log_extra, "log_metric": log_metric}  # fmt: skip
        parts: dict[str, list[float | None]] = {}
        faults: list[tuple[str, str, int]] = []
        for fn in self.reward_fns:
            name = _name(fn)
            values, reason = self._call(fn, arguments, len(shaped))
            parts[name] = values
            failed = sum(_failed(v) for v in values)
            if reason is not None:
                faults.append((name, reason, failed))
            # Nothing usable came back (a function that scores nothing, all None, has not failed).
            all_failed = failed == len(values)
            self._failed_in_a_row[name] = self._failed_in_a_row[name] + 1 if all_failed else 0
            if self._failed_in_a_row[name] >= self.max_failures:
                raise RewardError(
                    f"reward function {name!r} failed on its last {self.max_failures} calls "
                    f"(searchers.max_reward_failures); last: {reason}"
                )
        totals, unscored = self._totals(list(parts.values()), len(shaped))
        metrics = {name: math.fsum(values) / len(values) for name, values in logged.items()}
        return Scores(totals, parts, faults, extras, unscored, metrics)

    def _totals(self, parts: list[list[float | None]], count: int) -> tuple[list[float], int]:
        """Per completion, the weighted sum of the values it got (exact: `math.fsum`); NaN where a
        function failed on it or none scored it. And how many none scored."""
        totals, unscored = [], 0
        for i in range(count):
            values = [(weight, part[i]) for weight, part in zip(self.weights, parts)]
            if any(_failed(value) for _, value in values):
                totals.append(math.nan)
                continue
            given = [weight * value for weight, value in values if value is not None]
            if not given:
                unscored += 1
                totals.append(math.nan)
                continue
            totals.append(math.fsum(given))
        return totals, unscored

    def _call(
        self, fn: RewardFn, arguments: dict[str, Any], count: int
    ) -> tuple[list[float | None], str | None]:
        """One value per completion (None: not scored; NaN: unusable), and what went wrong
        (with `call_again`, what went wrong at the first call when the second worked)."""
        values, reason = self._call_once(fn, arguments, count)
        if self.call_again and count and all(_failed(v) for v in values):
            values, again = self._call_once(fn, arguments, count)
            reason = again if again is not None else f"{reason} (then worked, called again)"
        return values, reason

    def _call_once(
        self, fn: RewardFn, arguments: dict[str, Any], count: int
    ) -> tuple[list[float | None], str | None]:
        unusable: list[float | None] = [math.nan] * count
        try:
            returned = call_with_timeout(fn, self.timeout_s, **arguments)
        except _Timeout:
            return unusable, f"did not return within {self.timeout_s:g} s"
        except Exception as error:
            return unusable, f"raised {type(error).__name__}: {error}"
        if returned is None:
            return unusable, "returned None"
        values = as_values(returned)
        if values is None:
            return unusable, f"returned a {type(returned).__name__}, not a list"
        returned = values
        if len(returned) != count:
            return unusable, f"returned {len(returned)} values for {count} completions"
        if (error := not_a_number_error(_name(fn), returned, count)) is not None:
            raise error
        values = [_as_reward(v) for v in returned]
        failed = sum(_failed(v) for v in values)
        if failed:
            example = next(v for v, f in zip(returned, values) if _failed(f))
            return values, f"returned {example!r} (not a finite number) for {failed} completions"
        return values, None
