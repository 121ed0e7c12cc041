"""What a run leaves behind: one directory with config, metrics, evaluation, plot, checkpoint.

<run_dir>/config.yaml      the resolved configuration
<run_dir>/metrics.jsonl    one JSON object per optimizer step (eval fields when evaluated)
<run_dir>/events.jsonl     searchers started, died and restarted; reward faults; skipped
                           steps; checkpoints written or failed; interruptions and resumes
<run_dir>/checkpoints/     everything `tba train --resume` needs (see tba.checkpoint)
<run_dir>/searchers/       per searcher process: samples made and prompt-stream position
<run_dir>/eval.json        base and final evaluation, waiting fraction, staleness histograms
                           (weight versions and optimizer steps), fresh and repeated groups
<run_dir>/attacks.jsonl    (red-teaming) every distinct attack the searchers made, with its
                           reward, toxicity and, in the embedded world, the modes it triggers
<run_dir>/completions.jsonl  with log_completions=true: every new sample's prompt, completion,
                           reward and reward parts, step, weight version, truncation
<run_dir>/base_model/      the starting policy, when the Python API was given a loaded model
<run_dir>/snapshots/       policy weights every `eval.snapshot_minutes`, if asked (fp32, keys
                           of the base model; with LoRA the adapters merged in)
<run_dir>/curves.png       held-out pass@1 and mean reward against wall-clock minutes, and the
                           staleness of the trained samples in optimizer steps
<run_dir>/final/           the trained policy and its tokenizer, loadable with `from_pretrained`;
                           with LoRA: the adapters merged into the base weights (merged tensors
                           in fp32), and the adapters alone in final/adapter/
                           (`peft.PeftModel.from_pretrained(base_model, "final/adapter")`)
<run_dir>/tensorboard/     with report_to=[tensorboard]: every metric as a TensorBoard scalar
<run_dir>/wandb/           with report_to=[wandb]: the Weights & Biases run's local files
<run_dir>/eval_final.json  written by `tba eval`: the final policy scored after the run
<run_dir>/eval_snapshots.json  written by `tba eval --snapshots`: the base policy and every
                           snapshot scored after the run (see tba.offline_eval)
<run_dir>/code.json        the code files the run imported (task.reward_funcs, task.eval_func),
                           with their sha256, signed with this user's key (`tba.trust`)
<run_dir>/.lock            while a process runs in the directory: its pid, host, start time and
                           command (`own_run_dir`)
<run_dir>/.replaced/       while a run replaces the one in the directory (`--overwrite`,
                           `TBATrainer.train()`): the old run, until the new one has its first
                           checkpoint (`set_aside`)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tba.config import RunConfig, load_config
from tba.errors import ConfigError, RunError
from tba.locks import FileLock, Locked, describe_holder
from tba.tracking import Trackers
from tba.trust import CODE_RECORD

# What a run writes into its directory: what `--overwrite`, or a new start after a run that never
# checkpointed, removes (and nothing else that may be in the directory).
RUN_FILES = ("config.yaml", "metrics.jsonl", "events.jsonl", "eval.json", "curves.png",
             "attacks.jsonl", "completions.jsonl", "eval_final.json", "eval_snapshots.json",
             "checkpoints", "searchers", "snapshots", "final", "tensorboard", "wandb",
             "base_model", CODE_RECORD)  # fmt: skip
# Where a run being replaced waits while the run replacing it starts (`set_aside`): put back if
# that one stops before its first checkpoint, deleted once it has one. `.replacing` holds what
# belongs back in the run directory (a move aside or back that a kill cut short), `.replaced-old`
# what is being deleted.
REPLACED, MOVING, DELETING = ".replaced", ".replacing", ".replaced-old"


class RunExistsError(FileExistsError):
    """The run directory holds a run to resume or one that ended: starting anew would lose it.
    `advice` says how to go on, in the words of the caller (the command line's by default)."""

    COMMAND_LINE = ("continue it with `tba train --resume {path}`, replace it with --overwrite, "
                    "or choose another output_dir")  # fmt: skip

    def __init__(self, path: Path, advice: str = COMMAND_LINE) -> None:
        super().__init__(f"run directory {path} already holds a run; {advice.format(path=path)}")
        self.path = path


class RunBusyError(FileExistsError):
    """Another process is running in the run directory: a second start would write over it."""

    def __init__(self, path: Path, holder: dict) -> None:
        super().__init__(f"run directory {path} is in use by {describe_holder(holder)}: "
                         "wait for that run to end, or stop it, or choose another output_dir")
        self.path = path


# Held by the process that runs in the directory (`own_run_dir`); names it to a second start.
LOCK_FILE = ".lock"


def holds_run(path: Path) -> bool:
    """A run that can be resumed (a complete checkpoint) or that ended (eval.json, final/)."""
    checkpoints = path / "checkpoints"
    resumable = checkpoints.is_dir() and any(checkpoints.glob("step*/state.json"))
    return resumable or (path / "eval.json").exists() or (path / "final").is_dir()


def final_saved(path: Path) -> bool:
    """Whether `path` (a run's final/) holds a whole saved policy: a config and its weights (a
    save cut short by a kill, in runs written before final/ was saved under a temporary name,
    may have left only part of it)."""
    weights = [*path.glob("model*.safetensors"), *path.glob("pytorch_model*.bin")]
    return (path / "config.json").is_file() and bool(weights)


def run_ended(path: Path) -> bool:
    """Whether the run in `path` ended: its summary (eval.json) and final policy are saved."""
    return (path / "eval.json").is_file() and final_saved(path / "final")


def describe_run(path: Path) -> str:
    """The run in `path` in a few words: 'the finished run in RUN (final/, 3 checkpoints)'."""
    steps = sorted(p.parent.name for p in (path / "checkpoints").glob("step*/state.json"))
    kept = ["final/"] if final_saved(path / "final") else []
    if steps:
        kept.append(f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''}, the newest "
                    f"{steps[-1]}")  # fmt: skip
    state = "finished" if run_ended(path) else "unfinished"
    return f"the {state} run in {path} ({', '.join(kept) or 'eval.json'})"


def run_config(run_dir: Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The config a run directory was trained with, `overrides` on top."""
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir}: no run there (config.yaml not found)")
    return load_config(run_dir / "config.yaml", list(overrides))


class Replacement:
    """A run set aside in `RUN_DIR/.replaced/` (`set_aside`) while a new run starts in its
    directory: `restore` puts it back (the new run stopped before its first checkpoint, having
    nothing to lose), `discard` deletes it (the new run has a checkpoint). Used as a context
    manager around the new run, it restores on the way out unless the new run has a checkpoint
    by then; a kill in between is settled by the next start (`settle_replacement`)."""

    def __init__(self, path: Path, what: str, log: Callable[[str], None]) -> None:
        self.path, self.what, self.log = path, what, log
        self.settled = False
        self.restored = False

    def discard(self) -> None:
        if self.settled:
            return
        self.settled = True
        _delete_set_aside(self.path)

    def restore(self) -> None:
        if self.settled:
            return
        self.settled = True
        remove_run(self.path)  # the new run's files, none of which the old run had
        (self.path / REPLACED).rename(self.path / MOVING)
        _move_back(self.path)
        self.restored = True
        self.log(f"kept {self.what}: the run meant to replace it stopped before its first "
                 "checkpoint")  # fmt: skip

    def __enter__(self) -> Replacement:
        return self

    def __exit__(self, *exc) -> None:
        if holds_run(self.path):  # the new run has a checkpoint (or ended): it replaces the old
            self.discard()
        else:
            self.restore()


def set_aside(path: Path, what: str, log: Callable[[str], None]) -> Replacement:
    """Move the run in `path` (its `RUN_FILES`) into `path/.replaced/`, whole or not at all."""
    moving = path / MOVING
    moving.mkdir()
    try:
        for name in RUN_FILES:
            if (path / name).exists():
                (path / name).rename(moving / name)
        moving.rename(path / REPLACED)
    except BaseException:  # a signal, a failed rename: the run stays as it was
        _move_back(path)
        raise
    return Replacement(path, what, log)


def settle_replacement(path: Path, log: Callable[[str], None]) -> None:
    """What a process killed while replacing the run in `path` left: a run it had set aside comes
    back unless the new run got as far as a checkpoint; a move it cut short is undone."""
    if (path / DELETING).exists():
        shutil.rmtree(path / DELETING)
    if (path / MOVING).exists():
        _move_back(path)
    if (path / REPLACED).exists():
        replacement = Replacement(path, f"the run in {path} that a killed start had set aside", log)
        replacement.__exit__(None, None, None)


def settle_interrupted_replacement(path: Path, log: Callable[[str], None]) -> None:
    """Before a command reads the run in `path` (`tba train --resume`, `tba eval`, `tba plot`):
    what a `tba train --overwrite` killed while replacing it left is settled
    (`settle_replacement`) under the directory's lock, so that what is read is the run the
    directory holds, never the killed start's files. A directory another process runs in is
    `RunBusyError` (that process settled it as it started); one that cannot be written, one line
    naming where the run set aside is (`ConfigError`)."""
    if not any((path / name).exists() for name in (REPLACED, MOVING, DELETING)):
        return
    try:
        with own_run_dir(path):
            settle_replacement(path, log)
    except (ConfigError, OSError) as error:
        reason = error.strerror if isinstance(error, OSError) else "it cannot be written"
        raise ConfigError(f"{path}: a `tba train` that was replacing its run was killed, and "
                          f"the run it replaced is set aside in {path / REPLACED} (or "
                          f"{path / MOVING}); it cannot be put back ({reason}): make {path} "
                          "writable and run this again, or read that run where it is") from None


def _move_back(path: Path) -> None:
    moving = path / MOVING
    for entry in moving.iterdir():
        if not (path / entry.name).exists():
            entry.rename(path / entry.name)
    shutil.rmtree(moving)


def _delete_set_aside(path: Path) -> None:
    """Never a reason for the new run to fail: what is left is deleted by the next start in the
    directory (`settle_replacement`)."""
    with contextlib.suppress(OSError):
        (path / REPLACED).rename(path / DELETING)
    shutil.rmtree(path / DELETING, ignore_errors=True)


@contextmanager
def own_run_dir(path: Path) -> Iterator[Path]:
    """This process's exclusive hold on the existing run directory `path`, taken before anything
    in it is read or changed and let go at exit (`tba.locks`: a process that died lets go too).
    A directory another process runs in is `RunBusyError`; one that cannot be written,
    `ConfigError`."""
    lock = FileLock(path / LOCK_FILE, directory=True)  # a deleted .lock still holds
    try:
        lock.acquire()
    except Locked as error:
        raise RunBusyError(path, error.holder) from None
    except OSError as error:
        raise unusable_output_dir(path, error) from None
    try:
        yield path
    finally:
        lock.release()


def create_run_dir(
    output_dir: str | None, overwrite: bool = False, log: Callable[[str], None] = print,
    *, owner: ExitStack, keep: str = "without --overwrite it is kept",
) -> tuple[Path, Replacement | None]:  # fmt: skip
    """A new run directory, owned (`own_run_dir`) until `owner` closes. One that holds a run
    (`holds_run`) is refused unless `overwrite`; with it, that run is said (`keep`: how the caller
    keeps it instead) and set aside (`set_aside`) until the new run has its first checkpoint,
    restored if it stops before (the `Replacement`, also settled when `owner` closes). The files of
    a run that stopped before its first checkpoint (a failed start) are replaced."""
    path = Path(output_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise unusable_output_dir(path, error) from None
    owner.enter_context(own_run_dir(path))
    settle_replacement(path, log)
    if holds_run(path) and not overwrite:
        raise RunExistsError(path)
    if holds_run(path):
        what = describe_run(path)
        log(f"replacing {what} once this run has its first checkpoint; {keep}")
        return path, owner.enter_context(set_aside(path, what, log))
    if (path / "config.yaml").exists() or (path / "metrics.jsonl").exists():
        log(f"replacing the run in {path}: it stopped before its first checkpoint")
        remove_run(path)
    return path, None


def unusable_output_dir(path: Path, error: OSError) -> ConfigError:
    """Why `path` cannot be a run directory, and what to do, in one line."""
    advice = "choose another output_dir"
    if error.errno == errno.ENAMETOOLONG:  # before anything else asks the system about `path`
        return _name_too_long(path)
    if path.exists() and not path.is_dir():
        return ConfigError(f"output_dir {path} is a file, not a directory: {advice}, or move "
                           "the file away")  # fmt: skip
    blocking = next((parent for parent in path.parents if parent.is_file()), None)
    if blocking is not None:
        return ConfigError(f"output_dir {path} cannot be created: {blocking} is a file, not a "
                           f"directory; {advice}")  # fmt: skip
    if not path.exists() and error.errno == errno.ENOENT:
        return ConfigError(f"output_dir {path} does not exist")
    reason = error.strerror or str(error)
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = error.filename or path
        return ConfigError(f"output_dir {path} cannot be created or written ({reason}: {where}): "
                           f"{advice} where you can write, or fix its permissions")  # fmt: skip
    return ConfigError(f"output_dir {path} cannot be used ({reason}): {advice}")


def _name_too_long(path: Path) -> ConfigError:
    """A path with a name longer than its file system allows (255 bytes on most), or longer
    than a path may be."""
    longest = max(path.parts, key=lambda part: len(os.fsencode(part)))
    size = len(os.fsencode(longest))
    if size > 255:
        return ConfigError(f"output_dir {path} cannot be used: its name {longest[:24]}... is "
                           f"{size} bytes long, and a file system allows 255: choose a shorter "
                           "output_dir")  # fmt: skip
    return ConfigError(f"output_dir {path} cannot be used: the path is longer than this system "
                       "allows (File name too long): choose a shorter output_dir")


def remove_run(path: Path) -> None:
    """The files a run wrote into `path` (`RUN_FILES`, and their temporary `.partial` copies),
    and nothing else."""
    for name in RUN_FILES:
        for target in (path / name, path / f"{name}{PARTIAL}"):
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()


# The temporary name of a file or directory written whole or not at all (`write_whole`).
PARTIAL = ".partial"


def write_whole(path: Path, text: str) -> None:
    """`text` as the file `path`, whole or not at all: written under a temporary name, then
    renamed (a full disk or a kill leaves the file as it was). A failed write is the `OSError`."""
    partial = path.with_name(path.name + PARTIAL)
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise


def check_writable(path: Path, what: str, advice: str) -> None:
    """Before the work whose result goes to the file `path`: that it can be written there (its
    directory made if need be, a file created in it), else one line (`ConfigError`) naming
    `what`, why, and `advice`."""
    if path.is_dir():
        raise ConfigError(f"cannot write {what} {path}: it is a directory; {advice}")
    blocking = next((parent for parent in path.parents if parent.is_file()), None)
    if blocking is not None:
        raise ConfigError(f"cannot write {what} {path}: {blocking} is a file, not a directory; "
                          f"{advice}")  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise ConfigError(f"cannot write {what} {path} ({reason}); {advice}") from None


def truncate_metrics(path: Path, last_step: int, *, ending: bool = False) -> None:
    """Drop the records of steps after `last_step`: a resumed run redoes them; `ending`: also the
    final evaluation's record at `last_step`, which a run resumed to be evaluated and saved
    writes again."""
    if not path.exists():
        return
    kept = [record for record in read_metrics(path) if record["step"] < last_step or (
        record["step"] == last_step and not (ending and _final_record(record)))]  # fmt: skip
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(record) + "\n" for record in kept))
    os.replace(partial, path)


def _final_record(record: dict) -> bool:
    """The final evaluation's record: held-out metrics at the last step, neither a step's own
    record (with its loss) nor a snapshot's."""
    return record["step"] > 0 and "loss" not in record and "snapshot" not in record


class MetricsLog:
    """Appends one JSON line per record and flushes, so a killed run keeps what it logged; hands
    every record to the run's `trackers` too (TensorBoard, W&B: `tba.tracking`), which their
    owner opens once per run and closes."""

    def __init__(self, path: Path, trackers: Trackers | None = None) -> None:
        self.path = path
        self.file = path.open("a")
        self.trackers = trackers

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as error:  # a full disk: the run cannot record what it does
            raise RunError(f"cannot write {self.path}: {error.strerror or error}") from None
        if self.trackers is not None:
            self.trackers.log(record)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EventLog:
    """Notable events, one JSON line each; all but routine ones also go to the console."""

    ROUTINE = {"searcher_ready", "checkpoint"}

    def __init__(self, path: Path, log: Callable[[str], None]) -> None:
        self.metrics = MetricsLog(path)
        self.log = log

    def __call__(self, kind: str, **fields) -> None:
        self.metrics.write({"time": time.time(), "event": kind, **fields})
        if kind not in self.ROUTINE or fields.get("incarnation"):
            self.log(f"{kind}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))

    def close(self) -> None:
        self.metrics.close()


class SampleLog:
    """New samples written to a JSON-lines file as they arrive: the completion's text, the step,
    its reward, the reward's parts and extras, whatever `annotate(text)` adds, and with `prompts`
    (the training rows' prompts, by prompt id) the prompt. `distinct`: each distinct completion
    once (attacks.jsonl); otherwise every sample (completions.jsonl). A resumed run goes on
    appending."""

    def __init__(
        self, path: Path, tokenizer, *, annotate: Callable[[str], dict] | None = None,
        distinct: bool = True, prompts: list | None = None,
    ) -> None:  # fmt: skip
        self.path, self.tokenizer, self.annotate = path, tokenizer, annotate
        self.distinct, self.prompts = distinct, prompts
        self.seen: set[str] = set()
        if distinct and path.exists():
            self.seen = {json.loads(line)["completion"] for line in path.read_text().splitlines()
                         if line.strip()}  # fmt: skip
        self.file = path.open("a")

    def write(self, samples: list, step: int) -> None:
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples],
                                            skip_special_tokens=True)  # fmt: skip
        for sample, text in zip(samples, texts):
            text = text.strip()
            if self.distinct:
                if text in self.seen:
                    continue
                self.seen.add(text)
            record = {"completion": text, "step": step, "reward": sample.reward,
                      **sample.reward_parts, **sample.extras}  # fmt: skip
            if self.prompts is not None:
                record = {"prompt": self.prompts[sample.prompt_id], **record,
                          "truncated": sample.truncated, "version": sample.version}  # fmt: skip
            if self.annotate is not None:
                record |= self.annotate(text)
            self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def save_snapshot(run_dir: Path, weights: dict[str, np.ndarray], step: int) -> str:
    """Policy weights as snapshots/stepNNNNNN.safetensors; returns the path relative to run_dir,
    as metrics.jsonl records it."""
    path = Path("snapshots") / f"step{step:06d}.safetensors"
    (run_dir / "snapshots").mkdir(exist_ok=True)
    save_file(weights, run_dir / path)
    return str(path)


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (or events.jsonl). A last line cut short (the process was
    killed while writing it) is left out: its record is lost, the file is not. Any other line that
    is not JSON is a damaged file: one line naming it."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            raise ConfigError(f"{path}, line {number}, is not a JSON record ({error.msg}): the "
                              "file is damaged") from None  # fmt: skip
    return records


def samples_consumed(records: list[dict]) -> list[int]:
    """Fresh samples generated up to each record: tba runs log the samples merged at each step
    (`samples_in`) and VinePPO's rollouts for its values (`rollouts_in`), other trainers their
    running total (`samples`)."""
    totals, samples = [], 0
    for record in records:
        arrived = record.get("samples_in", 0) + record.get("rollouts_in", 0)
        samples = record.get("samples", samples + arrived)
        totals.append(samples)
    return totals


def headline_metric(records: list[dict]) -> str | None:
    """The first held-out metric the run evaluated: its task's headline one (math: greedy
    pass@1; custom: `eval_pass@1` or `eval_reward`; red-teaming: `eval_asr`)."""
    for record in records:
        for key in record:
            if key.startswith("eval_"):
                return key
    return None
