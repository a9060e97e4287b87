"""The host side of one machine: pinned slots, the accumulator, and the copy back.

Buffers (owned here): each device's segments land in its *slot* row (D2H); the sum goes back to every device from one
more row (H2D). Either full-size rows, (G + 1) × the gradient bytes, or a ring (``host_memory=``): ``ring`` slots of one
segment, segment s in slot ``s mod ring``. In a ring, segments travel in plan order; a device sends segment s only once
the host has summed s − ring, and the host sums s only once every copy back of s − ring has read the sum row. This never
deadlocks: the earliest unsummed segment has a free slot on every device that has not sent it. Both layouts give bitwise
the same sums.

16-bit rows (bf16/fp16 parameters, ``grad_transfer="bf16"``): summed in float32 and, without a comm, rounded back per
block in cache (no float32 row); with a comm the float32 sum has its own row for the allreduce and is rounded after it.
Error of the bf16 wire per element: |result - g| <= 2^-8 (Σ|g_j| + |g|) + G 2^-24 Σ|g_j|; deterministic.

Threads: a device's ``send`` reports each unit to :class:`Arrivals`; a unit every device has reported is queued to the
single accumulator thread, which waits for each device's copy in turn, sums in device order (so the result never depends
on arrival order) and issues the copies back. With a comm, segments are posted in plan order so every rank runs the same
collectives in the same order.

``want_sumsq``: the summing pass also takes each segment's sum of squares (``sumsq``, added in segment order).
"""
from __future__ import annotations

import functools
import queue
import threading
import time
from typing import Callable

import torch

from cgdp.comm import Comm
from cgdp.engine.backend.base import Device, Routes, TraceSink
from cgdp.engine.core.accumulate import accumulate_unchecked, round_into, set_threads, sum_of_squares
from cgdp.engine.core.flatgrad import Layout
from cgdp.engine.core.precision import host_array, sum_dtype
from cgdp.engine.sync import Guard, Progress


class Arrivals:
    """Counts, per unit, the devices that sent it and queues it once all have. Refers to no device (no routes <-> host
    cycle)."""

    def __init__(self, devices: int, q: queue.SimpleQueue):
        self.counts: list[int] = []
        self.devices = devices
        self._lock = threading.Lock()
        self._q = q

    def arrived(self, u: int) -> None:
        """A device has sent unit ``u`` (called from its ``send``; any thread)."""
        with self._lock:
            self.counts[u] += 1
            if self.counts[u] == self.devices:
                self._q.put(u)  # under the lock: units are queued in the order they completed


class HostAccumulator:
    def __init__(self, devices: list[Device], dtype: torch.dtype, guard: Guard, comm: Comm | None,
                 threads: int):
        self.devices = devices
        self.dtype = dtype
        """The dtype on the wire and in the slots."""
        self.comm = comm
        self._guard = guard
        self.trace: TraceSink | None = None
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.arrivals = Arrivals(len(devices), self._q)
        # named after its first device: it works under that device (CUDA), and two trainers' host threads (two
        # in-process ranks) tell apart
        self._thread = threading.Thread(target=self._run, args=(threads,), name=f"cgdp-host-{devices[0].name}",
                                        daemon=True)
        self._thread.start()
        self.ring = 0
        self._rows: list[torch.Tensor] = []
        self._host: torch.Tensor | None = None
        self.registered_bytes = 0
        """Host memory registered (pinned) for the slots and the sum, in bytes."""
        self.returned = threading.Event()
        self.summed = Progress()
        """Segments summed this step (in plan order with a ring: what frees a slot's rows)."""
        self._given = Progress()
        """Segments whose copies back were issued this step."""
        self.bad: list[int] = []
        self.scale = 1.0
        """Every sum's factor, before any allreduce (DataParallel's 1/R: the mean over ranks)."""
        self.want_sumsq = False
        """Whether this step's segments' sums of squares are computed (``sumsq``)."""
        self.sumsq: list[float] = []
        self.send_back = True
        """Whether sums are copied back (False: the host optimizer reads them, :mod:`cgdp.engine.core.host_update`)."""
        self.on_summed: Callable[[int], None] | None = None
        """Called with each unit once all its sums are final (as its last segment is given back: they go in order), on
        that thread, before it counts as returned: the host update."""
        self.units: list[range] = []
        self._nseg = self._elems = 0

    def set_layout(self, layout: Layout, flats: list[torch.Tensor], stages: list[torch.Tensor] | None,
                   ring: int = 0) -> list[Routes]:
        """Lay out the rows for ``layout`` (``ring`` slots, or 0 for full-size) and return every device's routes;
        between steps."""
        segs = layout.segments
        width = max((b - a for a, b in segs), default=1) if ring else layout.total
        ring = min(ring, len(segs))
        wide = sum_dtype(self.dtype)
        keep_wide = wide != self.dtype and self.comm is not None  # the float32 sum for the allreduce
        self._allocate_rows(max((ring or 1) * width, 1), wide, keep_wide)
        self.ring = ring
        # each segment's place: its own in full-size rows, slot ``s mod ring`` (``width`` columns) in a ring
        places = segs if not ring else [((s % ring) * width, (s % ring) * width + hi - lo)
                                        for s, (lo, hi) in enumerate(segs)]
        self._split_rows(places, wide, keep_wide)
        self.units = [range(s, s + 1) for s in range(len(segs))] if ring else list(layout.chunk_segments)
        self._ends = {u[-1]: k for k, u in enumerate(self.units) if u}  # a unit's last segment -> the unit
        self.labels = [f"chunk {c}" for c in layout.segment_chunk]
        self._nseg = len(segs)
        self._elems = sum(b - a for a, b in segs)
        # every device's routes: flat gradient (through its stage) to its slot row, and back from the sum row
        g, host = len(self.devices), self._host
        seg_bytes = [(b - a) * host.element_size() for a, b in segs]
        unit_bytes = [max((seg_bytes[s] for s in u), default=0) * len(u) for u in self.units]
        routes = []
        for j, flat in enumerate(flats):
            stage = stages[j] if stages else None
            d2h, h2d = [], []
            for (lo, hi), (a, b) in zip(segs, places):
                st = None if stage is None else stage[lo:hi]
                d2h.append((flat[lo:hi], host[j, a:b], st))
                h2d.append((host[g, a:b], flat[lo:hi], st))
            routes.append(Routes(d2h, h2d, self.units, unit_bytes, seg_bytes, self.labels,
                                 self.arrivals.arrived, self.ring))
        return routes

    def _allocate_rows(self, cols: int, wide: torch.dtype, keep_wide: bool) -> None:
        """(Re)allocate the registered rows only when their width or the float32 row changed."""
        if self._host is not None and self._host.shape[1] == cols and keep_wide == (len(self._rows) == 2):
            return
        self._release()
        dev0 = self.devices[0]
        # one allocation: rows 0..G-1 are the devices' slots, row G what goes back (the sum itself, unless the sum is
        # wider than the gradients)
        self._rows = [dev0.host_empty((len(self.devices) + 1, cols), self.dtype)]
        if keep_wide:
            self._rows.append(dev0.host_empty((cols,), wide))
        self.registered_bytes = sum(r.numel() * r.element_size() for r in self._rows)
        self._host = self._rows[0]

    def _split_rows(self, places: list[tuple[int, int]], wide: torch.dtype, keep_wide: bool) -> None:
        """Each segment's views of the rows: the parts; the sum (``_out``, what comm and sumsq read): in place in the
        row that goes back, or (wider than the wire) a float32 row allreduced and then rounded into the row back
        (``_back``), or None: rounded in the summing pass, the float32 sum never reaches memory."""
        g = len(self.devices)
        rows = host_array(self._host)
        wide_row = self._rows[1].numpy() if keep_wide else None
        self._parts = [tuple(rows[j, a:b] for j in range(g)) for a, b in places]
        self._back = [None if wide == self.dtype else rows[g, a:b] for a, b in places]
        self._out = [rows[g, a:b] if wide == self.dtype else wide_row[a:b] if keep_wide else None for a, b in places]

    def traffic(self) -> dict[str, int]:
        """Bytes the host side moves per step, by what moves them (all devices together)."""
        g = len(self.devices)
        n = self._elems
        wire = n * self._host.element_size()
        # with a float32 row: float32 written, allreduced, read again and rounded
        out = {"d2h_write": g * wire, "sum_read": g * wire, "h2d_read": g * wire,
               "sum_write": n * 4 + n * 4 + wire if len(self._rows) == 2 else wire}
        out["total"] = sum(out.values())
        return out

    def begin_step(self) -> None:
        n = self._nseg
        self.arrivals.counts = [0] * len(self.units)
        self._ready = [False] * n
        self._next_post = 0
        self.bad = [0] * n
        self.sumsq = [0.0] * n
        self.summed.reset()
        self._given.reset()
        self.returned = threading.Event()
        if n == 0:
            self.returned.set()

    def _run(self, threads: int) -> None:
        set_threads(threads)  # Numba's thread count is per calling thread: set it here
        try:  # CUDA: this thread's event waits and copies back use a device of this process
            self.devices[0].bind_thread()
        except BaseException as exc:
            self._guard.fail(exc)
        while True:
            u = self._q.get()  # waits for the next unit that every device sent
            if u is None:
                return
            try:
                if callable(u):
                    u()
                else:
                    for s in self.units[u]:
                        self._segment(s)
            except BaseException as exc:
                self._guard.fail(exc)

    def _segment(self, s: int) -> None:
        guard = self._guard
        for dev in self.devices:
            dev.wait_arrived(s, guard)  # note: host waits for this segment's copy from each device
        if self.ring and s >= self.ring:
            # the sum row of this slot is read by the copies back of segment s - ring
            self._given.wait(s - self.ring + 1, guard, "the copy back of an earlier segment to be issued")
            for dev in self.devices:
                dev.wait_given_back(s - self.ring, guard)
        t0 = time.perf_counter() if self.trace is not None else 0.0
        self.bad[s], self.sumsq[s] = accumulate_unchecked(
            self._out[s], self._parts[s], self.scale, self.want_sumsq and self.comm is None, self._back[s])
        self.summed.advance()
        if self.comm is None:
            self._give_back(s)
        if self.trace is not None:  # the host thread's time on the segment: the sum and issuing its copies back
            self.trace("host", "accumulate", self.labels[s], t0, time.perf_counter())
        if self.comm is None:
            return
        self._ready[s] = True
        # post in plan order only: the same collectives in the same order on every rank
        while self._next_post < self._nseg and self._ready[self._next_post]:
            k = self._next_post
            self.comm.post(k, self._out[k], functools.partial(self._reduced, k, time.perf_counter()))
            self._next_post += 1

    def _reduced(self, s: int, t_post: float) -> None:
        """Comm thread: segment ``s`` has been summed across all ranks."""
        if self.trace is not None:
            self.trace("host", "comm", self.labels[s], t_post, time.perf_counter())
        if self.want_sumsq:  # the global norm: of the values summed across ranks (one more read)
            self.sumsq[s] = sum_of_squares(self._out[s])
        if self._back[s] is not None:  # the float32 sum over all ranks, rounded once
            round_into(self._out[s], self._back[s])
        self._give_back(s)

    def _give_back(self, s: int) -> None:
        if self.send_back:
            for dev in self.devices:
                dev.give_back(s)
        if self.on_summed is not None and s in self._ends:
            self.on_summed(self._ends[s])
        self._given.advance()
        if self._given.done == self._nseg:
            self.returned.set()

    def sum_row(self) -> torch.Tensor | None:
        """The row holding every segment's sum in the flat layout (full-size rows, 32/64-bit wire), once summed; else
        None."""
        if self.ring or self._host is None or sum_dtype(self.dtype) != self.dtype:
            return None
        return self._host[len(self.devices)]

    def rounded_row(self) -> torch.Tensor | None:
        """With a 16-bit wire and full-size rows, the row of sums rounded once, in the flat layout; else None."""
        if self.ring or self._host is None or sum_dtype(self.dtype) == self.dtype:
            return None
        return self._host[len(self.devices)]

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until the accumulator thread has finished what was queued (after a failed step)."""
        ev = threading.Event()
        self._q.put(ev.set)
        return ev.wait(timeout)  # note: host waits for the accumulator thread

    def _release(self) -> None:
        for row in self._rows:
            self.devices[0].host_release(row)
        self._rows = []
        self._host = None
        self.registered_bytes = 0

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)
        self._rows = []
        self._host = None
        self._parts = self._out = self._back = []
