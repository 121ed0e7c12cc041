"""The embedded math task: synthetic GSM8K-style word problems, and the GSM8K verifier.

Each problem needs one to three arithmetic steps. Its worked solution writes one equation per
line and ends with GSM8K's answer line, e.g.

    Ann has 12 pens, gets 7 more and gives away 5. How many left?
    12+7=19
    19-5=14
    #### 14

Train and held-out problems are disjoint by construction: a problem belongs to the held-out split
when a hash of its arithmetic (kind and all its numbers) falls in a fixed bucket, so no held-out
problem is ever trained on under other names or objects. Single equations (`3*4=12`) are shared
between the splits, as they are between GSM8K's.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NAMES = ["Ann", "Bob", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jo", "Max", "Nia", "Tom"]
ITEMS = ["pens", "eggs", "cards", "books", "coins", "cups", "toys", "nuts", "apples", "shells"]
HELD_OUT_BUCKETS = 10  # one bucket in ten is held out
VERSION = 2  # bump when generated problems change: it keys the cached base policy


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked solution ending with "#### <answer>"
    answer: str


def format_prompt(question: str) -> str:
    """The prompt the built-in policy is trained on: the question, then a newline."""
    return question + "\n"


# ---------------------------------------------------------------------------- the verifier

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def parse_number(text: str) -> float | None:
    """'1,234' -> 1234.0, '$5' -> 5.0, '-3.50' -> -3.5; None when it is not a number."""
    cleaned = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def last_number(text: str) -> float | None:
    """The last number written in `text` (GSM8K's convention for the final answer)."""
    matches = _NUMBER.findall(text)
    return parse_number(matches[-1]) if matches else None


def is_correct(completion: str, answer: str) -> bool:
    """True when the last number of the completion equals the gold answer. Never evaluates text."""
    predicted, gold = last_number(completion), parse_number(answer)
    return predicted is not None and gold is not None and abs(predicted - gold) < 1e-6


def correctness_reward(
    prompts: list[str], completions: list[str], answer: list[str], **_: object
) -> list[float]:
    """1.0 when the completion's last number is the gold answer, else 0.0."""
    return [float(is_correct(c, a)) for c, a in zip(completions, answer)]


# ---------------------------------------------------------------------------- the generator


def _one_step(rng: random.Random) -> tuple[tuple, Callable[[str, str], Problem]]:
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        a, b = rng.randint(2, 19), rng.randint(2, 9)
        return (kind, a, b), lambda n, it: _make(
            f"{n} has {a} {it} and gets {b} more. How many now?", [(f"{a}+{b}", a + b)]
        )
    if kind == "sub":
        a, b = rng.randint(10, 29), rng.randint(2, 9)
        return (kind, a, b), lambda n, it: _make(
            f"{n} has {a} {it} and gives away {b}. How many left?", [(f"{a}-{b}", a - b)]
        )
    a, b = rng.randint(2, 5), rng.randint(2, 9)
    return (kind, a, b), lambda n, it: _make(
        f"{n} has {a} bags of {b} {it}. How many {it}?", [(f"{a}*{b}", a * b)]
    )


def _two_steps(rng: random.Random) -> tuple[tuple, Callable[[str, str], Problem]]:
    kind = rng.choice(["add_sub", "mul_add"])
    if kind == "add_sub":
        a, b = rng.randint(2, 19), rng.randint(2, 9)
        c = rng.randint(2, min(9, a + b - 1))
        return (kind, a, b, c), lambda n, it: _make(
            f"{n} has {a} {it}, gets {b} more and gives away {c}. How many left?",
            [(f"{a}+{b}", a + b), (f"{a + b}-{c}", a + b - c)],
        )
    a, b, c = rng.randint(2, 5), rng.randint(2, 9), rng.randint(2, 9)
    return (kind, a, b, c), lambda n, it: _make(
        f"{n} has {a} bags of {b} {it} and {c} more {it}. How many {it}?",
        [(f"{a}*{b}", a * b), (f"{a * b}+{c}", a * b + c)],
    )


def _three_steps(rng: random.Random) -> tuple[tuple, Callable[[str, str], Problem]]:
    a, b, c = rng.randint(2, 5), rng.randint(2, 9), rng.randint(2, 9)
    d = rng.randint(2, min(9, a * b + c - 1))
    return ("mul_add_sub", a, b, c, d), lambda n, it: _make(
        f"{n} has {a} bags of {b} {it} and {c} more, and gives away {d}. How many left?",
        [(f"{a}*{b}", a * b), (f"{a * b}+{c}", a * b + c), (f"{a * b + c}-{d}", a * b + c - d)],
    )


def _make(question: str, steps: list[tuple[str, int]]) -> Problem:
    lines = [f"{expression}={value}" for expression, value in steps]
    answer = str(steps[-1][1])
    return Problem(question, "\n".join(lines + [f"#### {answer}"]), answer)


def _is_held_out(arithmetic: tuple) -> bool:
    digest = hashlib.sha256(repr(arithmetic).encode()).digest()
    return digest[0] % HELD_OUT_BUCKETS == 0


def random_problem(rng: random.Random, held_out: bool) -> Problem:
    """Draw problems until one falls in the requested split."""
    while True:
        steps = rng.choices([_one_step, _two_steps, _three_steps], weights=[4, 4, 2])[0]
        arithmetic, render = steps(rng)
        if _is_held_out(arithmetic) == held_out:
            return render(rng.choice(NAMES), rng.choice(ITEMS))


def problems(split: str, count: int, seed: int) -> list[Problem]:
    """`count` problems of the `train` or `test` split, reproducible from `seed`."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    return [random_problem(rng, held_out=split == "test") for _ in range(count)]


def problem_stream(seed: int) -> Iterator[Problem]:
    """An endless stream of fresh training problems."""
    rng = random.Random(f"stream-{seed}")
    while True:
        yield random_problem(rng, held_out=False)
