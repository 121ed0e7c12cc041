"""The embedded math task: its world (synthetic word problems, `world`), the task made of it
(`task`) and the built-in base policy, pretrained on part of it (`build`)."""
