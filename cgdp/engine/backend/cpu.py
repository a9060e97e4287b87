"""CPU-emulated devices ``"cpu:N"``: replicas in host memory, streams as in-order worker threads.

The compute stream is the device's own thread: a compute "event" is always complete. D2H and H2D streams are workers
that copy in order and count what they finished (a :class:`~cgdp.engine.sync.Progress`): a marker is a count to reach.
Copies are real (``Tensor.copy_``, GIL released).

A hand-off to a worker costs more CPU than copying a few hundred KiB, so copies of at most :data:`INLINE_BYTES` are made
by the thread that issues them (the device thread in its hook, the host thread giving back); larger ones go to the
workers. Either way a copy completes before anything that waits for it.
"""
from __future__ import annotations

import queue
import threading
import time
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from cgdp.engine.backend.base import Device, Routes
from cgdp.engine.sync import Guard, Progress

INLINE_BYTES = 256 << 10


class Worker:
    """An in-order queue on its own thread (an emulated stream); ``progress`` counts copies finished, also failed."""

    def __init__(self, name: str, fail: Callable[[BaseException], None]):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._fail = fail
        self.progress = Progress()
        self.submitted = 0
        """Copies submitted so far (the progress to wait for to see the stream idle)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Progress], None], copies: int) -> int:
        """Run ``fn(progress)`` after everything before it; returns the count at which its last copy is done."""
        self.submitted += copies
        self._q.put((fn, self.submitted))
        return self.submitted

    def _run(self) -> None:
        while (item := self._q.get()) is not None:  # waits for work; the thread is idle between steps
            fn, target = item
            try:
                fn(self.progress)
            except BaseException as exc:  # reported to the step, never lost
                self._fail(exc)
            finally:
                left = target - self.progress.done
                if left > 0:  # a failed item still counts as finished: no waiter hangs on it
                    self.progress.advance(left)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


def _as_numpy(route) -> tuple[np.ndarray, np.ndarray] | None:
    """(source, destination) as NumPy arrays, for a copy without a stage between dtypes NumPy has."""
    src, dst, stage = route
    if stage is not None or src.dtype != dst.dtype or src.dtype == torch.bfloat16:
        return None
    return src.numpy(), dst.numpy()


class CpuDevice(Device):
    def __init__(self, name: str, fail: Callable[[BaseException], None]):
        super().__init__(name)
        self.torch_device = torch.device("cpu")
        self._d2h = Worker(f"cgdp-{name}-d2h", fail)
        self._h2d = Worker(f"cgdp-{name}-h2d", fail)
        self._routes: Routes | None = None

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def set_routes(self, routes: Routes) -> None:
        self._routes = routes
        self._landed = [0] * len(routes.d2h)  # per segment: the D2H progress at which it has landed (0: copied inline)
        self._back = [0] * len(routes.h2d)  # per segment: the H2D progress at which it is back (0: copied inline)
        self._inline_out = [b <= INLINE_BYTES for b in routes.unit_bytes]
        self._inline_back = [b <= INLINE_BYTES for b in routes.segment_bytes]
        # a small copy of one dtype to the same is a NumPy copy (a fifth of torch's dispatch)
        self._np_out = [_as_numpy(r) for r in routes.d2h]
        self._np_back = [_as_numpy(r) for r in routes.h2d]

    def send(self, unit: int) -> None:
        r = self._routes
        if self._inline_out[unit]:
            # on the device thread, inside the hook: the chunk is complete (compute is this thread)
            landed, fast = self._landed, self._np_out
            for s in r.units[unit]:
                landed[s] = 0
                pair = fast[s]
                if pair is not None and self.trace is None:
                    np.copyto(pair[1], pair[0])
                else:
                    self._copy(r.d2h[s], "d2h", r.labels[s])
        else:
            segs = r.units[unit]
            done = self._d2h.submit(partial(self._copy_all, segs, r.d2h, "d2h", r.labels), len(segs))
            for at, s in enumerate(segs, done - len(segs) + 1):  # the progress at which segment s has landed
                self._landed[s] = at
        r.sent(unit)

    def _copy(self, route, stream: str, label: str) -> None:
        src, dst, stage = route
        t0 = time.perf_counter() if self.trace is not None else 0.0
        if stage is not None:  # the cast a GPU does before the bus (D2H), or the widening after it
            stage.copy_(src)
            src = stage
        dst.copy_(src)
        if self.trace is not None:
            self.trace(self.name, stream, label, t0, time.perf_counter())

    def _copy_all(self, segs: range, routes: list, stream: str, labels: list[str], progress: Progress) -> None:
        for s in segs:
            self._copy(routes[s], stream, labels[s])
            progress.advance()

    def wait_arrived(self, s: int, guard: Guard) -> None:
        at = self._landed[s]
        if at:
            # note: the host thread waits for this device's D2H stream to reach the segment
            self._d2h.progress.wait(at, guard, f"the copy of a segment from {self.name}")

    def give_back(self, s: int) -> None:
        r = self._routes
        if self._inline_back[s]:
            self._back[s] = 0
            pair = self._np_back[s]
            if pair is not None and self.trace is None:  # on the host thread: done before it reports
                np.copyto(pair[1], pair[0])
            else:
                self._copy(r.h2d[s], "h2d", r.labels[s])
        else:
            self._back[s] = self._h2d.submit(partial(self._copy_all, range(s, s + 1), r.h2d, "h2d", r.labels), 1)

    def wait_given_back(self, s: int, guard: Guard) -> None:
        at = self._back[s]
        if at:
            self._h2d.progress.wait(at, guard, f"the copy of a segment back to {self.name}")

    def h2d_marker(self) -> int:
        return self._h2d.submitted

    def compute_wait(self, marker: Any, guard: Guard) -> None:
        # note: the emulated compute stream is this host thread, so it waits on the host (wait_marker: nothing left)
        self._h2d.progress.wait(marker, guard, f"the gradients copied back to {self.name}")

    def synchronize(self, guard: Guard) -> None:
        for w, what in ((self._d2h, "D2H"), (self._h2d, "H2D")):
            w.progress.wait(w.submitted, guard, f"the {what} stream of {self.name} to drain")

    def close(self) -> None:
        self._d2h.close()
        self._h2d.close()
