"""The host side of one machine: pinned slots, the accumulator, and the copy back.

Buffers (owned here, alive for the whole run): ``slots[j]`` receives device j's chunks (D2H), and
``acc`` holds the averaged gradient that goes back to every device (H2D); pinned on CUDA. That is
(G + 1) × the gradient bytes of host memory. For bf16/fp16 parameters (:mod:`cgdp.engine.core.precision`)
``acc`` is a float32 row of its own, and the copy-back row (16-bit) receives each averaged chunk
rounded once: (G + 1) × 2 + 4 bytes per element. Without a comm the kernel rounds each block in
the summing pass itself; with one, the chunk is rounded after its allreduce (one more read).

With ``grad_transfer="bf16"`` the host's dtype is the wire's (bf16) while the parameters are
float32: the same 16-bit path, and each device widens what comes back into its float32 gradient
(its *stage* buffers, :mod:`cgdp.engine.core.stream`). Error bound of the bf16 wire, per element, for
parts g_j (already weighted) and their exact sum g: |result - g| <= 2^-8 (sum_j |g_j| + |g|) +
G 2^-24 sum_j |g_j| (one bf16 rounding of every part, float32 additions, one bf16 rounding of the
sum); deterministic (device order, round to nearest even).

The host works on segments of chunks (:mod:`cgdp.engine.core.flatgrad`); "chunk" below means either.

Threads: the devices' D2H completions call :meth:`arrived` (any thread). When a chunk has arrived
from all G devices it is queued to the single accumulator thread, which sums it in device order
with the Numba kernel (nogil, itself multi-threaded), so the result never depends on arrival order.
Without a comm, the chunk goes straight back to the devices; with one, chunks are posted to the
comm in plan order (a chunk that is ready early waits for its predecessors, so every rank runs the
same collectives in the same order), and each comes back when its allreduce completes.

Gradient norm (``want_sumsq``, for clipping): ``sumsq[c]`` is the sum of squares of segment c of
the averaged gradient. Without a comm the kernel returns it from the summing pass itself; with one,
the norm must be that of the values summed across ranks, so it is taken after the allreduce, on
the comm-completion path (one more read of the reduced segment, while it is still in cache).
:meth:`grad_norm` adds the segments in segment order: the same bits whatever the thread count.
"""
from __future__ import annotations

import queue
import threading
import time
from functools import partial
from typing import Callable

import numpy as np
import torch

from cgdp.comm import Comm
from cgdp.engine.backend.base import Device, TraceSink
from cgdp.engine.core.accumulate import accumulate_unchecked, round_into, set_threads, sum_of_squares
from cgdp.engine.core.precision import host_array, sum_dtype


class HostAccumulator:
    def __init__(self, devices: list[Device], dtype: torch.dtype, fail: Callable[[BaseException], None],
                 comm: Comm | None, threads: int):
        self.devices = devices
        self.dtype = dtype
        self.comm = comm
        self._fail = fail
        self._threads = threads
        self.trace: TraceSink | None = None
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cgdp-host-accumulate", daemon=True)
        self._thread.start()
        self.total = -1
        self.bounds: list[tuple[int, int]] = []
        self.flats: list[torch.Tensor] = []
        self.returned = threading.Event()
        self.bad: list[int] = []
        self._host: torch.Tensor | None = None
        self._sum: torch.Tensor | None = None
        self.stages: list[torch.Tensor] | None = None
        """Per device, the wire-dtype buffer a copy back goes through (None: straight)."""
        self.want_sumsq = False
        """Whether this step's segments' sums of squares are computed (``sumsq``)."""
        self.sumsq: list[float] = []

    def set_layout(self, total: int, bounds: list[tuple[int, int]], flats: list[torch.Tensor],
                   labels: list[str], stages: list[torch.Tensor] | None = None) -> None:
        """Called between steps only, when no copy is in flight."""
        if total != self.total:
            g = len(self.devices)
            for old in (self._host, self._sum):  # (the sum as a row of _host is no allocation)
                if old is not None:
                    self.devices[0].host_release(old)
            # one allocation: rows 0..G-1 are the devices' slots, row G what goes back (the
            # accumulator itself, unless the sum is wider than the gradients)
            self._host = self.devices[0].host_empty((g + 1, max(total, 1)), self.dtype)
            self._host_np = host_array(self._host)
            wide = sum_dtype(self.dtype)
            self._back_np: np.ndarray | None = None  # the copy-back row, if it is not the sum
            if wide == self.dtype:
                self._sum = self._host[g]
            else:
                self._sum = self.devices[0].host_empty((max(total, 1),), wide)
                self._back_np = self._host_np[g]
            self._sum_np = self._sum.numpy()
            self.total = total
        self.bounds = list(bounds)
        self.labels = list(labels)
        self.flats = flats
        self.stages = stages

    @property
    def acc(self) -> np.ndarray:
        """The averaged gradient (in the summing dtype)."""
        return self._sum_np[:self.total]

    def slot(self, j: int) -> torch.Tensor:
        return self._host[j]

    def begin_step(self) -> None:
        n = len(self.bounds)
        self._counts = [0] * n
        self._ready = [False] * n
        self._next_post = 0
        self._returned = 0
        self.bad = [0] * n
        self.sumsq = [0.0] * n
        self.returned = threading.Event()
        if n == 0:
            self.returned.set()

    def arrived(self, j: int, c: int) -> None:
        with self._lock:
            self._counts[c] += 1
            full = self._counts[c] == len(self.devices)
        if full:
            self._q.put(c)

    def _run(self) -> None:
        set_threads(self._threads)  # Numba's thread count is per calling thread: set it here
        while True:
            c = self._q.get()  # waits for the next chunk that every device delivered
            if c is None:
                return
            try:
                if callable(c):
                    c()
                else:
                    self._accumulate(c)
            except BaseException as exc:
                self._fail(exc)

    def _accumulate(self, c: int) -> None:
        lo, hi = self.bounds[c]
        g = len(self.devices)
        h = self._host_np
        t0 = time.perf_counter()
        back = self._back_np[lo:hi] if self._back_np is not None and self.comm is None else None
        self.bad[c], sq = accumulate_unchecked(self._sum_np[lo:hi], tuple(h[j, lo:hi] for j in range(g)),
                                               1.0, self.want_sumsq and self.comm is None, back)
        self.sumsq[c] = sq
        if self.trace is not None:
            self.trace("host", "accumulate", self.labels[c], t0, time.perf_counter())
        if self.comm is None:
            self._give_back(c)
            return
        self._ready[c] = True
        # post in plan order only: the same collectives in the same order on every rank
        while self._next_post < len(self.bounds) and self._ready[self._next_post]:
            k = self._next_post
            klo, khi = self.bounds[k]
            self.comm.post(k, self._sum_np[klo:khi], partial(self._reduced, k, time.perf_counter()))
            self._next_post += 1

    def _reduced(self, c: int, t_post: float) -> None:
        """Comm thread: chunk ``c`` has been summed across all ranks."""
        if self.trace is not None:
            self.trace("host", "comm", self.labels[c], t_post, time.perf_counter())
        lo, hi = self.bounds[c]
        if self.want_sumsq:  # the global norm: of the values summed across ranks (one more read)
            self.sumsq[c] = sum_of_squares(self._sum_np[lo:hi])
        if self._back_np is not None:  # the float32 sum over all ranks, rounded once
            round_into(self._sum_np[lo:hi], self._back_np[lo:hi])
        self._give_back(c)

    def _give_back(self, c: int) -> None:
        lo, hi = self.bounds[c]
        src = self._host[-1, lo:hi]
        for j, (dev, flat) in enumerate(zip(self.devices, self.flats)):
            dev.give_back(src, flat[lo:hi], self.labels[c], None if self.stages is None else self.stages[j][lo:hi])
        with self._lock:
            self._returned += 1
            last = self._returned == len(self.bounds)
        if last:
            self.returned.set()

    def sum_of_squares(self) -> float:
        """Of this step's averaged gradient, once every segment is back (segment order)."""
        total = 0.0
        for sq in self.sumsq:
            total += sq
        return total

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until the accumulator thread has finished what was queued (after a failed step)."""
        ev = threading.Event()
        self._q.put(ev.set)
        return ev.wait(timeout)  # note: host waits for the accumulator thread

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)
        self._host = self._sum = None
        self._host_np = self._sum_np = None

