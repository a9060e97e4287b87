"""CPU-emulated devices ``"cpu:N"``: replicas in host memory, streams as in-order worker threads.

The compute stream is the device's own host thread: work issued there has already run when the
next line executes, so a compute "event" is always complete. The D2H and H2D streams are worker
threads that execute copies in submission order, exactly like CUDA streams. A marker is a
``threading.Event`` set by the H2D worker when it reaches it. Copies are real memory copies
(``Tensor.copy_``, which releases the GIL), so the emulation moves the same bytes as a GPU would.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch

from cgdp.engine.backend.base import Device
from cgdp.engine.sync import Guard


class Worker:
    """One in-order queue of work on its own thread (an emulated stream)."""

    def __init__(self, name: str, fail: Callable[[BaseException], None]):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._fail = fail
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()  # waits for work; the thread is idle between steps
            if fn is None:
                return
            try:
                fn()
            except BaseException as exc:  # reported to the step, never lost
                self._fail(exc)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


class CpuDevice(Device):
    is_cuda = False

    def __init__(self, name: str, fail: Callable[[BaseException], None]):
        super().__init__(name, fail)
        self.torch_device = torch.device("cpu")
        self._d2h = Worker(f"cgdp-{name}-d2h", fail)
        self._h2d = Worker(f"cgdp-{name}-h2d", fail)

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def send(self, parts, label):
        def copy():
            for src, dst, on_arrived, stage in parts:
                t0 = time.perf_counter()
                if stage is not None:
                    stage.copy_(src)  # the cast a GPU does before the bus
                    src = stage
                dst.copy_(src)
                if self.trace is not None:
                    self.trace(self.name, "d2h", label, t0, time.perf_counter())
                on_arrived()
        self._d2h.submit(copy)

    def give_back(self, src, dst, label, stage=None):
        def copy():
            t0 = time.perf_counter()
            if stage is not None:
                stage.copy_(src)
                dst.copy_(stage)  # widened "on the device"
            else:
                dst.copy_(src)
            if self.trace is not None:
                self.trace(self.name, "h2d", label, t0, time.perf_counter())
        self._h2d.submit(copy)

    def h2d_marker(self) -> threading.Event:
        ev = threading.Event()
        self._h2d.submit(ev.set)
        return ev

    def compute_wait(self, marker: Any, guard: Guard) -> None:
        # note: the emulated compute stream is this host thread, so it waits on the host.
        guard.wait(marker, f"the gradients copied back to {self.name}")

    def settle(self, marker: Any, guard: Guard) -> None:
        pass  # compute_wait already waited on the host

    def synchronize(self, guard: Guard) -> None:
        for w, what in ((self._d2h, "D2H"), (self._h2d, "H2D")):
            ev = threading.Event()
            w.submit(ev.set)
            guard.wait(ev, f"the {what} stream of {self.name} to drain")

    def close(self) -> None:
        self._d2h.close()
        self._h2d.close()
