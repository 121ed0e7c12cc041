"""When a run evaluates its policy on held-out prompts on the way (`EvalSchedule`): every
`eval.every` optimizer steps; or every `eval.every_minutes` of training; or, with `auto` (the
default), as often as that costs at most about a tenth of the run, whatever the model.

A fixed `eval.every_minutes` evaluates at the first step that ends after each multiple of it: a
run of a given length is evaluated as often on a CPU as on a GPU, however long its steps. That
suits a model whose evaluation takes a second or two (the embedded tiny policy's), not one whose
evaluation takes a minute (SmolLM2-135M on two CPU cores), which would spend most of its run
evaluating. `auto` keeps the marks of a fixed `AUTO_EVAL_MINUTES` but skips those that come
sooner than `AUTO_EVAL_TRAINING_PER_SECOND` times as long as the last evaluation took after its
end: the tiny policy is evaluated every half minute as before, SmolLM2 every ten minutes or so.
The first evaluation on the way is timed by the base policy's, which also samples pass@k
(`greedy_share` scales it to what an evaluation on the way repeats).
"""

from __future__ import annotations

from tba.config import RunConfig
from tba.core import Task

AUTO_EVAL_MINUTES = 0.5
AUTO_EVAL_TRAINING_PER_SECOND = 9  # seconds of training per second of evaluation, at least


def next_eval_time(now: float, every: float, last_seconds: float = 0.0) -> float:
    """When the next held-out evaluation is due, in seconds of training: the first multiple of
    `every` after `now`, and after `AUTO_EVAL_TRAINING_PER_SECOND` times `last_seconds` (the
    last evaluation's time, which `auto` counts; 0: a fixed interval) more."""
    earliest = now + AUTO_EVAL_TRAINING_PER_SECOND * last_seconds
    return (earliest // every + 1) * every


def greedy_share(task: Task, config: RunConfig) -> float:
    """The share of the base policy's evaluation that an evaluation on the way repeats: its
    greedy pass@1, without the sampled pass@k (`tba.evaluation.evaluate`), counted in generated
    completions; all of it for a task's own evaluation (`Task.evaluate`)."""
    if task.evaluate is not None:
        return 1.0
    greedy = len(task.eval_rows)
    sampled = min(config.task.num_eval_pass_k, greedy) * config.eval.pass_k
    return greedy / max(greedy + sampled, 1)


class EvalSchedule:
    """When held-out evaluations on the way are due: every `eval.every` steps when that is set;
    else at `next` (seconds of training; None: only at the start and the end), the first step
    that ends after it, `next` then moved on by the rule of the module docstring. A run's
    checkpoint keeps `next` (`tba.loop.TrainLoop.state_dict`). `base_seconds`: how long the base
    policy's evaluation took (None: not this process's, for a resumed run)."""

    def __init__(self, config: RunConfig, task: Task, base_seconds: float | None) -> None:
        self.steps = config.eval.every
        minutes = config.eval.every_minutes
        self.auto = minutes == "auto" and self.steps is None
        minutes = AUTO_EVAL_MINUTES if minutes == "auto" else minutes
        # Steps, when given, replace minutes (the paper's configs count evaluations in steps).
        self.every = minutes * 60 if minutes and self.steps is None else None
        self.next = self.every
        # `auto`: what an evaluation on the way should take, by the base policy's.
        self.estimate = (base_seconds * greedy_share(task, config)
                         if self.auto and base_seconds is not None else None)  # fmt: skip
        if self.estimate is not None:
            self.next = next_eval_time(0.0, self.every, self.estimate)

    def due(self, step: int, elapsed: float) -> bool:
        """Whether step `step`, which ended `elapsed` seconds into training, is followed by an
        evaluation; the next is then a whole interval on, however long this step was."""
        if self.steps is not None:
            return step % self.steps == 0
        if self.next is None or elapsed < self.next:
            return False
        self.next = next_eval_time(elapsed, self.every)
        return True

    def evaluated(self, elapsed: float, seconds: float) -> None:
        """An evaluation took `seconds` and ended `elapsed` seconds into training: with `auto`,
        the next comes no sooner than `AUTO_EVAL_TRAINING_PER_SECOND` times as long after it."""
        if self.auto:
            self.next = next_eval_time(elapsed, self.every, seconds)

    def line(self) -> str | None:
        """With `auto`, the line that says at the start of a run when it evaluates."""
        if not self.auto or self.next is None:  # None: resumed from a run that did not evaluate
            return None  # on the way, which this one goes on without
        rule = (f"eval.every_minutes=auto: {AUTO_EVAL_MINUTES:g} min, or "
                f"{AUTO_EVAL_TRAINING_PER_SECOND}x as long as an evaluation takes when that is "
                "longer")  # fmt: skip
        if self.estimate is None:  # resumed: its checkpoint says when
            return f"held-out evaluation next at {self.next / 60:g} min of training ({rule})"
        return (f"held-out evaluation every {self.next / 60:g} min ({rule}; one takes about "
                f"{self.estimate:.1f} s, by the base policy's)")  # fmt: skip
