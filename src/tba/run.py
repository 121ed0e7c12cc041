"""`tba train`: one whole run, from its checks to its saved end, in the run directory.

`train` reads as the run goes: the checks that need nothing loaded (`PREFLIGHT_RULES`), the run
directory (a new one, or the run to resume and its newest checkpoint), the task and the policy
(its dtype and the training mode decided, `tba.policy.cpu`), the trainer and the searchers, the
base policy's evaluation, the training loop (`tba.loop.TrainLoop`), the final evaluation and the
save: eval.json, the trained policy in final/ and the curves.

The trainer runs in this process, or as `trainer.world_size` Ray actors that shard the policy;
the searchers run as Ray actors (`searchers.count >= 1`) or, in the synchronous mode with
`searchers.count=0`, inside this process without Ray (`tba.runtime.launch`). The loop writes
checkpoints as it goes and at exit; `train(..., resume=True)` continues the run in `output_dir`
from its newest one. Ctrl-C and SIGTERM are handled from start to end (`tba.interrupts`): each
step says what the run is doing (`StopRequest.during`), for the line that a signal ending the run
at once says.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console

from tba.checkpoint import Checkpoint, check_compatible, latest_checkpoint
from tba.config import RunConfig, dump_config
from tba.console import plain_console
from tba.core import Task
from tba.errors import Interrupted, RunError, writing
from tba.evaluation import EvalFaults
from tba.interrupts import (
    COMMAND_LINE,
    Advice,
    StopRequest,
    going_on,
    interrupted_line,
    stop_on_interrupt,
)
from tba.limits import check_unfinished, limits_line, step_limit
from tba.loop import TrainLoop, evaluate
from tba.plots import plot_curves
from tba.policy.cpu import resolve_dtype, resolve_mode, usable_cpus
from tba.policy.engines import ENGINES
from tba.policy.model import resolve_device, save_policy
from tba.policy.optimizers import check_optimizer
from tba.policy.quantization import check_quantization
from tba.policy.tokenizer import load_tokenizer
from tba.rewards.scorer import check_reward_weights
from tba.rng import RandomState
from tba.run_dir import (
    PARTIAL,
    EventLog,
    MetricsLog,
    Replacement,
    create_run_dir,
    own_run_dir,
    read_metrics,
    settle_replacement,
    truncate_metrics,
    write_whole,
)
from tba.runtime.feed import FEEDS
from tba.runtime.launch import open_searchers, open_trainer
from tba.runtime.placement import check_devices, searcher_device, trainer_device
from tba.runtime.ray_cluster import check_cluster
from tba.runtime.ray_trainer import RankedTrainer
from tba.tasks import load_task, resolve_policy
from tba.tasks.custom import named_code
from tba.tracking import Trackers, open_trackers, require_trackers
from tba.trainer import Trainer
from tba.trust import record_code

Log = Callable[[str], None]


def train(
    config: RunConfig, console: Console | None = None, *, resume: bool = False,
    overwrite: bool = False, task: Task | None = None,
    save_policy: Callable[[Path], None] | None = None, advice: Advice = COMMAND_LINE,
) -> Path:  # fmt: skip
    """Train as `config` says, in `config.output_dir`; `resume`: continue the run there from its
    newest checkpoint (or, when it reached its limit but its end was not saved, evaluate and save
    it); `overwrite`: replace a run already there (kept aside until this run has its first
    checkpoint); `task`: train on this task instead of the one `config.task` describes (the
    Python API's own data and rewards); `save_policy(directory)`: writes the starting policy to
    `policy.model` once the run directory exists (a model the Python API was given in memory,
    kept with the run); `advice`: how the caller's user goes on, in its words. The run directory
    is this process's alone until it returns (`tba.run_dir.own_run_dir`). Ctrl-C and SIGTERM
    are handled from start to end (`stop_on_interrupt`): one that cannot wait for a step to end
    raises `Interrupted`, which says what is kept and how to go on."""
    console = console or plain_console()
    with stop_on_interrupt() as stop:
        try:
            with contextlib.ExitStack() as owner:
                return _train(config, console, owner, stop, resume=resume, overwrite=overwrite,
                              task=task, save_policy=save_policy, advice=advice)  # fmt: skip
        except BaseException as error:
            if isinstance(error, Interrupted) or not (stop.aborting or isinstance(
                    error, KeyboardInterrupt)):  # fmt: skip
                raise
            signum = stop.signal or signal.SIGINT
            raise Interrupted(interrupted_line(stop, signum, advice), signum) from None


def _train(
    config: RunConfig, console: Console, owner: contextlib.ExitStack, stop: StopRequest, *,
    resume: bool, overwrite: bool, task: Task | None,
    save_policy: Callable[[Path], None] | None, advice: Advice,
) -> Path:  # fmt: skip
    """The recipe of `train`: its steps in the order they run."""
    log = console.log
    torch_threads = torch.get_num_threads()  # torch's own, where the mode's feed leaves them
    _set_trainer_threads(config, torch_threads)
    check_before_loading(config)
    own_code = task is None  # the code its config names is the user's, imported below: recorded
    run_dir = checkpoint = None
    decided: list[str] = []  # said once the run directory is settled: a refusal is one line
    if resume:  # the directory is ours and the checkpoint fits before any task world is built
        run_dir, checkpoint = _resumed_checkpoint(config, owner, stop, log)
    if task is None:
        task = load_task(config.task, seed=config.seed, policy_model=config.policy.model,
                         cache_dir=config.pretrain.cache_dir, log=log)  # fmt: skip
    # So is the model, unless it comes with the run (`save_policy`) and is only written below.
    if save_policy is None:
        policy_dir, config = _fetch_policy(config, checkpoint, log, decided)
    check_reward_weights(config.task.reward_weights, len(task.reward_fns))
    replacement = None
    if checkpoint is not None:
        _settle_resumed_end(run_dir, checkpoint, config, task, stop, log)
    else:
        run_dir, replacement = create_run_dir(config.output_dir, overwrite, log, owner=owner,
                                              keep=advice.keep)  # fmt: skip
        stop.run_dir, stop.replacement = run_dir, replacement
    if save_policy is not None:
        if not (Path(config.policy.model) / "config.json").exists():
            save_policy(Path(config.policy.model))
        policy_dir, config = _fetch_policy(config, checkpoint, log, decided)
    for line in decided:
        log(line)
    _set_trainer_threads(config, torch_threads)  # by the mode decided
    _record_config(run_dir, config, own_code)
    return _run(config, run_dir, task, policy_dir, checkpoint, replacement, console, stop, advice)


def _set_trainer_threads(config: RunConfig, default: int) -> None:
    """This process's torch threads (`trainer_threads`, or `default` where they are left to
    torch): before anything computes, and again once `train.mode=auto` is decided."""
    torch.set_num_threads(trainer_threads(config) or default)


def trainer_threads(config: RunConfig) -> int | None:
    """Torch threads of the trainer: as configured, else what its mode's feed leaves it. Before
    `train.mode=auto` is decided (while the policy is fetched, or an embedded one pretrained),
    the feed of the mode it is decided to where it says nothing else: async, unless
    `searchers.count=0`."""
    mode = config.train.mode
    if mode == "auto":
        mode = "sync" if config.searchers.count == 0 else "async"
    return config.policy.num_threads or FEEDS[mode].trainer_threads(config)


# ------------------------------------------------------------------- checks before anything loads


def _trackers_installed(config: RunConfig) -> None:
    """The trackers `report_to` names are installed."""
    require_trackers(config.report_to)


def _engine_available(config: RunConfig) -> None:
    """The software the searchers' generation engine (`searchers.engine`) needs is installed."""
    ENGINES[config.searchers.engine.type].check_available()


def _devices_present(config: RunConfig) -> None:
    """The devices the run names that this machine must have, there and large enough."""
    check_devices(config)


def _cluster_answers(config: RunConfig) -> None:
    """The Ray cluster the run joins, if any, is named in a form Ray joins, and answers."""
    check_cluster(config)


def _quantization_possible(config: RunConfig) -> None:
    """A quantized base has bitsandbytes, and adapters to train."""
    check_quantization(config)


def _optimizer_available(config: RunConfig) -> None:
    """The software `train.optimizer` needs is installed."""
    check_optimizer(config.train.optimizer)


# Checked in this order before anything is loaded: missing software first, then the machine; a
# bad file or row of the task stops the run next, before any model is loaded.
PREFLIGHT_RULES = (
    _trackers_installed,
    _engine_available,
    _devices_present,
    _cluster_answers,
    _quantization_possible,
    _optimizer_available,
)


def check_before_loading(config: RunConfig) -> None:
    """Every rule of `PREFLIGHT_RULES`, in order: the first that fails raises its one line."""
    for rule in PREFLIGHT_RULES:
        rule(config)


# ----------------------------------------------------------------- the run directory and policy


def _resumed_checkpoint(
    config: RunConfig, owner: contextlib.ExitStack, stop: StopRequest, log: Log
) -> tuple[Path, Checkpoint]:
    """The run to resume, owned by this process, and its newest checkpoint, which must fit
    `config` (`check_compatible`; `policy.dtype=auto` fits the dtype the run was trained in)."""
    run_dir = stop.run_dir = owner.enter_context(own_run_dir(Path(config.output_dir)))
    settle_replacement(run_dir, log)
    checkpoint = latest_checkpoint(run_dir, log)
    current = config.model_dump()
    if config.policy.dtype == "auto":
        current["policy"]["dtype"] = trained_dtype(checkpoint)
    check_compatible(checkpoint.state["config"], current, checkpoint.path)
    return run_dir, checkpoint


def trained_dtype(checkpoint: Checkpoint) -> str:
    """The dtype the checkpoint's run trained in (runs from before `policy.dtype=auto` wrote
    float32 or bfloat16; the oldest, without the setting, trained in float32)."""
    return checkpoint.state["config"].get("policy", {}).get("dtype") or "float32"


def _settle_resumed_end(
    run_dir: Path, checkpoint: Checkpoint, config: RunConfig, task: Task, stop: StopRequest,
    log: Log,
) -> None:  # fmt: skip
    """A resumed run's metrics back to its checkpoint; whether its training is complete, only
    its end left (`check_unfinished`): then what a signal leaves is still only the end."""
    ending = check_unfinished(run_dir, checkpoint, config, len(task.train_rows), log)
    truncate_metrics(run_dir / "metrics.jsonl", checkpoint.step, ending=ending)
    if ending:
        stop.trained = checkpoint.step


def _fetch_policy(
    config: RunConfig, checkpoint: Checkpoint | None, log: Log, decided: list[str]
) -> tuple[Path, RunConfig]:
    """The policy's local directory (`resolve_policy`), and `config` with a concrete
    `policy.dtype` and `train.mode` (`with_concrete_dtype`, `with_concrete_mode`, their lines
    appended to `decided`)."""
    policy_dir = resolve_policy(config.policy.model, config.pretrain, config.seed, log)
    config = with_concrete_dtype(config, policy_dir, checkpoint, decided.append)
    return policy_dir, with_concrete_mode(config, policy_dir, checkpoint, decided.append)


def with_concrete_dtype(
    config: RunConfig, policy_dir: Path, checkpoint: Checkpoint | None, log: Log
) -> RunConfig:
    """`config` with `policy.dtype` decided, before it is written or reaches the trainer, the
    searchers or Ray, so that every process and checkpoint has the same concrete dtype: `auto`
    by this machine's CPU and the model's size (`tba.policy.cpu.resolve_dtype`), or, resumed, as
    the run was trained. `log` says the dtype and why, in one line."""
    setting = config.policy.dtype
    if setting == "auto" and checkpoint is not None:
        dtype = trained_dtype(checkpoint)
        line = f"policy.dtype=auto: {dtype} (the dtype this run was trained in)"
    else:
        dtype, line = resolve_dtype(setting, trainer_device(config), policy_dir)
    log(line)
    return config.model_copy(update={"policy": config.policy.model_copy(update={"dtype": dtype})})


def with_concrete_mode(
    config: RunConfig, policy_dir: Path, checkpoint: Checkpoint | None, log: Log,
    cpus: int | None = None,
) -> RunConfig:  # fmt: skip
    """`config` with `train.mode` decided, before it is written or reaches the searchers: `auto`
    by where the run computes, its cores (`cpus`, default `usable_cpus`) and the model's size
    (`tba.policy.cpu.resolve_mode`; synchronous, a `searchers.count` left at its default becomes
    0), or, resumed, as the run was trained (`searchers.count=0` is sync either way). `log` says
    the mode and why, in one line; a mode set says nothing here (the run's start names it)."""
    sc = config.searchers
    default_count = type(sc).model_fields["count"].default
    # A count other than the default, or a weight transport named (it needs searcher
    # processes), asks for searcher processes: a synchronous `auto` keeps them.
    searchers_set = sc.count != default_count or sc.weight_transfer.type != "auto"
    if config.train.mode == "auto" and checkpoint is not None and sc.count != 0:
        mode, count = trained_mode(checkpoint)
        count = sc.count if searchers_set else count
        line = f"train.mode=auto: {mode} (the mode this run was trained in)"
    else:
        mode, count, line = resolve_mode(
            config.train.mode, sc.count, searchers_set, _run_devices(config), policy_dir,
            usable_cpus(config.ray.num_cpus) if cpus is None else cpus,
            elsewhere=_elsewhere(config), async_only=_async_only(config),
        )  # fmt: skip
    if line is not None:
        log(line)
    return config.model_copy(update={
        "train": config.train.model_copy(update={"mode": mode}),
        "searchers": sc.model_copy(update={"count": count}),
    })  # fmt: skip


def trained_mode(checkpoint: Checkpoint) -> tuple[str, int]:
    """The mode and the searcher processes of the checkpoint's run (its config has them
    decided; runs from before `train.mode=auto` wrote theirs, the oldest at the defaults of
    then: async, one searcher)."""
    saved = checkpoint.state["config"]
    return (saved.get("train", {}).get("mode") or "async",
            saved.get("searchers", {}).get("count", 1))  # fmt: skip


def _run_devices(config: RunConfig) -> dict[str, torch.device]:
    """The devices the run computes on, by their settings, resolved: the trainer's, the
    searchers' and the reward models'. (Trainer ranks, which may reserve GPUs of their own, keep
    `auto` asynchronous anyway: `_elsewhere`.)"""
    return {"policy.device": trainer_device(config), "searchers.device": searcher_device(config),
            "task.reward_device": resolve_device(config.task.reward_device)}  # fmt: skip


def _elsewhere(config: RunConfig) -> str | None:
    """A setting that takes the run beyond one trainer process on this machine's cores."""
    if config.ray.address is not None:
        return f"ray.address={config.ray.address}"
    if config.trainer.world_size > 1:
        return f"trainer.world_size={config.trainer.world_size}"
    return None


def _async_only(config: RunConfig) -> str | None:
    """A setting the synchronous mode refuses (`tba.config.run`'s rule on
    `buffer.fresh_uses`)."""
    uses = config.buffer.fresh_uses
    if uses > 1 and config.train.sync_generate == "every_step":
        return f"buffer.fresh_uses={uses} with train.sync_generate=every_step"
    return None


def _record_config(run_dir: Path, config: RunConfig, own_code: bool) -> None:
    """config.yaml; and, for a config that names the user's code, what `tba eval` and `--resume`
    may import again without asking (`tba.trust`)."""
    (run_dir / "config.yaml").write_text(dump_config(config))
    if own_code:
        record_code(run_dir, list(named_code(config.task)))


# ------------------------------------------------------------------------------------- the run


def _run(
    config: RunConfig, run_dir: Path, task: Task, policy_dir: Path,
    checkpoint: Checkpoint | None, replacement: Replacement | None, console: Console,
    stop: StopRequest, advice: Advice,
) -> Path:  # fmt: skip
    """The trainer and the searchers started, the base policy evaluated, the loop run, the
    searchers stopped, the final policy evaluated and the run saved."""
    random_state = RandomState(config.seed)
    tokenizer = load_tokenizer(
        str(policy_dir), chat_template=config.policy.chat_template or task.conversational
    )
    trackers = open_trackers(config, run_dir)
    events = EventLog(run_dir / "events.jsonl", console.log)
    eval_faults = EvalFaults(events)
    console.log(f"run directory: {run_dir} ({config.train.mode} mode)")
    console.log(limits_line(config.train, len(task.train_rows)))
    saved_searchers = checkpoint.state["searchers"] if checkpoint else None
    try:
        total_steps = step_limit(config.train, len(task.train_rows))
        with open_trainer(config, policy_dir, tokenizer.pad_token_id, events,
                          total_steps) as trainer:  # fmt: skip
            # Searcher processes start while the base policy is evaluated here.
            with open_searchers(config, policy_dir, tokenizer, task, events, run_dir,
                                saved_searchers, trainer) as searchers:  # fmt: skip
                if checkpoint is None:
                    base, base_seconds = _evaluate_base(trainer, tokenizer, task, config,
                                                        eval_faults, stop)  # fmt: skip
                else:
                    base, base_seconds = checkpoint.state["base"], None
                    events("resumed", step=checkpoint.step, checkpoint=checkpoint.path.name,
                           discarded_in_flight=searchers.discarded_in_flight)  # fmt: skip
                console.log("base policy: " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()))
                with stop.during("while starting to train"):
                    loop = TrainLoop(config, trainer, searchers, random_state, tokenizer, task,
                                     run_dir, events, trackers, base, eval_faults, checkpoint,
                                     base_seconds=base_seconds)  # fmt: skip
                    loop.replacement = replacement
                    if schedule := loop.evals.line():
                        console.log(schedule)
                with stop.during("while training", after_step=True):
                    loop.run(console, stop)
                with stop.during("while stopping the searchers"):
                    if loop.at_limit(loop.train_seconds):
                        stop.trained = trainer.step_count
                    stop.hold()  # until the searchers and their Ray instance are stopped
            stop.release()
            with stop.during("during the final evaluation"):
                final = evaluate(trainer, tokenizer, task, config, eval_faults, pass_k=True)
            with stop.during("while saving the run"):  # and, after it, closing the trainer
                summary = {"base": base, "final": final, **loop.summary()}
                _save_run(run_dir, summary, trainer, tokenizer, task, trackers, stop, advice)
    finally:
        events.close()
        trackers.close()
    console.log("final policy: " + ", ".join(f"{k} {v:.3f}" for k, v in final.items()))
    return run_dir


def _evaluate_base(
    trainer: Trainer | RankedTrainer, tokenizer, task: Task, config: RunConfig,
    faults: EvalFaults, stop: StopRequest,
) -> tuple[dict[str, float], float]:  # fmt: skip
    """The base policy's held-out metrics, and the seconds they took (by which
    `eval.every_minutes=auto` times the first evaluation on the way)."""
    with stop.during("during the evaluation of the base policy"):
        started = time.time()
        base = evaluate(trainer, tokenizer, task, config, faults, pass_k=True)
        return base, time.time() - started


def _save_run(
    run_dir: Path, summary: dict, trainer: Trainer | RankedTrainer, tokenizer, task: Task,
    trackers: Trackers, stop: StopRequest, advice: Advice,
) -> None:  # fmt: skip
    """The final metrics in metrics.jsonl, then `save_results`; a full disk at the end is one
    line that says what is kept and how to finish the run."""
    try:
        with MetricsLog(run_dir / "metrics.jsonl", trackers) as metrics:
            metrics.write({"step": trainer.step_count, "time": summary["train_minutes"] * 60,
                           **summary["final"]})  # fmt: skip
        save_results(run_dir, summary, trainer.model, tokenizer, task.metrics)
    except (OSError, RunError) as error:
        if isinstance(error, OSError):
            error = f"cannot write {error.filename or run_dir} ({error.strerror or error})"
        raise RunError(f"{error}; {going_on(stop, advice)}") from None


def save_results(
    run_dir: Path, summary: dict, model, tokenizer, metrics: tuple[str, ...] = ("eval_pass@1",)
) -> None:
    """eval.json, the trained policy in final/, and the curves plot; the smallest first, so that a
    full disk keeps what fits, and says what did not (`RunError`). eval.json and final/ are each
    written whole or not at all, under a temporary name then renamed: a kill or a full disk
    never leaves half of one, and a run without both has not ended (`tba.run_dir.run_ended`)."""
    path = run_dir / "eval.json"
    try:
        write_whole(path, json.dumps(summary, indent=2))
    except OSError as error:
        raise RunError(f"cannot write {path} ({error.strerror or error})") from None
    final, partial = run_dir / "final", run_dir / f"final{PARTIAL}"
    try:
        with writing(f"the trained policy in {final}"):
            shutil.rmtree(partial, ignore_errors=True)
            save_policy(model, partial)
            tokenizer.save_pretrained(partial)
            if final.exists():  # the end of this run before it was resumed
                shutil.rmtree(final)
            partial.rename(final)
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        reason = error.strerror or str(error).removeprefix(f"the trained policy in {final}: ")
        raise RunError(f"cannot write the trained policy in {final} ({reason}); eval.json is "
                       "written") from None  # fmt: skip
    with contextlib.suppress(OSError):  # a plot of what metrics.jsonl holds: not worth failing
        plot_curves(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png",
                    "tba train", metrics)  # fmt: skip
