"""The weight hand-off from the trainer to a searcher process, each way `searchers.weight_transfer`
can take: the trainer's blocking time per publish, and the time until the searcher holds the new
weights.

- `object_store`: what `Trainer.next_version` and `RaySearchers.offer_weights` do (the weights as
  numpy arrays through host memory, `ray.put` once), then the searcher's `ray.get` and
  `set_weights`.
- `shared`: a copy of the model into the trainer's shared buckets on its device
  (`tba.runtime.transfer.shared`; shared memory on a CPU, CUDA IPC on a GPU), then the searcher's
  copy out of them into its model.
- `broadcast`: the same copy into the buckets, then their broadcast to the searcher's group
  (`tba.runtime.transfer.broadcast`; gloo on a CPU, NCCL between GPUs) into its staging
  buckets, and its copy into its model: the path for searchers on other GPUs and machines,
  measured here on one.

Each path is the run's weight transports (`tba.runtime.transfer`) as `searchers.weight_transfer`
sets them with that path alone in `auto`'s order. The searcher is a real `SearcherActor` in a
local Ray instance, on the trainer's device (a share of the trainer's GPU where there is one);
each hand-off is timed from the start of the publish to the searcher's answer that it adopted the
version (`--repeats` times; medians). `benchmarks.shared_buckets` times the shared path's two
sides without Ray (what `python -m benchmarks.gpu` reports). Models: the
built-in policy, and a Qwen2.5-0.5B-shaped model with random weights in bf16 on a GPU (fp32 on
a CPU); `--small` uses tiny shapes, to try it on a CPU in seconds.

    python -m benchmarks.handoff            # on the GPU if there is one
    python -m benchmarks.handoff --small    # tiny shapes (what a test runs)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from benchmarks.shapes import qwen_config, random_qwen
from benchmarks.shared_buckets import TrainerModule
from tba.config import load_config
from tba.config.transfer import AutoTransfer
from tba.policy.model import build_tiny_llama, resolve_device
from tba.policy.tokenizer import build_char_tokenizer
from tba.runtime.ray_actor import SearcherActor
from tba.runtime.ray_cluster import ray_session
from tba.runtime.transfer import SenderPlace, open_chain
from tba.runtime.transfer.buckets import BucketCache

PATHS = ("object_store", "shared", "broadcast")


def build(shape: str, small: bool, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The trainer's model of `shape` on `device`, and its dtype's name."""
    tokenizer = build_char_tokenizer()
    if shape == "builtin":
        sizes = dict(hidden_size=32, num_layers=2, num_heads=2) if small else {}
        model = build_tiny_llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                 bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, **sizes)  # fmt: skip
        return model.to(device), "float32"
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    name = "narrow" if small else "qwen2.5-0.5b"
    changes = {"vocab_size": 4096} if small else {}
    config = qwen_config(name, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, **changes)  # fmt: skip
    return random_qwen(config, device, getattr(torch, dtype)), dtype


def adopt(actor) -> tuple[int, dict]:
    """Have the searcher take what it was offered now (as before its next batch): its version,
    and its report of the way it took it."""

    def now(self) -> tuple[int, dict]:
        self._take_offered_weights(exact=True)
        return self.searcher.version, self.receiving.report()

    return ray.get(actor.__ray_call__.remote(now))


def measure(path: str, model: torch.nn.Module, actor, repeats: int) -> dict[str, float]:
    """Median seconds of `repeats` hand-offs along `path`: the trainer's blocking time, the
    searcher's adoption, and publish to adopted."""
    blocking, adopting, total = [], [], []
    place = SenderPlace(node=ray.get_runtime_context().get_node_id(),
                        host=ray.util.get_node_ip_address(), timeout_s=600,
                        buckets=BucketCache(), put=ray.put)  # fmt: skip
    chain = open_chain(AutoTransfer(order=[path]), TrainerModule(model), place,
                       lambda event, **fields: None, local=False)  # fmt: skip
    chain.new_searcher(0)
    version = ray.get(actor.__ray_call__.remote(lambda self: self.searcher.version))
    report: dict = {}
    try:
        for _ in range(repeats):
            version += 1
            start = time.perf_counter()
            chain.publish(version, step=version)
            published = time.perf_counter()
            actor.offer.remote(chain.offer(0))
            held, report = adopt(actor)
            chain.report(0, report)
            done = time.perf_counter()
            assert held == version, (held, version)
            blocking.append(published - start)
            adopting.append(done - published)
            total.append(done - start)
        assert report["transfer"] == path, report
    finally:
        chain.close()
    return {"blocking_s": statistics.median(blocking), "adopt_s": statistics.median(adopting),
            "handoff_s": statistics.median(total)}  # fmt: skip


def run(small: bool, repeats: int, device_name: str) -> list[dict]:
    device = resolve_device(device_name)
    rows = []
    config = load_config(None, ["ray.num_cpus=2"])
    gpus = 0.5 if device.type == "cuda" else 0.0
    with ray_session(config), tempfile.TemporaryDirectory() as tmp:
        for shape in ("builtin", "qwen2.5-0.5b"):
            model, dtype = build(shape, small, device)
            policy_dir = Path(tmp) / shape
            model.save_pretrained(policy_dir)
            build_char_tokenizer().save_pretrained(policy_dir)
            distinct = {t.data_ptr(): t for t in model.state_dict().values()}  # tied once
            size = sum(t.numel() * t.element_size() for t in distinct.values())
            settings = load_config(None, ["policy.max_new_tokens=2", f"policy.dtype={dtype}"])
            for path in PATHS:
                actor = ray.remote(SearcherActor).options(num_cpus=1, num_gpus=gpus).remote(
                    str(policy_dir), [{"prompt": "Q\n"}], [], settings, searcher_id=0, seed=0,
                    device=device.type, num_threads=1, weights_timeout_s=600,
                )  # fmt: skip
                try:
                    result = measure(path, model, actor, repeats)
                finally:
                    ray.kill(actor)
                rows.append({"model": shape + (" (small)" if small else ""), "dtype": dtype,
                             "device": str(device), "mb": size / 2**20, "path": path,
                             **result})  # fmt: skip
                print_row(rows[-1])
            del model
    return rows


def print_row(row: dict) -> None:
    print(f"| {row['model']} | {row['dtype']} | {row['device']} | {row['mb']:.1f} | "
          f"{row['path']} | {row['blocking_s']:.4f} | {row['adopt_s']:.4f} | "
          f"{row['handoff_s']:.4f} |", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes, on a CPU in seconds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto", help="the trainer's and searcher's device")
    args = parser.parse_args(argv)
    print("| model | dtype | device | MiB | path | trainer blocking s | searcher adopt s | "
          "publish to adopted s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    return run(args.small, args.repeats, args.device)


if __name__ == "__main__":
    main()
