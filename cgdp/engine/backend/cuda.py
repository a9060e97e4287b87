"""CUDA devices ``"cuda:N"``: the default compute stream, a D2H stream, an H2D stream, pinned memory.

The only module of cgdp that touches ``torch.cuda``.

* ``send`` runs inside a gradient hook on autograd's thread for this device, whose current stream
  is the one the gradient was accumulated on. It records an event there, makes the D2H stream wait
  on it (a device-side wait: the host does not synchronise, unlike the paper's per-layer host
  sync) and enqueues the copy into pinned host memory. A completion thread per device then waits
  on the copy's event (a blocking-sync event: the thread sleeps, GIL released, instead of spinning
  a core the host sum needs) and tells the host accumulator the chunk has arrived.
* ``give_back`` enqueues the host-to-device copy on the H2D stream; ``compute_wait`` makes the
  compute stream wait on an H2D event, again without a host synchronisation.
* The flat gradient buffer and the pinned slots live for the whole run, so no allocation is
  freed while a side stream still uses it (no ``record_stream`` needed; pinned memory used by
  non-blocking copies is also protected by the caching host allocator's events).
* Timing (profiled or traced steps only): every timestamp is a device event, resolved after the
  step against an anchor event whose host time is known.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch

from cgdp.engine.backend.base import Device
from cgdp.engine.sync import Guard


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
        self.copies: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        """(stream, label, start, done) device events of the copies of a timed step."""
        self.compute_done: torch.cuda.Event | None = None
        """A device event right after backward was issued, in a timed step."""
        self._anchor: tuple[torch.cuda.Event, float] | None = None
        self._watch: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._complete, name=f"cgdp-{name}-done", daemon=True)
        self._thread.start()

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.torch_device)

    def check_caller(self) -> None:
        if torch.cuda.current_stream(self.torch_device) != torch.cuda.default_stream(self.torch_device):
            raise RuntimeError("call Trainer.step() outside any torch.cuda.stream(...) context: cgdp "
                               "orders its own copy streams against the default stream")

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=self.trace is not None, blocking=True)

    def send(self, src, dst, on_arrived, label):
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ready)  # device-side wait: no host synchronisation here
            start = self._event()
            start.record(self.d2h)
            dst.copy_(src, non_blocking=True)
            done = self._event()
            done.record(self.d2h)
        if self.trace is not None:
            self.copies.append(("d2h", label, start, done))
        self._watch.put((done, on_arrived))

    def _complete(self) -> None:
        while True:
            item = self._watch.get()  # waits for the next copy in flight
            if item is None:
                return
            if isinstance(item, threading.Event):  # a drain marker from synchronize()
                item.set()
                continue
            done, on_arrived = item
            try:
                done.synchronize()  # note: host waits here, on this thread only, GIL released
                on_arrived()
            except BaseException as exc:
                self._fail(exc)

    def give_back(self, src, dst, label):
        with torch.cuda.stream(self.h2d):
            if self.trace is not None:
                start = self._event()
                start.record(self.h2d)
            dst.copy_(src, non_blocking=True)
            if self.trace is not None:
                done = self._event()
                done.record(self.h2d)
                self.copies.append(("h2d", label, start, done))

    def h2d_marker(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(blocking=True)
        ev.record(self.h2d)
        return ev

    def compute_wait(self, marker: Any, guard: Guard) -> None:
        # device-side wait: the update kernels queue behind the last H2D copy; the host goes on.
        torch.cuda.current_stream(self.torch_device).wait_event(marker)

    def settle(self, marker: Any, guard: Guard) -> None:
        marker.synchronize()  # note: host sync on the last H2D copy, so exposed time is measured

    def synchronize(self, guard: Guard) -> None:
        torch.cuda.synchronize(self.torch_device)  # note: host sync point (plan switches, failures)
        ev = threading.Event()
        self._watch.put(ev)  # and every completion already noticed has been delivered
        guard.wait(ev, f"the copy completions of {self.name}")

    # ---------------------------------------------------------------- timing
    def begin_timing(self) -> None:
        self.copies = []
        self.compute_done = None
        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record(torch.cuda.current_stream(self.torch_device))
        anchor.synchronize()  # note: host sync, in timed steps only
        self._anchor = (anchor, time.perf_counter())

    def stamp(self) -> Any:
        if self._anchor is None:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.torch_device))
        return ev

    def backward_issued(self) -> Any:
        self.compute_done = self.stamp()
        return self.compute_done

    def resolve(self, stamp: Any) -> float:
        if isinstance(stamp, torch.cuda.Event) and self._anchor is not None:
            anchor, host0 = self._anchor
            return host0 + anchor.elapsed_time(stamp) / 1e3
        return float(stamp)

    def end_timing(self) -> None:
        if self.trace is not None:
            for stream, label, start, done in self.copies:
                self.trace(self.name, stream, label, self.resolve(start), self.resolve(done))
        self._anchor = None

    def close(self) -> None:
        self._watch.put(None)
        self._thread.join(timeout=10)
