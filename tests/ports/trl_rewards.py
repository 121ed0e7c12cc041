"""Offline stand-ins for `trl.rewards` (whose checks need `math_verify`): the same signatures and
the same contract, None for a row whose solution does not parse, with the answer checked by a
plain comparison of the last number instead. Imported by the port scripts of both frameworks."""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _last_number(text: str) -> str | None:
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def accuracy_reward(completions, solution, log_extra=None, **kwargs):
    """1.0 when the completion's last number is the solution's, 0.0 when not, None when the
    solution has no number (as TRL's: a gold answer that does not parse skips the row)."""
    rewards = []
    for completion, gold in zip(completions, solution):
        content = completion[0]["content"] if isinstance(completion, list) else completion
        expected = _last_number(str(gold))
        rewards.append(None if expected is None else float(_last_number(content) == expected))
    if log_extra is not None:
        log_extra("solution", list(solution))
    return rewards


def reasoning_accuracy_reward(completions, solution, reasoning_delimiters=None, log_extra=None,
                              **kwargs):
    """accuracy_reward on what follows the reasoning (after `</think>`); 0.0 while the reasoning
    is not closed."""
    delimiters = reasoning_delimiters or ["</think>"]
    answers = []
    for completion in completions:
        content = completion[0]["content"] if isinstance(completion, list) else completion
        cut = next((content.split(d, 1)[1] for d in delimiters if d in content), None)
        answers.append(cut)
    rewards = accuracy_reward([a or "" for a in answers], solution, log_extra=log_extra)
    return [0.0 if a is None and r is not None else r for a, r in zip(answers, rewards)]
