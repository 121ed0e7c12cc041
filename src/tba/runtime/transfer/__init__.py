"""Weight transports: how a published version of the trainer's weights reaches the searcher
processes. Each is one module with a `Sender` (the trainer's side) and a `Receiver` (a searcher's
side), `tba.runtime.transfer.base`'s two small classes, and a settings class of its own
(`tba.config.transfer`), registered here under its name:

- `shared` (`shared.py`): flat per-dtype buckets that searchers on the trainer's machine map
  (shared memory; CUDA IPC on the trainer's GPU) and copy from;
- `broadcast` (`broadcast.py`): the same buckets sent by torch.distributed (gloo or NCCL) to
  searchers that cannot map them;
- `object_store` (`object_store.py`): a copy through host memory and Ray's object store.

`searchers.weight_transfer` names one, or `auto`, an ordered list to try; `chain.py` holds the
fallback rule. Adding a transport: a module with its sender, receiver and settings, and one
`register_transport` call (docs/design.md).
"""

from __future__ import annotations

from tba.config.transfer import (
    BroadcastTransfer,
    ObjectStoreTransfer,
    SharedTransfer,
    TransferSettings,
    register_transfer_settings,
)
from tba.core import EventLogger
from tba.runtime.transfer.base import (
    Candidate,
    CannotAttach,
    CannotSend,
    Offer,
    Receiver,
    ReceiverPlace,
    Sender,
    SenderPlace,
)
from tba.runtime.transfer.broadcast import BroadcastSender
from tba.runtime.transfer.chain import Receiving, TransferChain
from tba.runtime.transfer.object_store import ObjectStoreSender
from tba.runtime.transfer.shared import SharedSender
from tba.trainer import WeightVersions

__all__ = [
    "TRANSPORTS", "CannotAttach", "CannotSend", "Candidate", "Offer", "Receiver",
    "ReceiverPlace", "Receiving", "Sender", "SenderPlace", "TransferChain", "open_chain",
    "register_transport",
]  # fmt: skip

TRANSPORTS: dict[str, type[Sender]] = {}  # name -> its sender class (whose `receiver` is the other)


def register_transport(sender: type[Sender], settings: type[TransferSettings]) -> None:
    """Make a transport available as `searchers.weight_transfer.type=<sender.name>`: its sender
    (with its `receiver`) and its settings."""
    TRANSPORTS[sender.name] = sender
    register_transfer_settings(sender.name, settings)


register_transport(SharedSender, SharedTransfer)
register_transport(BroadcastSender, BroadcastTransfer)
register_transport(ObjectStoreSender, ObjectStoreTransfer)


def open_chain(settings: TransferSettings, trainer: WeightVersions, place: SenderPlace,
               log_event: EventLogger, *, local: bool) -> TransferChain:  # fmt: skip
    """The run's transports as `settings` (`searchers.weight_transfer`) chooses them."""
    return TransferChain(settings, trainer, place, TRANSPORTS, log_event, local=local)
