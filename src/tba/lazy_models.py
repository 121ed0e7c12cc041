"""Models that load on first use, in the process that uses them.

Reward models, the red-teaming victim and classifier, embedding models and reference policies
travel with a task to every searcher process. `Lazy` keeps them small on the way: it holds the
recipe (`load`, a picklable function), makes the value on first use in each process, and is
pickled without it, so each process loads its own copy once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Lazy(Generic[T]):
    """`load(*args)` on the first `get(*args)` in this process, the same value after that."""

    def __init__(self, load: Callable[..., T]) -> None:
        self.load = load
        self._value: T | None = None
        # A reward call that timed out may still be loading when the next one comes: load once.
        self._lock = threading.Lock()

    def get(self, *args: Any) -> T:
        with self._lock:
            if self._value is None:
                self._value = self.load(*args)
        return self._value

    def __getstate__(self) -> dict[str, Any]:
        return {"load": self.load}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["load"])
