"""CUDA devices ``"cuda:N"``: the default compute stream, a D2H stream, an H2D stream, pinned memory.

The only module of cgdp that touches ``torch.cuda``.

* ``send`` runs inside a gradient hook on autograd's thread for this device. It records an event
  on the current (compute) stream, makes the D2H stream wait on it (a device-side wait: the host
  does not synchronise, unlike the paper's per-layer host sync) and enqueues the copy into pinned
  host memory. A completion thread per device then waits on the copy's event (GIL released) and
  tells the host accumulator the chunk has arrived.
* ``give_back`` enqueues the host-to-device copy on the H2D stream; ``compute_wait`` makes the
  compute stream wait on an H2D event, again without a host synchronisation.
* The flat gradient buffer and the pinned slots live for the whole run, so no allocation is
  freed while a side stream still uses it (no ``record_stream`` needed).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch

from cgdp.backend.base import Device
from cgdp.sync import Guard


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class CudaDevice(Device):
    is_cuda = True

    def __init__(self, name: str, index: int, fail: Callable[[BaseException], None]):
        super().__init__(name, fail)
        self.torch_device = torch.device("cuda", index)
        with torch.cuda.device(self.torch_device):
            self.d2h = torch.cuda.Stream(self.torch_device)
            self.h2d = torch.cuda.Stream(self.torch_device)
        self.copies: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        """(label, start, done) device events of the D2H copies of a traced step."""
        self.compute_done: torch.cuda.Event | None = None
        """A device event at the end of backward's compute in a traced step."""
        self._watch: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._complete, name=f"cgdp-{name}-done", daemon=True)
        self._thread.start()

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _timing(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=self.trace is not None)

    def send(self, src, dst, on_arrived, label):
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ready)  # device-side wait: no host synchronisation here
            start = self._timing()
            start.record(self.d2h)
            dst.copy_(src, non_blocking=True)
            done = self._timing()
            done.record(self.d2h)
        if self.trace is not None:
            self.copies.append((label, start, done))
        self._watch.put((start, done, on_arrived, label))

    def _complete(self) -> None:
        while True:
            item = self._watch.get()  # waits for the next copy in flight
            if item is None:
                return
            start, done, on_arrived, label = item
            try:
                done.synchronize()  # note: host waits here, on this thread only, GIL released
                if self.trace is not None:
                    end = time.perf_counter()
                    self.trace(self.name, "d2h", label, end - start.elapsed_time(done) / 1e3, end)
                on_arrived()
            except BaseException as exc:
                self._fail(exc)

    def give_back(self, src, dst, label):
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)

    def h2d_marker(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.h2d)
        return ev

    def compute_wait(self, marker: Any, guard: Guard) -> None:
        # device-side wait: the update kernels queue behind the last H2D copy; the host goes on.
        stream = torch.cuda.current_stream(self.torch_device)
        if self.trace is not None:
            self.compute_done = torch.cuda.Event(enable_timing=True)
            self.compute_done.record(stream)
        stream.wait_event(marker)

    def synchronize(self, guard: Guard) -> None:
        torch.cuda.synchronize(self.torch_device)  # note: host sync point (plan switches, close)

    def close(self) -> None:
        self._watch.put(None)
        self._thread.join(timeout=10)
