"""The `shared` weight transport timed from both sides, without Ray: the trainer's publish (a copy
of its model into its weight buckets on its device) and what a searcher process beside it spends
taking a version (`SharedReceiver.receive`: a copy out of the trainer's buckets into its own
model, by CUDA IPC on the trainer's GPU, through shared memory on a CPU). The searcher is a
process of its own (spawned: CUDA cannot be forked), on the trainer's device, as a searcher actor
sharing the trainer's GPU is; `python -m benchmarks.handoff` times the same through Ray, from the
publish to the searcher's answer. The benchmarks of one GPU reach the transport only through
here.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import numpy as np
import torch

from tba.config.transfer import SharedTransfer
from tba.errors import first_line
from tba.policy.model import get_weights
from tba.runtime.transfer import ReceiverPlace, SenderPlace
from tba.runtime.transfer.buckets import BucketCache
from tba.runtime.transfer.shared import SharedReceiver, SharedSender

READER_START_TIMEOUT_S = 300.0  # the searcher process imports torch and builds its model
COPY_TIMEOUT_S = 60.0  # one copy of a model in memory
PROBE = 16  # values of the first parameter compared after the last copy


class TrainerModule:
    """What the sender reads: the trainer's module, in this process."""

    trains_here = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def weights(self) -> dict[str, np.ndarray]:
        return get_weights(self.model)


def probe(model: torch.nn.Module) -> list[float]:
    """A few weights of `model`, to check that a copy arrived."""
    return next(model.parameters()).detach().flatten()[:PROBE].float().tolist()


def read_versions(handles: dict, make_model: Callable[[], torch.nn.Module],
                  link: Connection) -> None:  # fmt: skip
    """The searcher's side: attach to the buckets with a model of its own, then for every
    version sent, copy the newest out of them and answer the seconds it took; at the end,
    `probe` of the model."""
    try:
        model = make_model()
        place = ReceiverPlace(node=None, host=None, name="reader", timeout_s=COPY_TIMEOUT_S)
        receiver = SharedReceiver.attach(handles, model, place)
    except Exception as error:  # (CannotAttach included) said in one line
        link.send(f"the searcher cannot map the buckets: {first_line(error)}")
        return
    link.send("ready")
    try:
        while (version := link.recv()) is not None:  # (EOFError: the trainer's side is gone)
            start = time.perf_counter()
            copied = receiver.receive(model, newer_than=version - 1, offer=None)
            link.send((time.perf_counter() - start, copied))
        link.send(probe(model))
    finally:
        receiver.close()


def answer(link: Connection, timeout_s: float):
    """The searcher process's next answer; RuntimeError where none comes in `timeout_s`."""
    if not link.poll(timeout_s):
        raise RuntimeError(f"the searcher process has not answered for {timeout_s:g} s")
    try:
        return link.recv()
    except EOFError:  # it died
        raise RuntimeError("the searcher process ended without answering") from None


def time_buckets(model: torch.nn.Module, make_model: Callable[[], torch.nn.Module],
                 repeats: int) -> dict:  # fmt: skip
    """`repeats` versions of `model` published into its buckets, each copied by a searcher
    process (whose model `make_model`, a picklable function, builds on the same device): the
    trainer's publish and the searcher's copy, best and first, in seconds. RuntimeError where the
    searcher process cannot map the buckets or copies something else."""
    place = SenderPlace(node=None, host="127.0.0.1", timeout_s=COPY_TIMEOUT_S,
                        buckets=BucketCache())  # fmt: skip
    sender = SharedSender(SharedTransfer(), TrainerModule(model), place)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    reader = context.Process(target=read_versions, args=(sender.handles(), make_model, theirs),
                             daemon=True)  # fmt: skip
    publish_s, read_s = [], []
    try:
        reader.start()
        theirs.close()  # the searcher's end is its own now: its death ends our reads
        if (ready := answer(ours, READER_START_TIMEOUT_S)) != "ready":
            raise RuntimeError(ready)
        for version in range(1, repeats + 1):
            start = time.perf_counter()
            sender.publish(version, step=version)  # a device copy, synchronised
            publish_s.append(time.perf_counter() - start)
            ours.send(version)
            seconds, copied = answer(ours, COPY_TIMEOUT_S)
            if copied is None or copied[0] != version:
                raise RuntimeError(f"the searcher copied {copied}, not version {version}")
            read_s.append(seconds)
        ours.send(None)
        if answer(ours, COPY_TIMEOUT_S) != probe(model):
            raise RuntimeError("the searcher's model differs from the trainer's after the copy")
        nbytes = sender.sets.nbytes
    finally:
        ours.close()  # a searcher still waiting for a version ends
        reader.join(timeout=10)
        if reader.is_alive():
            reader.kill()
        sender.close()
        place.buckets.close()
    return {"publish_seconds": min(publish_s), "publish_first_seconds": publish_s[0],
            "read_seconds": min(read_s), "read_first_seconds": read_s[0], "bytes": nbytes,
            "repeats": repeats}  # fmt: skip
