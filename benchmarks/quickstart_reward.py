"""TRL's quickstart reward, alone in its file: `tba train` names it by path
(`task.reward_funcs=['benchmarks/quickstart_reward.py:reward_len']`), which sends it to the
searcher processes by value, and the TRL runs and the held-out scoring import the same function.
It imports nothing, so nothing else travels with it."""


def reward_len(completions, **kwargs):
    """Completions close to 20 characters, as TRL's quickstart writes its reward for a
    conversational dataset (each completion a list of one assistant message)."""
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]
