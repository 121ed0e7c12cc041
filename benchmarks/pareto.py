"""Win rate against closeness to the reference policy on the embedded summarisation task: the
Pareto fronts of TB and of the baselines across beta, over several seeds.

Every run starts from the world's SFT policy with the task's defaults (`task.name=summarize`)
and trains for `--minutes`; its final policy is scored afterwards on the same held-out posts
(greedy summaries judged against the references by the gold judge; KL(pi || pi_ref) per token
and the reference perplexity on sampled summaries; `tba.tasks.preference`). Each run is one
point (KL or reference perplexity, win rate); a method's runs across beta trace its front.

Methods, each at every beta of `--betas` and with the paper's anneal 1 -> 0.05 (`anneal`):
    tb             TB, asynchronous, the paper's TL;DR settings (the task's defaults): k = 10
                   optimizer steps between weight syncs, m = 0.5 of the groups fresh, the rest
                   replayed by reward (softmax(r / T))
    online_dpo     Online DPO (beta: the DPO temperature); `online_dpo_low_lr` at a fifth of
                   the learning rate
    rloo           RLOO on the KL-shaped reward r - beta * KL
    proximal_rloo  RLOO with a clipped ratio to the behaviour policy
The baselines run on the same asynchronous pipeline with k = 10, learning from the freshest
samples (m = 1, replay uniform), as methods that expect on-policy data would.

    python -m benchmarks.pareto              # 4 methods x 5 betas x 3 seeds x 5 min: ~6 hours
    python -m benchmarks.pareto --only tb,rloo --betas 0.1,0.3 --seeds 1 --minutes 3
    python -m benchmarks.pareto --report runs/pareto runs/pareto_more --x perplexity

The plot goes to `--plot` (default docs/pareto.png); the Markdown table is printed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import Method, add_common_arguments, finish, merge_results, run_suite
from tba.plots import ErrorSeries, colors, plot_error_series
from tba.quiet import quiet_libraries

BASELINE_DATA = ["buffer.recent_prob=1.0", "buffer.reward_weight=0.0"]
LOSSES = {
    "tb": ("TB (async, k = 10, m = 0.5, reward replay)", []),
    "online_dpo": ("Online DPO (async, k = 10)", ["train.loss=online_dpo", *BASELINE_DATA]),
    # At TB's learning rate Online DPO leaves the SFT policy far behind within a minute: a
    # fifth of it puts its points where TB's are, so that the fronts meet at equal KL.
    "online_dpo_low_lr": ("Online DPO (async, k = 10, lr 2e-5)",
                          ["train.loss=online_dpo", "train.learning_rate=2e-5", *BASELINE_DATA]),
    "rloo": ("RLOO (async, k = 10)", ["train.loss=rloo", *BASELINE_DATA]),
    "proximal_rloo": ("Proximal RLOO (async, k = 10)",
                      ["train.loss=proximal_rloo", *BASELINE_DATA]),
}  # fmt: skip
ANNEAL = ("anneal", ["train.beta=1.0", "train.beta_end=0.05"])
AXES = {"kl": "eval_kl", "perplexity": "eval_ref_perplexity"}  # --x: the closeness metric
AXIS_LABELS = {"eval_kl": "KL(π ‖ π_ref) per token",
               "eval_ref_perplexity": "perplexity of the responses under π_ref"}  # fmt: skip


def methods(betas: list[float]) -> dict[str, Method]:
    """Every loss at every beta, and with the anneal: `<loss>@<beta>` / `<loss>@anneal`."""
    settings = [(f"{beta:g}", [f"train.beta={beta}"]) for beta in betas] + [ANNEAL]
    return {
        f"{loss}@{name}": Method(f"{label}, beta {name}", [*extra, *overrides])
        for loss, (label, extra) in LOSSES.items()
        for name, overrides in settings
    }


def final_metrics(entry: dict, key: str) -> np.ndarray:
    """`key` of each seed's final policy (the last point of its curve)."""
    return np.array([run["curve"][-1]["metrics"][key] for run in entry["runs"].values()])


def sft_metrics(results: dict) -> dict[str, float]:
    """The starting policy's metrics (minute 0 of any run: every run starts from it)."""
    first = next(iter(results.values()))
    return first["runs"][next(iter(first["runs"]))]["curve"][0]["metrics"]


def final_points(results: dict, metric: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per method@beta: the (closeness, win rate) of each seed's final policy."""
    return {name: (final_metrics(entry, metric), final_metrics(entry, "eval_win_rate"))
            for name, entry in results.items()}  # fmt: skip


def _spread(values: np.ndarray) -> float:
    return float(values.std(ddof=1)) if len(values) > 1 else 0.0


def print_pareto_table(results: dict, points: dict, metric: str) -> None:
    print(f"\n| method | beta | seeds | win rate | {AXIS_LABELS[metric]} | gold | proxy reward |")
    print("|---|---|---|---|---|---|---|")
    for name, (x, y) in points.items():
        loss, beta = name.split("@")
        gold = final_metrics(results[name], "eval_gold")
        proxy = final_metrics(results[name], "eval_proxy_reward")
        print(f"| {LOSSES[loss][0]} | {beta} | {len(y)} | {y.mean():.1%} ± {_spread(y):.1%} | "
              f"{x.mean():.3f} ± {_spread(x):.3f} | {gold.mean():.2f} | {proxy.mean():.2f} |")
    base = sft_metrics(results)
    print(f"| SFT policy (before training) | - | - | {base['eval_win_rate']:.1%} | "
          f"{base[metric]:.3f} | {base['eval_gold']:.2f} | {base['eval_proxy_reward']:.2f} |")


def plot_fronts(results: dict, points: dict, metric: str, path: Path) -> None:
    """x = closeness, y = win rate; one line per method through its betas (sorted by x), the
    anneal as a star; error bars: one standard deviation over seeds on both axes."""
    series = []
    for loss, color in zip(LOSSES, colors(len(LOSSES))):
        constant = sorted(
            (x.mean(), y.mean(), _spread(x), _spread(y))
            for name, (x, y) in points.items()
            if name.startswith(f"{loss}@") and not name.endswith("@anneal")
        )
        if constant:
            series.append(ErrorSeries(LOSSES[loss][0], constant, color=color, marker="o"))
        if f"{loss}@anneal" in points:
            x, y = points[f"{loss}@anneal"]
            series.append(ErrorSeries(
                f"{LOSSES[loss][0].split(' (')[0]}, beta 1 -> 0.05",
                [(x.mean(), y.mean(), _spread(x), _spread(y))],
                color=color, marker="*", line=False,
            ))  # fmt: skip
    base = sft_metrics(results)
    plot_error_series(
        series, path, xlabel=AXIS_LABELS[metric],
        ylabel="win rate against the references (gold judge)",
        reference=("SFT", base[metric], base["eval_win_rate"]),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, minutes=5.0, out="runs/pareto")
    parser.add_argument("--betas", default="0.05,0.1,0.3,1", help="comma-separated constants")
    parser.add_argument("--x", choices=list(AXES), default="kl", help="the closeness axis")
    parser.add_argument("--plot", type=Path, default=Path("docs/pareto.png"))
    parser.set_defaults(num_eval=512, target=0.7, snapshot_minutes=2.5)
    args = parser.parse_args()
    args.overrides = ["task.name=summarize", *args.overrides]  # every run, and the base policy
    torch.set_num_threads(2)
    quiet_libraries()
    if args.report:
        results = merge_results(args.report)
    else:
        chosen = methods([float(b) for b in args.betas.split(",")])
        if args.only:  # method names (`tb`) or method@beta names (`tb@0.1`)
            wanted = args.only.split(",")
            chosen = {name: m for name, m in chosen.items()
                      if name in wanted or name.split("@")[0] in wanted}  # fmt: skip
        results = {name: entry for name, entry in run_suite(chosen, args).items()
                   if name in chosen}  # fmt: skip
    finish(results, args, "summarize: win rate over training", metric="win rate")
    metric = AXES[args.x]
    points = final_points(results, metric)
    plot_fronts(results, points, metric, args.plot)
    print_pareto_table(results, points, metric)
    print(f"\nfronts plotted to {args.plot}")


if __name__ == "__main__":
    main()
