"""The object store: a version is put into Ray's object store once, as numpy arrays
(`tba.policy.model.get_weights`), and every searcher that takes this way fetches that one copy.
It works wherever Ray does (any machine, any device, a trainer sharded over ranks), through host
memory: the way of last resort, which every other transport falls back to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tba.policy.model import set_weights
from tba.runtime.transfer.base import Offer, Receiver, ReceiverPlace, Sender

NAME = "object_store"


class ObjectStoreReceiver(Receiver):
    """Fetches the version offered from the object store and loads it into the model."""

    name = NAME

    def __init__(self, place: ReceiverPlace) -> None:
        self.place = place

    @classmethod
    def attach(cls, handles: Any, model: torch.nn.Module,
               place: ReceiverPlace) -> ObjectStoreReceiver:  # fmt: skip
        return cls(place)

    def receive(
        self, model: torch.nn.Module, newer_than: int, offer: Offer | None, *, wait: bool = False
    ) -> tuple[int, int] | None:
        if offer is None or offer.version <= newer_than:
            return None
        ref = offer.payloads.get(NAME)
        if ref is None:  # offered before the trainer knew this searcher takes copies
            return None
        import ray  # a searcher process is a Ray actor: Ray is there, imported by Ray itself

        set_weights(model, ray.get(ref, timeout=self.place.timeout_s))
        return offer.version, offer.step


class ObjectStoreSender(Sender):
    """Puts a version into the object store at its publish while some searcher may take it this
    way (`wanted`), else on demand (`payload`) from `source`: the newest published version read
    back from where another transport holds it (the shared buckets)."""

    name = NAME
    receiver = ObjectStoreReceiver

    def __init__(self, settings: Any, trainer: Any, place: Any) -> None:
        super().__init__(settings, trainer, place)
        self.wanted = True
        self.source: Callable[[], tuple[int, int, dict[str, np.ndarray]]] | None = None
        self._latest: tuple[int, int, Any] | None = None  # (version, step, reference or None)

    def publish(self, version: int, step: int) -> Any:
        self._latest = (version, step, None)
        if self.wanted or self.source is None:
            self._latest = (version, step, self.place.put(self.trainer.weights()))
        return self._latest[2]

    def payload(self) -> Any:
        """The newest version's reference, put now if it was not at its publish."""
        if self._latest is None:
            return None
        version, step, ref = self._latest
        if ref is None and self.source is not None:
            source_version, source_step, weights = self.source()
            ref = self.place.put(weights)
            self._latest = (source_version, source_step, ref)
        return ref
