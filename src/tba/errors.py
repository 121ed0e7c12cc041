"""Errors that end a run with one line for the user, kept free of heavy imports (and of every other
tba module) so that any module can raise them and the CLI can catch them cheaply: bad input exits
with status 2, a run that cannot go on with status 1."""


class ConfigError(ValueError):
    """A bad configuration value, file or override; the message is one line meant for users."""


class DatasetError(ConfigError):
    """A dataset that cannot be read, or a row without a field the task needs (one line)."""


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
