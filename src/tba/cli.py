"""The `tba` command line.

    tba train [CONFIG.yaml] [key=value ...]     train (default: the embedded math task)
    tba train --resume RUN_DIR [key=value ...]  continue a run from its newest checkpoint
    tba train --overwrite ...                   replace the run in output_dir
    tba pretrain [CONFIG.yaml] [key=value ...]  build the built-in base policy (cached)
    tba config [CONFIG.yaml] [key=value ...]    print the resolved configuration
    tba config --reference                      every setting, its default and meaning (Markdown)

Bad input (unknown key, wrong type, out-of-range value, missing or malformed file, a checkpoint
that does not fit) prints one line naming the problem and exits with status 2; a run that cannot
go on (a searcher that cannot be kept running, a reward function failing call after call,
non-finite losses step after step), status 1; Ctrl-C stops after the current step, saves the run
(checkpoint included) and exits with status 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tba.config import ConfigError, dump_config, load_config, reference_table
from tba.errors import CheckpointError, RunError
from tba.quiet import quiet_libraries


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tba", description="Trajectory Balance with Asynchrony")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in [
        ("train", "train a policy with TB (default: the embedded math task)"),
        ("pretrain", "build the built-in base policy"),
        ("config", "print the resolved configuration"),
    ]:
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
        if name == "config":
            command.add_argument(
                "--reference", action="store_true",
                help="print every setting with its default and meaning as a Markdown table",
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
    return parser


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The first argument is a config file when it names a YAML file or an existing path."""
    if args and (args[0].endswith((".yaml", ".yml")) or Path(args[0]).exists()):
        return args[0], args[1:]
    return None, args


def _resume_config(run_dir: Path, path: str | None, overrides: list[str]) -> tuple[Path, list[str]]:
    """A resumed run reads its own config.yaml; overrides still apply."""
    if path is not None:
        raise ConfigError(f"--resume uses {run_dir / 'config.yaml'}; give only key=value overrides")
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {run_dir}: no run there (config.yaml not found)")
    return run_dir / "config.yaml", [*overrides, f"output_dir={run_dir}"]


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    path, overrides = _split_args(options.args)
    resume = getattr(options, "resume", None)
    try:
        if resume is not None:
            path, overrides = _resume_config(resume, path, overrides)
        config = load_config(path, overrides)
        if options.command == "config":
            print(reference_table() if options.reference else dump_config(config).rstrip("\n"))
            return 0
        quiet_libraries()
        from rich.console import Console

        console = Console(stderr=True)
        if options.command == "pretrain":
            from tba.base_policy import resolve_policy

            path = resolve_policy("builtin:math", config.pretrain, config.seed, console.log)
            console.log(f"base policy ready: {path}")
            return 0
        from tba.run import train

        run_dir = train(config, console, resume=resume is not None, overwrite=options.overwrite)
        interrupted = json.loads((run_dir / "eval.json").read_text())["interrupted"]
        console.log(f"{'interrupted, saved' if interrupted else 'done'}: {run_dir}")
        return 130 if interrupted else 0
    except (ConfigError, CheckpointError, FileExistsError, FileNotFoundError) as error:
        print(f"tba: error: {error}", file=sys.stderr)
        return 2
    except RunError as error:
        print(f"tba: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tba: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
