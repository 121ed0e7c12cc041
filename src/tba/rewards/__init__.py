"""Rewards: calling the user's reward functions without letting one bad call cost the run
(`scorer`), reward models and classifiers read at the last token (`models`), and how the
embedded worlds train theirs (`training`)."""
