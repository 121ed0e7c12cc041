"""tba: Trajectory Balance with Asynchrony, fast off-policy RL post-training of language models.

Building blocks: `tba.tasks` (prompts and rewards), `tba.policy` (models, sampling, log-probs),
`tba.objectives` (losses as pure functions), `tba.buffer` (replay buffer), `tba.searcher`,
`tba.trainer`, and `tba.run` which wires them for `tba train`.
"""

__version__ = "0.1.0"
