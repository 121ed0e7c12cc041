"""The embedded math task: problem generator, train/test split, last-number verifier, task rows."""

from __future__ import annotations

import builtins
import os
import re

import pytest

from tba.tasks.math.task import math_task
from tba.tasks.math.world import format_prompt, is_held_out, problems, stopped_early
from tba.tasks.verifiers.last_number import is_correct, last_number_reward

NUM_TRAIN, NUM_TEST = 1500, 300

# The arithmetic kind of a problem, from the operators of its solution lines.
KINDS = {
    ("+",): "add",
    ("-",): "sub",
    ("*",): "mul",
    ("+", "-"): "add_sub",
    ("*", "+"): "mul_add",
    ("*", "+", "-"): "mul_add_sub",
}


@pytest.fixture(scope="module")
def train_problems():
    return problems("train", NUM_TRAIN, seed=0)


@pytest.fixture(scope="module")
def test_problems():
    return problems("test", NUM_TEST, seed=0)


def evaluate(expression: str) -> int:
    """+, - and * on non-negative integer literals, * first; anything else is an error."""
    if not re.fullmatch(r"\d+(?:[-+*]\d+)*", expression):
        raise ValueError(f"not a +-* expression: {expression!r}")
    tokens = re.findall(r"\d+|[-+*]", expression)
    terms, signs = [int(tokens[0])], [1]
    for operator, operand in zip(tokens[1::2], tokens[2::2], strict=True):
        if operator == "*":
            terms[-1] *= int(operand)
        else:
            terms.append(int(operand))
            signs.append(1 if operator == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms, strict=True))


def parse_solution(solution: str) -> tuple[list[tuple[str, int]], str]:
    """([(expression, value), ...], final answer) of a worked solution."""
    *lines, last = solution.split("\n")
    final = re.fullmatch(r"#### (-?\d+)", last)
    assert final, f"solution does not end with '#### <answer>': {solution!r}"
    equations = []
    for line in lines:
        match = re.fullmatch(r"([\d+\-*]+)=(-?\d+)", line)
        assert match, f"not an 'expr=value' line: {line!r}"
        equations.append((match.group(1), int(match.group(2))))
    return equations, final.group(1)


def arithmetic_of(problem) -> tuple:
    """(kind, numbers...) as the generator hashes it, recovered from the worked solution:
    the operands of the first equation, then the new operand of each later one."""
    equations, _ = parse_solution(problem.solution)
    operators = tuple(re.findall(r"(?<=\d)[-+*]", expr)[0] for expr, _ in equations)
    operands = [re.split(r"(?<=\d)[-+*]", expr) for expr, _ in equations]
    numbers = [int(n) for n in operands[0]] + [int(ops[1]) for ops in operands[1:]]
    return (KINDS[operators], *numbers)


# ---------------------------------------------------------------------------- the safe parser


def test_evaluate_helper_respects_precedence_and_rejects_code():
    assert evaluate("3*4+5") == 17
    assert evaluate("6-7") == -1
    assert evaluate("2+3*4-1") == 13
    with pytest.raises(ValueError):
        evaluate("__import__('os')")


# ---------------------------------------------------------------------------- the generator


def test_problems_are_reproducible_from_seed():
    assert problems("train", 50, seed=3) == problems("train", 50, seed=3)
    assert problems("test", 20, seed=3) == problems("test", 20, seed=3)


def test_problems_differ_between_seeds():
    assert problems("train", 50, seed=3) != problems("train", 50, seed=4)


def test_problems_reject_an_unknown_split():
    with pytest.raises(ValueError, match="split"):
        problems("validation", 1, seed=0)


def test_problems_cover_every_kind(train_problems):
    assert {arithmetic_of(p)[0] for p in train_problems} == set(KINDS.values())


def test_train_and_test_share_no_question(train_problems, test_problems):
    assert not {p.question for p in train_problems} & {p.question for p in test_problems}


def test_split_membership_follows_the_held_out_hash(train_problems, test_problems):
    assert not any(is_held_out(p.question) for p in train_problems)
    assert all(is_held_out(p.question) for p in test_problems)


def test_solutions_end_with_the_answer_line(train_problems, test_problems):
    for problem in train_problems + test_problems:
        equations, final = parse_solution(problem.solution)
        assert final == problem.answer
        assert equations[-1][1] == int(problem.answer)


def test_solution_equations_are_arithmetically_right(train_problems, test_problems):
    for problem in train_problems + test_problems:
        equations, _ = parse_solution(problem.solution)
        assert 1 <= len(equations) <= 3
        for expression, value in equations:
            assert evaluate(expression) == value, problem.solution


def test_solution_steps_chain(train_problems):
    """Each step starts from the previous step's result."""
    for problem in train_problems:
        equations, _ = parse_solution(problem.solution)
        for (_, previous), (expression, _) in zip(equations, equations[1:], strict=False):
            assert expression.startswith(str(previous)), problem.solution


def test_solution_numbers_appear_in_the_question(train_problems):
    for problem in train_problems:
        given = set(re.findall(r"\d+", problem.question))
        assert {str(n) for n in arithmetic_of(problem)[1:]} <= given, problem


# ---------------------------------------------------------------------------- the verifier


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("12+7=19\n19-5=14\n#### 14", "14", True),
        ("I think 3, no wait, it is 5", "5", True),
        ("I think 3, no wait, it is 5", "3", False),  # the last number wins
        ("#### 1,234", "1234", True),
        ("The total is 1,234 pens.", "1234", True),
        ("It costs $5.", "5", True),
        ("It costs $5.", "$5", True),
        ("3.50", "3.5", True),
        ("3.5", "3.50", True),
        (".5", "0.5", True),
        ("#### -4", "-4", True),
        ("#### 4", "-4", False),
        ("#### -4", "4", False),
        ("#### 14.", "14", True),  # a full stop after the answer is punctuation
        ("I have no idea", "14", False),
        ("", "0", False),
        ("#### 13", "14", False),
    ],
)
def test_is_correct(completion, answer, expected):
    assert is_correct(completion, answer) is expected


def test_last_number_reward_takes_the_answer_column_and_returns_floats():
    rewards = last_number_reward(
        ["Q1\n", "Q2\n", "Q3\n"],
        ["#### 14", "#### 13", "no number"],
        answer=["14", "14", "14"],
        other_column=[1, 2, 3],  # tasks pass every column of the row
    )
    assert rewards == [1.0, 0.0, 0.0]
    assert all(type(r) is float for r in rewards)


def test_verifier_never_evaluates_text_as_code(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the verifier ran code")

    completions = ["__import__('os').system('x')", "2+2", "__import__('os').system('x') 7"]
    with monkeypatch.context() as patch:
        patch.setattr(os, "system", forbidden)
        patch.setattr(builtins, "eval", forbidden)
        patch.setattr(builtins, "exec", forbidden)
        patch.setattr(builtins, "__import__", forbidden)
        rewards = last_number_reward(["Q\n"] * 3, completions, answer=["0", "4", "7"])
    assert rewards == [0.0, 0.0, 1.0]  # '2+2' is text whose last number is 2, not 4


# ----------------------------------------------------------------------------- math_task


def test_math_task_rows_have_prompt_and_answer():
    task = math_task(num_train=6, num_eval=4, seed=0)
    assert task.name == "math"
    assert len(task.train_rows) == 6 and len(task.eval_rows) == 4
    for row in task.train_rows + task.eval_rows:
        assert isinstance(row["prompt"], str) and row["prompt"].endswith("\n")
        assert isinstance(row["answer"], str)
    expected = problems("train", 6, seed=0)
    assert [r["prompt"] for r in task.train_rows] == [format_prompt(p.question) for p in expected]
    assert [r["answer"] for r in task.train_rows] == [p.answer for p in expected]


def test_math_task_rewards_score_their_own_rows():
    task = math_task(num_train=3, num_eval=1, seed=0)
    rows = task.train_rows
    prompts = [r["prompt"] for r in rows]
    completions = [f"#### {r['answer']}" for r in rows]
    columns = {"answer": [r["answer"] for r in rows]}
    for reward_fn in task.reward_fns:
        assert reward_fn(prompts, completions, **columns) == [1.0] * 3
    assert task.correct_fn(prompts, completions, **columns) == [1.0] * 3


def test_stopped_early_drops_the_last_step_of_three_step_solutions(train_problems):
    three_step = [p for p in train_problems if p.solution.count("=") == 3]
    shorter = [p for p in train_problems if p.solution.count("=") < 3]
    assert three_step and shorter
    for problem in three_step:
        sloppy = stopped_early(problem)
        equations, final = parse_solution(sloppy)
        assert len(equations) == 2
        assert equations == parse_solution(problem.solution)[0][:2]
        assert final == str(equations[-1][1])
        assert not is_correct(sloppy, problem.answer)  # the last step always changes the result
    assert all(stopped_early(p) == p.solution for p in shorter)
