"""The `tba` command line.

    tba train [CONFIG.yaml] [key=value ...]     train (default: the embedded math task)
    tba train --resume RUN_DIR [key=value ...]  continue a run from its newest checkpoint
    tba train --overwrite ...                   replace the run in output_dir
    tba eval RUN_DIR [key=value ...]            score the run's final policy on the held-out set
                                                (RUN_DIR/eval_final.json)
    tba eval --snapshots RUN_DIR [key=value ...]  score its base policy and every snapshot
                                                (RUN_DIR/eval_snapshots.json)
    tba eval ... --trust-code, tba train --resume ... --trust-code
                                                import the code the run's config names though
                                                the run did not record it (`tba.trust`)
    tba plot RUN_DIR [RUN_DIR ...] [--out FILE] [--metric NAME] [--x minutes|steps|samples]
                                                held-out curves of several runs on one figure
    tba pretrain [CONFIG.yaml] [key=value ...]  build the built-in base policy (cached; with
                                                task.name=redteam or summarize: its world)
    tba config [CONFIG.yaml] [key=value ...]    print the resolved configuration
    tba config --reference                      every setting, its default and meaning: the
                                                Markdown of docs/configuration.md
    tba config --trl                            TRL's GRPOConfig arguments and what they become
                                                (docs/trl.md)

`tba eval` overrides apply on top of the run's config.yaml (`task.num_eval=1024`,
`eval.batch_size=64`, ...): see `tba.offline_eval`. The code a run directory's config.yaml names
(`task.reward_funcs`, `task.eval_func`) is imported by `tba eval` and `tba train --resume` only as
this user's `tba train` recorded it there, or with `--trust-code` (`tba.trust`); a replacement
of the run that a kill cut short is settled before the run is read.

Bad input (unknown key, wrong type, out-of-range value, a device this machine lacks, missing or
malformed file, a checkpoint that does not fit, a run directory without a run, snapshots or the
metric asked for, an output directory that cannot be written or that another run is using, code
a run directory names that the run did not record, a Ray address in no form Ray joins) prints
one line naming the problem and exits with status 2; a run that cannot go on (a searcher that
cannot be kept running, a reward function failing call after call or on a whole held-out
evaluation, non-finite losses step after step, a write that fails, a Ray cluster where nothing
answers), status 1; Ctrl-C (SIGTERM) during training stops after the current step, saves the run
(checkpoint included) and exits with status 130 (143; SIGHUP, a closed terminal: 129); anywhere
else in a run (its start, the evaluations, the saves), or a second time, it stops the run at once
with one line saying what is kept and how to go on, and the same status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from rich.table import Table

from tba.config import ConfigError, RunConfig, dump_config, load_config, reference_page
from tba.console import plain_console
from tba.errors import CheckpointError, Interrupted, RunError
from tba.quiet import quiet_libraries
from tba.run_dir import (
    RunBusyError,
    check_writable,
    run_config,
    settle_interrupted_replacement,
    write_whole,
)
from tba.trl_args import reference_page as trl_reference_page

# The commands' own modules (training, scoring, plotting: transformers, peft, datasets,
# matplotlib, ~6 s to import) are imported by the command that needs them, so that `tba config`
# and a bad value answer in the time torch takes to import.


TRUST_CODE = ("(tba eval, tba train --resume) import the code the run directory's config.yaml "
              "names (task.reward_funcs, task.eval_func) though your own `tba train` did not "
              "record it there")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tba", description="Trajectory Balance with Asynchrony")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in [
        ("train", "train a policy with TB (default: the embedded math task)"),
        ("pretrain", "build the built-in base policy (task.name=redteam / summarize: its world)"),
        ("config", "print the resolved configuration"),
    ]:
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
        if name == "config":
            command.add_argument(
                "--reference", action="store_true",
                help="print every setting with its default and meaning (docs/configuration.md)",
            )  # fmt: skip
            command.add_argument(
                "--trl", action="store_true",
                help="print TRL's GRPOConfig arguments and what they become (docs/trl.md)",
            )  # fmt: skip
        if name == "train":
            command.add_argument(
                "--resume", metavar="RUN_DIR", type=Path,
                help="continue this run from its newest checkpoint; key=value overrides its "
                "config (e.g. train.max_steps)",
            )  # fmt: skip
            command.add_argument(
                "--overwrite", action="store_true", help="replace a run already in output_dir"
            )
            command.add_argument("--trust-code", action="store_true", help=TRUST_CODE)
    text = "score a run's final policy (or its snapshots) on the held-out set"
    command = commands.add_parser("eval", help=text, description=text)
    command.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    command.add_argument(
        "overrides", nargs="*", metavar="key=value",
        help="on top of the run's config.yaml, e.g. task.num_eval=1024",
    )  # fmt: skip
    command.add_argument(
        "--snapshots", action="store_true",
        help="score the base policy and every snapshot the run saved, each a point with its "
        "step and minutes",
    )  # fmt: skip
    command.add_argument("--trust-code", action="store_true", help=TRUST_CODE)
    text = "plot the held-out curves of several runs on one figure"
    command = commands.add_parser("plot", help=text, description=text)
    command.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    command.add_argument("--out", type=Path, default=Path("plot.png"),
                         help="the PNG to write (default: plot.png)")  # fmt: skip
    command.add_argument(
        "--metric", action="append", metavar="NAME",
        help="a metric of metrics.jsonl, e.g. eval_pass@1 or pass@1 (repeat for several "
        "panels; default: each run's headline held-out metric)",
    )  # fmt: skip
    command.add_argument("--x", choices=["minutes", "steps", "samples"], default="minutes",
                         help="wall-clock minutes of training, optimizer steps or fresh samples "
                         "consumed (default: minutes)")  # fmt: skip
    return parser


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The first argument is a config file when it names a YAML file or an existing path, or is
    not a `key=value` setting (a file without an extension, which may be missing); a setting's
    key without its value (`train.max_steps`) is neither."""
    if args and (args[0].endswith((".yaml", ".yml")) or _exists(args[0])
                 or "=" not in args[0]):  # fmt: skip
        if not _exists(args[0]) and _names_a_setting(args[0]):
            raise ConfigError(f"{args[0]} is a setting without a value: a setting is key=value "
                              f"(e.g. {args[0]}=VALUE)")  # fmt: skip
        return args[0], args[1:]
    return None, args


def _exists(arg: str) -> bool:
    """Whether `arg` names an existing path; False where it cannot be one (a name longer than
    the file system allows, a NUL byte), so that a long `key=value` reads as a setting."""
    try:
        return Path(arg).exists()
    except (OSError, ValueError):
        return False


def _names_a_setting(arg: str) -> bool:
    """Whether `arg` reads as a setting's key (`seed`, `train.max_steps`), not a file's name."""
    return not arg.endswith((".yaml", ".yml")) and arg.split(".")[0] in RunConfig.model_fields


def _resume_config(run_dir: Path, path: str | None, overrides: list[str]) -> tuple[Path, list[str]]:
    """A resumed run reads its own config.yaml; overrides still apply."""
    if path is not None:
        raise ConfigError(f"--resume uses {run_dir / 'config.yaml'}; give only key=value overrides")
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {run_dir}: no run there (config.yaml not found)")
    return run_dir / "config.yaml", [*overrides, f"output_dir={run_dir}"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; `key=value`s (or run directories) after a flag, which argparse leaves over
    (`tba eval RUN_DIR --snapshots task.num_eval=64`), join the others."""
    parser = _parser()
    options, extra = parser.parse_known_args(argv)
    if any(arg.startswith("-") for arg in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if options.command == "plot":
        options.run_dirs += [Path(arg) for arg in extra]
    else:
        getattr(options, "overrides" if options.command == "eval" else "args").extend(extra)
    return options


def main(argv: list[str] | None = None) -> int:
    options = _parse(argv)
    console = plain_console()
    try:
        if options.command == "eval":
            return _eval(options.run_dir, options.overrides, options.snapshots,
                         options.trust_code)  # fmt: skip
        if options.command == "plot":
            from tba.plots import plot_run_dirs

            check_writable(options.out, "the plot", "choose another --out, or fix its permissions")
            for run_dir in options.run_dirs:
                _settle(run_dir, console.log)
            drawn = plot_run_dirs(options.run_dirs, options.out, options.metric or (), options.x)
            print(f"{options.out} ({', '.join(drawn)} against {options.x})")
            return 0
        path, overrides = _split_args(options.args)
        resume = getattr(options, "resume", None)
        if resume is not None:
            # Before its config.yaml is read: a replacement a kill cut short leaves the killed
            # start's there, and the run itself in .replaced/.
            settle_interrupted_replacement(resume, console.log)
            path, overrides = _resume_config(resume, path, overrides)
        config = load_config(path, overrides)
        if options.command == "config":
            if options.trl:
                print(trl_reference_page(), end="")
            else:
                print(reference_page() if options.reference else dump_config(config), end="")
            return 0
        quiet_libraries()
        if resume is not None:
            _check_resumed_code(resume, config, options.trust_code, console.log)
        if options.command == "pretrain":
            from tba.tasks import resolve_policy

            path = resolve_policy(config.policy.model, config.pretrain, config.seed, console.log)
            console.log(f"base policy ready: {path}")
            return 0
        from tba.run import train

        run_dir = train(config, console, resume=resume is not None, overwrite=options.overwrite)
        summary = json.loads((run_dir / "eval.json").read_text())
        if not summary["interrupted"]:
            console.log(f"done: {run_dir}")
            return 0
        stopped_by = summary.get("stopped_by") or "SIGINT"
        console.log(f"stopped by {stopped_by} at step {summary['steps']}, saved: {run_dir} "
                    f"(`tba train --resume {run_dir}` continues it)")  # fmt: skip
        # The shell's convention, 128 + the signal: 130 after Ctrl-C, 143 after SIGTERM.
        return 128 + signal.Signals[stopped_by].value
    except (ConfigError, CheckpointError, FileExistsError, FileNotFoundError) as error:
        print(f"tba: error: {error}", file=sys.stderr)
        return 2
    except RunError as error:
        print(f"tba: error: {error}", file=sys.stderr)
        return 1
    except Interrupted as error:  # a signal where the run could not finish its step and save
        print(f"tba: interrupted {error}", file=sys.stderr)
        return 128 + error.signum
    except KeyboardInterrupt:
        print("tba: interrupted", file=sys.stderr)
        return 130
    except OSError as error:  # a write that failed (a full disk, a read-only directory)
        where = f": {error.filename}" if error.filename else ""
        print(f"tba: error: {error.strerror or error}{where}", file=sys.stderr)
        return 1


def _settle(run_dir: Path, log: Callable[[str], None]) -> None:
    """Before a run is read (`tba eval`, `tba plot`): a replacement of it that a kill cut short
    is settled (`settle_interrupted_replacement`); a live run is read as it is now."""
    with contextlib.suppress(RunBusyError):
        settle_interrupted_replacement(run_dir, log)


def _check_resumed_code(
    run_dir: Path, config: RunConfig, trusted: bool, log: Callable[[str], None]
) -> None:  # fmt: skip
    """The code the resumed run's config.yaml names runs only as the run recorded it, or with
    --trust-code (`tba.tasks.custom.check_run_code`)."""
    from tba.tasks.custom import check_run_code

    check_run_code(config.task, run_config(run_dir).task, run_dir, trusted=trusted, log=log)


def _eval(run_dir: Path, overrides: list[str], snapshots: bool, trust_code: bool) -> int:
    """Score, print a table to stdout, write the result as JSON into the run directory."""
    quiet_libraries()
    console = plain_console()
    _settle(run_dir, console.log)  # before anything of the run is read
    threads = run_config(run_dir, overrides).policy.num_threads  # no run there: one line, now
    if threads:
        torch.set_num_threads(threads)
    from tba import offline_eval

    name = offline_eval.SNAPSHOT_SCORES if snapshots else offline_eval.FINAL_SCORES
    # Before scoring, which takes minutes: the scores must have somewhere to go.
    check_writable(run_dir / name, "the scores", "tba eval writes them into the run directory: "
                   "make it writable, or copy the run somewhere you can write")  # fmt: skip
    if snapshots:
        points = offline_eval.score_snapshots(run_dir, overrides, log=console.log,
                                              trust_code=trust_code)  # fmt: skip
        result = {"overrides": overrides, "points": points}
    else:
        points = [offline_eval.score_final(run_dir, overrides, log=console.log,
                                           trust_code=trust_code)]  # fmt: skip
        result = {"overrides": overrides, **points[0]}
    title = f"{run_dir}: {'base policy and snapshots' if snapshots else 'final policy'}"
    plain_console(stderr=False).print(_scores_table(points, title))
    try:
        write_whole(run_dir / name, json.dumps(result, indent=2) + "\n")
    except OSError as error:
        raise RunError(f"cannot write {run_dir / name} ({error.strerror or error}): the scores "
                       "are printed above") from None  # fmt: skip
    console.log(f"wrote {run_dir / name}")
    return 0


def _scores_table(points: list[dict], title: str) -> Table:
    table = Table(title=title)
    metrics = list(dict.fromkeys(key for point in points for key in point["metrics"]))
    for column in ["step", "minutes", "samples", *metrics]:
        table.add_column(column, justify="right")
    for point in points:
        values = [point["metrics"].get(metric) for metric in metrics]
        table.add_row(str(point["step"]), f"{point['minutes']:.2f}", str(point["samples"]),
                      *("" if v is None else f"{v:.3f}" for v in values))  # fmt: skip
    return table


if __name__ == "__main__":
    sys.exit(main())
