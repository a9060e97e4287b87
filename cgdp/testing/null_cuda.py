"""A null CUDA runtime: every CUDA call is a no-op, so what is left of a step is cgdp's own host cost.

Inside ``with cgdp.testing.null_cuda(8) as rt:``, ``"cuda:0"`` … ``"cuda:7"`` are CUDA devices and
the engine runs :mod:`cgdp.engine.backend.cuda`'s own code (hooks, sends, completion waits, the
host sum, copies back, events, stream waits), but the runtime beneath it
(:class:`cgdp.engine.backend.cuda_runtime.TorchCuda`) is replaced by :class:`NullCuda`, whose methods
return at once: a copy copies nothing, an event is complete when recorded, a stream wait waits for
nothing. Tensors of a null device live in host memory (its ``torch_device`` is ``cpu``), so the
replicas' forward, backward and optimizer still run, on CPU kernels.

What a step then costs on the host is the model's own work (its CPU kernels: at tiny widths,
their dispatch), plus cgdp's Python, its thread hand-offs and the host sum: that is what
``bench/bench_host_cost.py`` measures, for any number of devices on a machine without them. The
results are **not** gradients: nothing moves, so the host sums whatever its slots hold. Use
:func:`cgdp.testing.simulated_cuda` to check results; use this to count and time.

``rt.counts`` counts the runtime calls by name (``copy``, ``Event``, ``record``, ``wait_event``,
``stream``, ``synchronize``, …): what a real GPU would be asked per step. ``rt.registered`` is
the page-locked host memory (address → bytes), as ``cudaHostRegister`` would hold it.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from typing import Any, Iterator, Sequence

import torch

__all__ = ["null_cuda", "NullCuda"]


class NullStream:
    """A stream that runs nothing: every wait is already satisfied."""

    __slots__ = ("rt", "index", "device_index", "context")

    def __init__(self, rt: "NullCuda", index: int):
        self.rt = rt
        self.index = self.device_index = index
        self.context = _Context(rt)

    def wait_event(self, event: "NullEvent") -> None:
        self.rt.counts["wait_event"] += 1

    def synchronize(self) -> None:
        self.rt.counts["stream_synchronize"] += 1

    def query(self) -> bool:
        return True


class _Context:
    """``with rt.stream(s):`` that switches nothing (the null runtime has no current stream)."""

    __slots__ = ("rt",)

    def __init__(self, rt: "NullCuda"):
        self.rt = rt

    def __enter__(self) -> None:
        self.rt.counts["stream"] += 1

    def __exit__(self, *exc: Any) -> None:
        pass


class NullEvent:
    """An event that is complete as soon as it is recorded."""

    __slots__ = ("rt", "enable_timing", "blocking", "_t")

    def __init__(self, rt: "NullCuda", enable_timing: bool = False, blocking: bool = False):
        rt.counts["Event"] += 1
        self.rt = rt
        self.enable_timing = enable_timing
        self.blocking = blocking
        self._t = 0.0

    def record(self, stream: NullStream | None = None) -> None:
        self.rt.counts["record"] += 1
        if self.enable_timing:
            self._t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.rt.counts["event_synchronize"] += 1

    def wait(self, stream: NullStream | None = None) -> None:
        self.rt.counts["wait_event"] += 1

    def elapsed_time(self, end: "NullEvent") -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        return (end._t - self._t) * 1e3


class NullCuda:
    """A CUDA runtime with :class:`cgdp.engine.backend.cuda_runtime.TorchCuda`'s methods, each a
    no-op."""

    simulated = True
    null = True

    def __init__(self, num_devices: int):
        if num_devices < 1:
            raise ValueError(f"null_cuda needs at least one device, got {num_devices}")
        self.num_devices = num_devices
        self.counts: Counter = Counter()
        """Runtime calls by name, since the runtime was made (or since ``counts.clear()``)."""
        self.registered: dict[int, int] = {}
        """Page-locked host ranges: address → bytes."""
        self._default = [NullStream(self, i) for i in range(num_devices)]
        self._rng = torch.Generator().get_state()
        self._lock = threading.Lock()

    def _check(self, index: int) -> None:
        if not 0 <= index < self.num_devices:
            raise RuntimeError(f"null CUDA: cuda:{index} does not exist ({self.num_devices} devices)")

    # -------------------------------------------------------------- the runtime's methods
    def device_count(self) -> int:
        return self.num_devices

    def torch_device(self, index: int) -> torch.device:
        self._check(index)
        return torch.device("cpu")

    def is_device(self, device: Any) -> bool:
        return False  # its devices are host memory: inputs are not staged

    def Stream(self, index: int) -> NullStream:  # noqa: N802 (mirrors torch.cuda.Stream)
        self._check(index)
        self.counts["Stream"] += 1
        return NullStream(self, index)

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> NullEvent:  # noqa: N802
        return NullEvent(self, enable_timing, blocking)

    def stream(self, s: NullStream) -> _Context:
        return s.context

    def current_stream(self, index: int) -> NullStream:
        self.counts["current_stream"] += 1
        return self._default[index]

    def default_stream(self, index: int) -> NullStream:
        return self._default[index]

    def set_device(self, index: int) -> None:
        self._check(index)
        self.counts["set_device"] += 1

    def synchronize(self, index: int) -> None:
        self.counts["synchronize"] += 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.counts["copy"] += 1

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # zeroed: nothing is ever copied into it, and the host sums (and checks) what it holds
        t = torch.zeros(max(numel, 1), dtype=dtype)[:numel]
        with self._lock:
            self.registered[t.data_ptr()] = max(numel, 1) * t.element_size()
        self.counts["host_register"] += 1
        return t

    def host_free(self, t: torch.Tensor) -> None:
        with self._lock:
            if self.registered.pop(t.data_ptr(), None) is None:
                raise RuntimeError("null CUDA: cudaHostUnregister of memory that is not registered")
        self.counts["host_unregister"] += 1

    def reduce_into_first(self, tensors: Sequence[torch.Tensor]) -> None:
        self.counts["reduce"] += 1

    def broadcast(self, tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> list[list[torch.Tensor]]:
        self.counts["broadcast_coalesced"] += 1
        return [list(tensors) for _ in indices]

    def rng_key(self, index: int) -> Any:
        return index

    def get_rng_state(self, index: int) -> torch.Tensor:
        return self._rng

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        pass

    def new_rng_state(self, index: int, seed: int) -> torch.Tensor:
        return self._rng

    @property
    def registered_bytes(self) -> int:
        """Page-locked host bytes held now."""
        return sum(self.registered.values())


@contextlib.contextmanager
def null_cuda(num_devices: int = 2) -> Iterator[NullCuda]:
    """Inside, ``"cuda:0"`` … ``"cuda:{num_devices-1}"`` run cgdp's CUDA backend on a runtime whose
    every call is a no-op (nothing is computed on, or copied to or from, any device)."""
    from cgdp.engine.backend.cuda_runtime import use_runtime
    rt = NullCuda(num_devices)
    with use_runtime(rt):
        yield rt
