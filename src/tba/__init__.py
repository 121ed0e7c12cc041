"""tba: Trajectory Balance with Asynchrony, fast off-policy RL post-training of language models.

Building blocks: `tba.tasks` (prompts and rewards), `tba.policy` (models, sampling, log-probs),
`tba.objectives` (losses as pure functions), `tba.buffer` (replay buffer), `tba.searcher`,
`tba.trainer`, and `tba.training` which wires them for `tba train`. `TBATrainer` and `TBAConfig`
(`tba.api`) are the TRL-shaped entry point for your own data and reward functions.
"""

__version__ = "0.1.0"
__all__ = ["TBAConfig", "TBATrainer"]


def __getattr__(name: str):
    """`from tba import TBATrainer` without importing torch for every `import tba`."""
    if name in __all__:
        from tba import api

        return getattr(api, name)
    raise AttributeError(f"module 'tba' has no attribute {name!r}")
