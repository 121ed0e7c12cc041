"""The GSM8K verifier: numeric answers written the way people and models write them.

The gold answer of a GSM8K row is the text after `####` in its `answer` column. A completion's
answer is the last number on its first `####` line that holds a number; a completion without such
a line answers with its last number. Numbers may carry thousands separators (`1,234`), a currency
sign (`$5`, `-$5`, `€3.50`), a sign, decimals and a trailing full stop; `3,4` is two numbers, not
34. Two answers match when they are equal as numbers (`3.50` == `3.5`). Text is only parsed, never
evaluated.
"""

from __future__ import annotations

import math
import re

# A number: optional sign, optional currency sign, then digits grouped by commas in threes or
# plain digits, then decimals; or a bare decimal fraction (`.5`).
_NUMBER = re.compile(
    r"(?<![\w.])"  # not the tail of a word or of another number
    r"([-−+]?)(?:[$€£¥₹]\s?)?([-−]?)"
    r"(\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_ANSWER_LINE = re.compile(r"####([^\n]*)")


def parse_number(text: str) -> float | None:
    """The value of `text` when it is one number ('1,234' -> 1234.0, '$5.' -> 5.0), else None."""
    numbers = find_numbers(text.strip())
    if len(numbers) != 1:
        return None
    return numbers[0]


def find_numbers(text: str) -> list[float]:
    """Every number written in `text`, in order."""
    values = []
    for sign, inner_sign, digits in _NUMBER.findall(text):
        value = float(digits.replace(",", ""))
        negative = (sign in ("-", "−")) != (inner_sign in ("-", "−"))
        values.append(-value if negative else value)
    return values


def gold_answer(answer: str) -> str:
    """The final answer of a GSM8K `answer` text: what follows its last `####` (the whole text
    when there is none, so a column of bare numbers works too)."""
    _, sep, tail = str(answer).rpartition("####")
    return (tail if sep else str(answer)).strip()


def extract_answer(completion: str) -> float | None:
    """The number a completion answers with: the last number on its first `####` line that has
    one, else the last number anywhere in it; None when it has no number."""
    for line in _ANSWER_LINE.findall(completion):
        numbers = find_numbers(line)
        if numbers:
            return numbers[-1]
    numbers = find_numbers(completion)
    return numbers[-1] if numbers else None


def is_correct(completion: str, gold: str) -> bool:
    """True when the completion's answer equals the gold answer as a number."""
    predicted, expected = extract_answer(completion), parse_number(gold_answer(gold))
    if predicted is None or expected is None:
        return False
    return math.isclose(predicted, expected, rel_tol=1e-9, abs_tol=1e-6)


def gsm8k_reward(
    prompts: list[str], completions: list[str], answer: list[str], **_: object
) -> list[float]:
    """1.0 when the completion's answer equals the row's gold answer, else 0.0."""
    return [float(is_correct(c, a)) for c, a in zip(completions, answer)]
