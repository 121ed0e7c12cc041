"""Errors that end a run with one line for the user, kept free of heavy imports so that the CLI
can catch them cheaply: bad input exits with status 2, a run that cannot go on with status 1."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or does not fit this run (bad input)."""


class RunError(RuntimeError):
    """A run cannot go on; the message says what failed and why."""


class SearcherError(RunError):
    """A searcher failed in a way the run cannot recover from."""


class RewardError(RunError):
    """A reward function failed on every one of its last calls."""


class TrainingError(RunError):
    """Training itself cannot go on (e.g. non-finite losses step after step)."""
