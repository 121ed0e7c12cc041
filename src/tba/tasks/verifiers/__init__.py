"""Answer checks, one module per answer format: `last_number` (the embedded math task's),
`gsm8k` (a `#### 42` answer line) and `boxed` (MATH's `\\boxed{}`). Each has
`is_correct(completion, gold)` and a reward function of TRL's shape."""
