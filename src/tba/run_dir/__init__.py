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

One part a module, each over the ones it names:

- `directory`: the directory itself: what a run writes (`RUN_FILES`), whether it holds a run and
  in what state (`holds_run`, `final_saved`, `run_ended`, `describe_run`), its config
  (`run_config`), its lock (`own_run_dir`), why a path cannot be one (`unusable_output_dir`),
  removing a run (`remove_run`), files written whole or not at all (`write_whole`,
  `check_writable`);
- `logs`: metrics, events, samples and snapshots as a run writes them (`MetricsLog`, `EventLog`,
  `SampleLog`, `save_snapshot`), and reading them back (`read_metrics`, `truncate_metrics`,
  `samples_consumed`, `headline_metric`);
- `replacement`: a run set aside while another replaces it (`set_aside`, `Replacement`), and
  settling a replacement a kill interrupted (`settle_replacement`,
  `settle_interrupted_replacement`);
- `create`: a new run directory (`create_run_dir`), replacing the run there if asked.
"""

from tba.run_dir.create import create_run_dir
from tba.run_dir.directory import (
    LOCK_FILE,
    PARTIAL,
    RUN_FILES,
    RunBusyError,
    RunExistsError,
    check_writable,
    describe_run,
    final_saved,
    holds_run,
    own_run_dir,
    remove_run,
    run_config,
    run_ended,
    unusable_output_dir,
    write_whole,
)
from tba.run_dir.logs import (
    EventLog,
    MetricsLog,
    SampleLog,
    headline_metric,
    read_metrics,
    samples_consumed,
    save_snapshot,
    truncate_metrics,
)
from tba.run_dir.replacement import (
    DELETING,
    MOVING,
    REPLACED,
    Replacement,
    set_aside,
    settle_interrupted_replacement,
    settle_replacement,
)

__all__ = [
    "DELETING",
    "LOCK_FILE",
    "MOVING",
    "PARTIAL",
    "REPLACED",
    "RUN_FILES",
    "EventLog",
    "MetricsLog",
    "Replacement",
    "RunBusyError",
    "RunExistsError",
    "SampleLog",
    "check_writable",
    "create_run_dir",
    "describe_run",
    "final_saved",
    "headline_metric",
    "holds_run",
    "own_run_dir",
    "read_metrics",
    "remove_run",
    "run_config",
    "run_ended",
    "samples_consumed",
    "save_snapshot",
    "set_aside",
    "settle_interrupted_replacement",
    "settle_replacement",
    "truncate_metrics",
    "unusable_output_dir",
    "write_whole",
]
