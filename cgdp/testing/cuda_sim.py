"""A simulated asynchronous CUDA runtime, so CI runs the CUDA backend without a GPU.

Inside ``with cgdp.testing.simulated_cuda(2) as sim:``, ``"cuda:0"`` and ``"cuda:1"`` are CUDA
devices: the engine builds :class:`cgdp.engine.backend.cuda.CudaDevice` objects and runs that
module's own code (events, stream waits, stream contexts, page-locked host rows, coalesced
typical collectives, per-replica random streams, device timing). Only the runtime underneath
(:class:`cgdp.engine.backend.cuda.TorchCuda`) is replaced by :class:`SimulatedCuda`:

* Tensors of a simulated device live in host memory (its ``torch_device`` is ``cpu``).
* Every stream is an in-order worker thread that sleeps a random time (seeded) before each item,
  so completions on different streams and devices come in varying orders. An asynchronous copy
  runs on its stream's worker, later than it was issued: a copy that is not properly ordered
  reads or writes at the wrong time, and the result is wrong.
* The default (compute) stream: PyTorch's own CPU kernels run at once on the issuing thread, as if
  the GPU were infinitely fast; events recorded there complete on the stream's worker after a
  random lag (the GPU being behind the host) and after any :meth:`SimulatedCuda.busy` work.
  Because compute has already run when issued, ``wait_event`` on a default stream waits on the
  host: the update may not read the gradients before the copy back has landed.
* Events complete when the work recorded before them on their stream has; ``wait_event`` orders
  streams; ``Event.synchronize`` blocks; ``elapsed_time`` needs both events timed and complete,
  as on a GPU. ``cudaHostRegister`` is bookkeeping (``sim.registered``); page-locked memory is
  ordinary memory.
* ``sim.counts`` counts what the backend asked of the runtime (events, copies, host waits, spin
  waits on non-blocking events, device synchronisations, coalesced collectives), so tests can
  check costs as well as results. An exception on a stream is kept and raised by the next
  synchronisation, like a sticky CUDA error.

What it cannot show: timing of real kernels, races inside PyTorch's own CUDA kernels, memory
effects of the caching allocators. ``TORCH_CUDA_SANITIZER=1`` on a GPU covers the stream races
of real kernels.
"""
from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["simulated_cuda", "SimulatedCuda"]


class SimStream:
    """One simulated CUDA stream: an in-order worker thread with random delays."""

    def __init__(self, sim: "SimulatedCuda", index: int, compute: bool, seed: int):
        self.sim = sim
        self.index = index
        self.compute = compute
        self._rng = random.Random(seed)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"sim-cuda:{index}-{'compute' if compute else 'stream'}")
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            delay = self._rng.uniform(0.0, self.sim.max_delay_s)
            if delay:
                time.sleep(delay)
            try:
                fn()
            except BaseException as exc:  # kept, and raised at the next synchronisation
                self.sim.errors.append(exc)

    def wait_event(self, event: "SimEvent") -> None:
        gate = event._gate
        if gate is None:
            return  # an event never recorded: nothing to wait for (as in CUDA)
        self.sim.counts["wait_event"] += 1
        if self.compute:
            # compute work runs on the host when issued, so later compute must wait here
            self.sim.counts["compute_waits"] += 1
            self.sim._wait(gate, "an event the default stream waits on")
        self.submit(lambda: self.sim._wait(gate, "an event a stream waits on"))

    def drain(self) -> None:
        done = threading.Event()
        self.submit(done.set)
        self.sim._wait(done, f"a stream of cuda:{self.index} to drain")

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


class SimEvent:
    """A simulated ``torch.cuda.Event``."""

    def __init__(self, sim: "SimulatedCuda", enable_timing: bool = False, blocking: bool = False):
        self.sim = sim
        self.enable_timing = enable_timing
        self.blocking = blocking
        self._gate: threading.Event | None = None
        self._t: float | None = None
        sim.counts["events"] += 1

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream if stream is not None else self.sim._current()
        gate = threading.Event()
        self._gate, self._t = gate, None

        def fire() -> None:
            if self._gate is gate:
                self._t = self.sim.clock()
            gate.set()
        stream.submit(fire)

    def query(self) -> bool:
        return self._gate is None or self._gate.is_set()

    def synchronize(self) -> None:
        self.sim.counts["host_waits"] += 1
        if not self.blocking:
            self.sim.counts["spin_waits"] += 1  # a real GPU would spin a core here
        if self._gate is not None:
            self.sim._wait(self._gate, "Event.synchronize")
        self.sim.raise_errors()

    def elapsed_time(self, end: "SimEvent") -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self._t is None or end._t is None:
            raise RuntimeError("CUDA error: device not ready (an event of elapsed_time has not completed)")
        return (end._t - self._t) * 1e3


class SimulatedCuda:
    """The simulated runtime: the same methods as :class:`cgdp.engine.backend.cuda.TorchCuda`."""

    simulated = True

    def __init__(self, num_devices: int, seed: int = 0, max_delay_s: float = 0.002,
                 timeout_s: float = 60.0):
        if num_devices < 1:
            raise ValueError(f"simulated_cuda needs at least one device, got {num_devices}")
        self.num_devices = num_devices
        self.seed = seed
        self.max_delay_s = max_delay_s
        self.timeout_s = timeout_s
        self.clock = time.perf_counter
        """The device clock of events (host seconds)."""
        self.counts: Counter = Counter()
        self.copied_bytes: Counter = Counter()
        """Bytes moved by asynchronous copies, by direction ('d2h', 'h2d', 'd2d')."""
        self.registered: dict[int, int] = {}
        """Page-locked host ranges: address → bytes (``cudaHostRegister`` bookkeeping)."""
        self.errors: list[BaseException] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._streams: list[SimStream] = []
        self._default = [self._new_stream(i, compute=True) for i in range(num_devices)]

    # -------------------------------------------------------------- helpers
    def _new_stream(self, index: int, compute: bool) -> SimStream:
        self._check(index)
        with self._lock:
            s = SimStream(self, index, compute, seed=self.seed * 7919 + len(self._streams))
            self._streams.append(s)
        return s

    def _check(self, index: int) -> None:
        if not 0 <= index < self.num_devices:
            raise RuntimeError(f"simulated CUDA: cuda:{index} does not exist ({self.num_devices} devices)")

    def _wait(self, gate: threading.Event, what: str) -> None:
        if not gate.wait(self.timeout_s):
            raise TimeoutError(f"simulated CUDA: {what} did not complete in {self.timeout_s:g} s")

    def _device(self) -> int:
        return getattr(self._local, "device", 0)

    def _current(self) -> SimStream:
        """The calling thread's current stream: its innermost stream context, else the default
        stream of its current device."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.default_stream(self._device())

    def raise_errors(self) -> None:
        if self.errors:
            raise RuntimeError(f"simulated CUDA: work on a stream failed: {self.errors[0]!r}") from self.errors[0]

    def close(self) -> None:
        for s in self._streams:
            s.close()

    # -------------------------------------------------------------- the runtime's methods
    def device_count(self) -> int:
        return self.num_devices

    def torch_device(self, index: int) -> torch.device:
        self._check(index)
        return torch.device("cpu")

    def Stream(self, index: int) -> SimStream:  # noqa: N802
        self.counts["streams"] += 1
        return self._new_stream(index, compute=False)

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> SimEvent:  # noqa: N802
        return SimEvent(self, enable_timing, blocking)

    @contextlib.contextmanager
    def stream(self, s: SimStream) -> Iterator[None]:
        self.counts["stream_contexts"] += 1
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(s)
        try:
            yield
        finally:
            stack.pop()

    def current_stream(self, index: int) -> SimStream:
        stack = getattr(self._local, "stack", None)
        if stack and stack[-1].index == index:
            return stack[-1]
        return self.default_stream(index)

    def default_stream(self, index: int) -> SimStream:
        self._check(index)
        return self._default[index]

    def set_device(self, index: int) -> None:
        self._check(index)
        self._local.device = index

    def synchronize(self, index: int) -> None:
        self.counts["device_syncs"] += 1
        for s in list(self._streams):
            if s.index == index:
                s.drain()
        self.raise_errors()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        s = self._current()
        self.counts["copies"] += 1
        if s.compute:
            dst.copy_(src)  # compute runs when issued
            return
        kind = "d2h" if self._is_host(dst) else "h2d" if self._is_host(src) else "d2d"
        self.copied_bytes[kind] += dst.numel() * dst.element_size()
        s.submit(lambda: dst.copy_(src))

    def _is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in page-locked host memory (what the engine copies to and from)."""
        p = t.data_ptr()
        return any(a <= p < a + n for a, n in self.registered.items())

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(max(numel, 1), dtype=dtype)[:numel]
        self.registered[t.data_ptr()] = max(numel, 1) * t.element_size()
        self.counts["host_register"] += 1
        return t

    def host_free(self, t: torch.Tensor) -> None:
        if self.registered.pop(t.data_ptr(), None) is None:
            raise RuntimeError("simulated CUDA: cudaHostUnregister of memory that is not registered")
        self.counts["host_unregister"] += 1

    def reduce_into_first(self, tensors: Sequence[torch.Tensor]) -> None:
        self.counts["reduce"] += 1
        for t in tensors[1:]:
            tensors[0].add_(t)

    def broadcast(self, tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> list[list[torch.Tensor]]:
        self.counts["broadcast_coalesced"] += 1
        return [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in indices[1:]]

    def rng_key(self, index: int) -> Any:
        return "cpu"  # simulated devices draw from torch's one CPU generator

    def get_rng_state(self, index: int) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        torch.set_rng_state(state)

    def new_rng_state(self, index: int, seed: int) -> torch.Tensor:
        return torch.Generator().manual_seed(seed).get_state()

    # -------------------------------------------------------------- for tests
    def busy(self, seconds: float) -> None:
        """Device work of ``seconds`` on the calling thread's current stream (the host goes on),
        e.g. inside a model's forward: the device's clock then runs behind the host's."""
        self._current().submit(lambda: time.sleep(seconds))


@contextlib.contextmanager
def simulated_cuda(num_devices: int = 2, *, seed: int = 0, max_delay_s: float = 0.002,
                   timeout_s: float = 60.0) -> Iterator[SimulatedCuda]:
    """Inside, ``"cuda:0"`` … ``"cuda:{num_devices-1}"`` run cgdp's CUDA backend on a simulated
    asynchronous runtime over host memory. ``max_delay_s``: the largest random delay before each
    item on a stream (0 keeps order but still runs every stream asynchronously)."""
    from cgdp.engine.backend.cuda import use_runtime
    sim = SimulatedCuda(num_devices, seed=seed, max_delay_s=max_delay_s, timeout_s=timeout_s)
    try:
        with use_runtime(sim):
            yield sim
    finally:
        sim.close()
