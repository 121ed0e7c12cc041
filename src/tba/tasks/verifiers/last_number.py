"""The embedded math task's verifier: the answer is the last number the completion writes,
wherever it is (`8+7=15 ... #### 10` answers 10; so does `... #### x10`).

This is a looser rule than GSM8K's (`tba.tasks.verifiers.gsm8k`, which reads the `####` line
first and only takes numbers that stand on their own): the tiny built-in policy, sampled hot,
writes answer lines such as `#### Q3`, and the embedded task counts its last number, as it always
has. Numbers may carry thousands separators (`1,234`), a `$` and a sign. Text is only parsed,
never evaluated.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def _value(text: str) -> float | None:
    """'1,234' -> 1234.0, '$5' -> 5.0, '-3.50' -> -3.5; None when it is not a number."""
    cleaned = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def last_number(text: str) -> float | None:
    """The last number written in `text`."""
    matches = _NUMBER.findall(text)
    return _value(matches[-1]) if matches else None


def is_correct(completion: str, answer: str) -> bool:
    """True when the last number of the completion equals the gold answer."""
    predicted, gold = last_number(completion), _value(answer)
    return predicted is not None and gold is not None and abs(predicted - gold) < 1e-6


def last_number_reward(
    prompts: list[str], completions: list[str], answer: list[str], **_: object
) -> list[float]:
    """1.0 when the completion's last number is the gold answer, else 0.0."""
    return [float(is_correct(c, a)) for c, a in zip(completions, answer)]
