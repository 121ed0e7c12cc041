"""Preference tuning of summaries (`task.name=summarize`): the embedded world (`world`: posts,
careless references, the gold judge), the task (`task`) and the world's models (`build`: the SFT
summariser and its proxy reward model)."""
