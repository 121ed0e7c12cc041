"""The embedded math world: synthetic GSM8K-style word problems and their worked solutions.

Each problem needs one to three arithmetic steps. Its worked solution writes one equation per
line and ends with GSM8K's answer line, e.g.

    Ann has 8 pens, gets 7 more and gives away 5. How many left?
    8+7=15
    15-5=10
    #### 10

Train and held-out problems are disjoint by construction: a problem belongs to the held-out split
when a hash of its question text falls in a fixed bucket, so no held-out question is ever trained
on. The arithmetic is shared: the numbers are small, so a held-out question often asks for a
calculation that some training question (with other names and objects) also needs, as GSM8K's
test questions need the same skills as its training questions.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

NAMES = ["Ann", "Bob", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jo", "Max", "Nia", "Tom"]
ITEMS = ["pens", "eggs", "cards", "books", "coins", "cups", "toys", "nuts", "apples", "shells"]
HELD_OUT_BUCKETS = 10  # one bucket in ten is held out
VERSION = 4  # bump when generated problems change: it keys the cached base policy


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked solution, one equation per line, ending with "#### <answer>"
    answer: str


def format_prompt(question: str) -> str:
    """The prompt the built-in policy is trained on: the question, then a newline."""
    return question + "\n"


# ---------------------------------------------------------------------------- the generator


def _one_step(rng: random.Random) -> Callable[[str, str], Problem]:
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return lambda n, it: _make(
            f"{n} has {a} {it} and gets {b} more. How many now?", [(f"{a}+{b}", a + b)]
        )
    if kind == "sub":
        a, b = rng.randint(10, 18), rng.randint(1, 9)
        return lambda n, it: _make(
            f"{n} has {a} {it} and gives away {b}. How many left?", [(f"{a}-{b}", a - b)]
        )
    a, b = rng.randint(2, 4), rng.randint(2, 4)
    return lambda n, it: _make(
        f"{n} has {a} bags of {b} {it}. How many {it}?", [(f"{a}*{b}", a * b)]
    )


def _two_steps(rng: random.Random) -> Callable[[str, str], Problem]:
    kind = rng.choice(["add_sub", "mul_add"])
    if kind == "add_sub":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        c = rng.randint(1, min(9, a + b - 1))
        return lambda n, it: _make(
            f"{n} has {a} {it}, gets {b} more and gives away {c}. How many left?",
            [(f"{a}+{b}", a + b), (f"{a + b}-{c}", a + b - c)],
        )
    a, b, c = rng.randint(2, 4), rng.randint(2, 4), rng.randint(1, 9)
    return lambda n, it: _make(
        f"{n} has {a} bags of {b} {it} and {c} more {it}. How many {it}?",
        [(f"{a}*{b}", a * b), (f"{a * b}+{c}", a * b + c)],
    )


def _three_steps(rng: random.Random) -> Callable[[str, str], Problem]:
    a, b, c = rng.randint(2, 4), rng.randint(2, 4), rng.randint(1, 9)
    d = rng.randint(1, min(9, a * b + c - 1))
    return lambda n, it: _make(
        f"{n} has {a} bags of {b} {it} and {c} more, and gives away {d}. How many left?",
        [(f"{a}*{b}", a * b), (f"{a * b}+{c}", a * b + c), (f"{a * b + c}-{d}", a * b + c - d)],
    )


def _make(question: str, steps: list[tuple[str, int]]) -> Problem:
    lines = [f"{expression}={value}" for expression, value in steps]
    answer = str(steps[-1][1])
    return Problem(question, "\n".join(lines + [f"#### {answer}"]), answer)


def stopped_early(problem: Problem) -> str:
    """The problem's worked solution with its last equation left out, answering with the result
    before it: the "forgot the last step" slip. Solutions of fewer than three steps are returned
    unchanged."""
    *equations, _ = problem.solution.split("\n")
    if len(equations) < 3:
        return problem.solution
    kept = equations[:-1]
    return "\n".join(kept + [f"#### {kept[-1].split('=')[-1]}"])


def is_held_out(question: str) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return digest[0] % HELD_OUT_BUCKETS == 0


def random_problem(rng: random.Random, held_out: bool) -> Problem:
    """Draw problems until one falls in the requested split."""
    while True:
        steps = rng.choices([_one_step, _two_steps, _three_steps], weights=[2, 4, 4])[0]
        render = steps(rng)
        problem = render(rng.choice(NAMES), rng.choice(ITEMS))
        if is_held_out(problem.question) == held_out:
            return problem


def problems(split: str, count: int, seed: int) -> list[Problem]:
    """`count` problems of the `train` or `test` split, reproducible from `seed`."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    return [random_problem(rng, held_out=split == "test") for _ in range(count)]
