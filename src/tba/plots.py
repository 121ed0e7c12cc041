"""Every plot tba draws, against wall-clock time first: a run's own curves (`curves.png`), several
runs on one figure (`tba plot`), and the benchmarks' figures (mean curves with a band over seeds,
fronts with error bars). Figures are drawn with matplotlib's object API and written to files,
never shown: no backend or other global state of the caller's matplotlib changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from tba.errors import ConfigError
from tba.run_dir import headline_metric, read_metrics, samples_consumed

METRIC_LABELS = {
    "eval_pass@1": "held-out greedy pass@1", "eval_asr": "attack success rate",
    "eval_diversity": "attack diversity", "eval_win_rate": "win rate (gold judge)",
}  # fmt: skip
X_AXES = {
    "minutes": "wall-clock minutes of training", "steps": "optimizer steps",
    "samples": "fresh samples consumed",
}  # fmt: skip


def metric_label(name: str) -> str:
    return METRIC_LABELS.get(name, name.removeprefix("eval_").replace("_", " "))


def colors(count: int) -> tuple:
    return matplotlib.colormaps["tab20" if count > 10 else "tab10"].colors


def metric_curve(records: list[dict], metric: str, x: str = "minutes") -> tuple[list, list]:
    """(x, value) of every record that holds `metric`, x in `X_AXES`."""
    totals = samples_consumed(records)
    points = [(record, total) for record, total in zip(records, totals) if metric in record]
    xs = {"minutes": [r["time"] / 60 for r, _ in points], "steps": [r["step"] for r, _ in points],
          "samples": [total for _, total in points]}[x]  # fmt: skip
    return xs, [r[metric] for r, _ in points]


# ------------------------------------------------------------------------------ one run


def plot_curves(
    records: list[dict], path: Path, title: str = "", metrics: tuple[str, ...] = ("eval_pass@1",)
) -> None:
    """The held-out `metrics` (greedy pass@1 by default) and the reward of new samples against
    wall-clock minutes; below, how stale the trained samples were (optimizer steps since their
    weights were published)."""
    steps = [r for r in records if "reward_mean" in r]
    fig = Figure(figsize=(7, 6), dpi=110)
    ax, lag = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for name, color in zip(metrics, ("tab:blue", "tab:green", "tab:purple", "tab:brown")):
        ax.plot(*metric_curve(records, name), "o-", color=color, label=metric_label(name))
    ax.set_ylabel("held-out metric")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    # The reward of the samples that arrived at each step, on its own axis (rewards may be log
    # probabilities): what the searchers' policy scores; a batch's own mean mixes in replay.
    minutes = [r["time"] / 60 for r in steps]
    reward_axis = ax.twinx()
    arrived = [r for r in steps if r.get("samples_in")]
    if arrived:
        reward_axis.plot([r["time"] / 60 for r in arrived],
                         _moving_average([r["reward_in"] for r in arrived], 25), color="tab:orange",
                         label="reward of new samples (25-step average)")  # fmt: skip
    else:
        reward_axis.plot(minutes, _moving_average([r["reward_mean"] for r in steps], 25),
                         color="tab:orange",
                         label="batch mean reward (25-step average)")  # fmt: skip
    reward_axis.set_ylabel("reward", color="tab:orange")
    lines = ax.get_legend_handles_labels()
    more = reward_axis.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    staleness = [r.get("staleness_steps_mean", 0.0) for r in steps]
    lag.plot(minutes, [r.get("staleness_steps_max", 0.0) for r in steps], color="tab:red",
             alpha=0.3, linewidth=0.8, label="max in the batch")  # fmt: skip
    lag.plot(minutes, _moving_average(staleness, 25), color="tab:red",
             label="batch mean (25-step average)")  # fmt: skip
    lag.set_xlabel("wall-clock minutes")
    lag.set_ylabel("staleness (steps)")
    lag.grid(alpha=0.3)
    lag.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return [
        (sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window)
        for i in range(len(values))
    ]


# ----------------------------------------------------------------------------- several runs


def plot_runs(
    runs: dict[str, list[dict]], path: Path, metrics: Sequence[str], x: str = "minutes"
) -> None:
    """The held-out `metrics` of several runs (label -> metric records), one panel per metric,
    one line per run, against `x` (minutes, steps or samples); saved with the whole legend."""
    runs_figure(runs, metrics, x).savefig(path, bbox_inches="tight")


# Markers, one a round of the colors: runs beyond the palette's colors keep apart.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LEGEND_FONT = 7  # points


def runs_figure(runs: dict[str, list[dict]], metrics: Sequence[str], x: str = "minutes") -> Figure:
    """`plot_runs`'s figure. The legend, one entry per run, stands right of the panels, in as
    many columns as its entries need to fit the figure's height: a panel's own legend hid its
    curves, and one of 50 runs ran off the figure (saved with `bbox_inches="tight"`, the figure
    grows to hold it)."""
    height = 1 + 3.2 * len(metrics)
    fig = Figure(figsize=(7, height), dpi=110)
    axes = fig.subplots(len(metrics), 1, sharex=True, squeeze=False)
    palette = colors(len(runs))
    styles = {label: (palette[i % len(palette)], MARKERS[i // len(palette) % len(MARKERS)])
              for i, label in enumerate(runs)}  # fmt: skip
    for ax, metric in zip(axes[:, 0], metrics):
        for label, records in runs.items():
            xs, values = metric_curve(records, metric, x)
            if values:
                color, marker = styles[label]
                ax.plot(xs, values, "-", marker=marker, markersize=3, color=color, label=label)
        ax.set_ylabel(metric_label(metric))
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(X_AXES[x])
    fig.tight_layout()
    entries = {label: handle for ax in axes[:, 0]
               for handle, label in zip(*ax.get_legend_handles_labels())}  # fmt: skip
    rows = max(1, int(height * 72 / (LEGEND_FONT * 1.9)))  # entries a column holds
    fig.legend(entries.values(), entries.keys(), loc="upper left", fontsize=LEGEND_FONT,
               bbox_to_anchor=(1.0, 1.0), bbox_transform=axes[0, 0].transAxes,
               ncols=max(1, math.ceil(len(entries) / rows)))  # fmt: skip
    return fig


def plot_run_dirs(
    run_dirs: Sequence[Path], path: Path, metrics: Sequence[str] = (), x: str = "minutes"
) -> list[str]:
    """`tba plot`: `plot_runs` of these run directories, labelled by their names (by their paths
    when names repeat); `metrics` default to each run's headline one. Returns the metrics drawn."""
    names = [run_dir.resolve().name for run_dir in run_dirs]
    labels = names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
    runs = {}
    for label, run_dir in zip(labels, run_dirs):
        if not (run_dir / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{run_dir}: no run there (metrics.jsonl not found)")
        runs[label] = read_metrics(run_dir / "metrics.jsonl")
    recorded = {key for records in runs.values() for record in records for key in record}
    if metrics:
        metrics = [_recorded_name(name, recorded) for name in metrics]
    else:
        metrics = list(dict.fromkeys(filter(None, map(headline_metric, runs.values()))))
        if not metrics:
            raise ConfigError("these runs have no held-out evaluation in their metrics.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_runs(runs, path, metrics, x)
    return metrics


def _recorded_name(name: str, recorded: set[str]) -> str:
    """`name` as the runs record it: as given, or with the `eval_` prefix of held-out metrics."""
    for candidate in (name, f"eval_{name}"):
        if candidate in recorded:
            return candidate
    held_out = sorted(key for key in recorded if key.startswith("eval_") or "pass@" in key)
    raise ConfigError(f"--metric {name}: no run recorded it (held-out metrics recorded: "
                      f"{', '.join(held_out) or 'none'})")  # fmt: skip


# ------------------------------------------------------------------------ over seeds


@dataclass
class Band:
    """One method over several seeds: the mean of a metric and its standard deviation, at each
    point of a grid of minutes, with the mean fresh samples consumed by then."""

    label: str
    minutes: np.ndarray
    samples: np.ndarray
    mean: np.ndarray
    std: np.ndarray


def plot_bands(
    bands: Sequence[Band], path: Path, *, target: float | None = None, title: str = "",
    ylabel: str = "held-out greedy pass@1",
) -> None:  # fmt: skip
    """The mean curves with a band of ± one standard deviation over seeds, against wall-clock
    minutes (left) and against fresh samples consumed (right)."""
    fig = Figure(figsize=(12, 4.5))
    by_time, by_samples = fig.subplots(1, 2, sharey=True)
    for band, color in zip(bands, colors(len(bands))):
        for ax, x in ((by_time, band.minutes), (by_samples, band.samples / 1000)):
            ax.plot(x, band.mean, marker="o", markersize=2.5, color=color, label=band.label)
            ax.fill_between(x, band.mean - band.std, band.mean + band.std, color=color, alpha=0.15)
    for ax in (by_time, by_samples):
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", label="target")
        ax.grid(alpha=0.3)
    by_time.set_xlabel("wall-clock minutes of training")
    by_samples.set_xlabel("fresh samples consumed (thousands)")
    by_time.set_ylabel(f"{ylabel} (mean ± std over seeds)")
    by_time.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@dataclass
class ErrorSeries:
    """Points with one standard deviation on both axes: (x, y, x_err, y_err) each, drawn joined
    in order (`line`) or as lone markers; series of one method share a `color`."""

    label: str
    points: list[tuple[float, float, float, float]]
    color: tuple | str | None = None
    marker: str = "o"
    line: bool = True


def plot_error_series(
    series: Sequence[ErrorSeries], path: Path, *, xlabel: str, ylabel: str,
    reference: tuple[str, float, float] | None = None,
) -> None:  # fmt: skip
    """Series of points with error bars on both axes (e.g. reward/KL fronts, one series per
    method); `reference`: (label, x, y) of a point drawn as a black square (e.g. the start)."""
    fig = Figure(figsize=(7, 5))
    ax = fig.subplots()
    for one in series:
        xs, ys, xerr, yerr = map(np.array, zip(*one.points))
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, marker=one.marker, capsize=3, color=one.color,
                    linestyle="-" if one.line else "none", label=one.label,
                    markersize=12 if one.marker == "*" else 6)  # fmt: skip
    if reference is not None:
        label, x, y = reference
        ax.scatter([x], [y], color="black", marker="s", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
