r"""The MATH verifier (Hendrycks et al. competition problems): the answer is the content of the
last `\boxed{...}` (or `\fbox{...}`) of the text.

Answers are compared after a light normalisation: spaces, `$`, `\left`/`\right`, spacing
commands, `^\circ`, `%`, a trailing full stop and `\text{...}` wrappers go; `\dfrac` and
`\tfrac` become `\frac`; a leading `x =` goes. Two answers match when their normalised texts are
equal, or when both are numbers (`1,000`, `0.5`, `-3`) or simple fractions (`\frac{1}{2}`,
`-\frac34`, `1/2`) of equal value. Text is only parsed, never evaluated; an expression that is
equal but written differently (`2\sqrt{2}` against `\sqrt{8}`) does not match.
"""

from __future__ import annotations

import re
from fractions import Fraction

PROMPT_TEMPLATE = (
    "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}.\n"
)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` in `text` (braces matched), or of `\boxed 5`;
    None when there is none or its braces are not closed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    if start < len(text) and text[start] != "{":
        match = re.match(r"[^\s$]+", text[start:])  # `\boxed 5`
        return match.group(0) if match else None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def gold_answer(solution: str) -> str:
    r"""The gold answer of a MATH row: its solution's last `\boxed{}`, or the whole text (an
    `answer` column holds the bare answer)."""
    boxed = last_boxed(str(solution))
    return (boxed if boxed is not None else str(solution)).strip()


_REMOVED = [r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", "\\ ", "$", r"^{\circ}", r"^\circ",
            r"\%", "%", r"\displaystyle"]  # fmt: skip
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def normalize(answer: str) -> str:
    """A light canonical form of an answer (see the module docstring)."""
    text = answer.strip()
    text = _TEXT.sub(r"\1", text)
    for token in _REMOVED:
        text = text.replace(token, "")
    text = text.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    text = "".join(text.split())
    text = re.sub(r"^[a-zA-Z]=(?!=)", "", text)  # `x=5` -> `5`
    text = text.rstrip(".")
    if text.startswith("{") and text.endswith("}") and last_boxed(r"\boxed" + text) == text[1:-1]:
        text = text[1:-1]
    return text


_INTEGER_OR_DECIMAL = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_FRACTION = re.compile(r"(-?)\\frac(?:\{(-?\d+)\}\{(-?\d+)\}|(\d)(\d))|(-?\d+)/(-?\d+)")


def as_number(text: str) -> Fraction | None:
    r"""The exact value of a normalised answer that is a number or a simple fraction."""
    if _INTEGER_OR_DECIMAL.fullmatch(text):
        return Fraction(text.replace(",", ""))
    match = _FRACTION.fullmatch(text)
    if match is None:
        return None
    sign, num, den, short_num, short_den, plain_num, plain_den = match.groups()
    numerator = int(num or short_num or plain_num)
    denominator = int(den or short_den or plain_den)
    if denominator == 0:
        return None
    value = Fraction(numerator, denominator)
    return -value if sign else value


def answers_match(predicted: str, gold: str) -> bool:
    a, b = normalize(predicted), normalize(gold)
    if a == b:
        return bool(a)
    x, y = as_number(a), as_number(b)
    return x is not None and x == y


def is_correct(completion: str, gold: str) -> bool:
    r"""True when the completion's last `\boxed{}` matches the gold answer."""
    predicted = last_boxed(completion)
    return predicted is not None and answers_match(predicted, gold)


def boxed_reward(
    prompts: list[str], completions: list[str], answer: list[str], **_: object
) -> list[float]:
    r"""1.0 when the completion's last `\boxed{}` matches the row's gold answer, else 0.0."""
    return [float(is_correct(c, a)) for c, a in zip(completions, answer)]
