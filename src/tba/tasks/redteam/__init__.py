"""Automated red-teaming (`task.name=redteam`): the embedded world (`world`: a grammar of
instructions, a victim with hidden vulnerable modes), the task (`task`: the judge, the reward,
held-out attack metrics) and the world's models (`build`)."""
