"""Your own reward function and dataset, the way a TRL GRPO script writes them.

The dataset here is made of the embedded arithmetic problems, so that the example runs anywhere
on the tiny built-in policy; with your own, swap `load_rows` for `datasets.load_dataset(...)`
and `model` for a Hub id. Run: python examples/custom_reward.py --max-steps 50
"""

import argparse
import re

from tba import TBAConfig, TBATrainer
from tba.tasks.math.world import format_prompt, problems


def correctness(prompts, completions, answer, **kwargs):
    """1 when the last number of the completion is the gold answer (GSM8K style)."""
    rewards = []
    for completion, gold in zip(completions, answer):
        numbers = re.findall(r"-?\d+(?:\.\d+)?", completion.replace(",", ""))
        rewards.append(1.0 if numbers and float(numbers[-1]) == float(gold) else 0.0)
    return rewards


def load_rows(split: str, count: int) -> list[dict]:
    return [{"prompt": format_prompt(p.question), "answer": p.answer}
            for p in problems(split, count, seed=0)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--output-dir", default="runs/custom_reward")
    parser.add_argument("overrides", nargs="*", help="key=value settings, as for `tba train`")
    args = parser.parse_args()
    config = TBAConfig.from_overrides([f"train.max_steps={args.max_steps}",
                                       f"output_dir={args.output_dir}", *args.overrides])
    trainer = TBATrainer(
        model="builtin:math",
        reward_funcs=correctness,
        train_dataset=load_rows("train", 2000),
        eval_dataset=load_rows("test", 128),
        eval_func=correctness,
        args=config,
    )
    results = trainer.train(overwrite=True)
    print(f"pass@1 {results['base']['eval_pass@1']:.3f} -> {results['final']['eval_pass@1']:.3f}"
          f" in {results['run_dir']}")


if __name__ == "__main__":
    main()
