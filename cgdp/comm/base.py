"""The interface every comm implements (the contract is in :mod:`cgdp.comm`'s docstring).

May import: nothing of cgdp. The implementations (``inproc``, ``ordered``, ``mpi``) import this module, not the package,
so that the package's factory can import them lazily without a cycle.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np


class Comm(ABC):
    rank: int = 0
    size: int = 1

    def attach(self, fail: Callable[[BaseException], None]) -> None:
        self._fail = fail

    @abstractmethod
    def post(self, key: int, buf: np.ndarray, on_done: Callable[[], None]) -> None: ...

    @abstractmethod
    def fence(self, timeout: float | None = None) -> None: ...

    @abstractmethod
    def allreduce_small(self, arr: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def broadcast_object(self, obj: Any) -> Any: ...

    @abstractmethod
    def check_same(self, signature: dict[str, str]) -> None: ...

    def close(self) -> None:
        pass
