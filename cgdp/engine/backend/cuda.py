"""CUDA devices ``"cuda:N"``: the default compute stream, a D2H stream, an H2D stream, pinned memory.

Every CUDA call goes through the *runtime* (:func:`~cgdp.engine.backend.cuda_runtime.runtime`), the only module that
touches ``torch.cuda``; ``cgdp.testing``'s simulated runtime sits beneath it, so CI runs every line here.

* ``send`` runs in a gradient hook on the device's backward thread. Per chunk it records an event on the current stream
  and on every other stream a gradient accumulated on (:meth:`CudaDevice.note_stream`), makes the D2H stream wait on
  them (device-side: no host sync), enqueues one copy per segment into pinned memory and records its blocking-sync
  event. The single host thread waits on each device's event of a segment in turn (sleeping, GIL released).
* Events are made once per plan and re-recorded every step: an untimed step creates no CUDA objects.
* ``give_back`` enqueues the H2D copy; ``compute_wait`` makes the compute stream wait on it, without a host sync. A step
  may return with copies back still running: ``close()`` and anything that frees or relays buffers synchronises first.
* Every thread that calls CUDA works under a guard of its device, so using only ``cuda:1`` never touches GPU 0.
* Flat buffers and host slots (page-locked by ``TorchCuda.host_alloc``) live all run long: no ``record_stream`` needed.
* Replicas sharing a GPU (``share_devices=True``) have their own copy streams and random stream, one compute stream.
* Timing (profiled or traced steps only): timestamps are device events resolved after the step against an anchor.
"""
from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from cgdp.engine.backend.base import Device, Routes
from cgdp.engine.backend.cuda_runtime import runtime
from cgdp.engine.sync import Guard


def cuda_count() -> int:
    return runtime().device_count()


def host_threads(num_replicas: int) -> int:
    """Host-sum threads next to GPUs: every core but one per device thread."""
    return max(1, (os.cpu_count() or 2) - num_replicas)


class CudaDevice(Device):
    is_cuda = True

    def __init__(self, name: str, index: int, fail: Callable[[BaseException], None]):
        super().__init__(name)
        self.rt = runtime()
        self.index = index
        self.torch_device = self.rt.torch_device(index)
        self.d2h = self.rt.Stream(index)
        self.h2d = self.rt.Stream(index)
        self.copies: list[tuple[str, str, Any, Any]] = []
        """(stream, label, start, done) device events of the copies of a timed step."""
        self.compute_done: Any = None
        """A device event right after backward was issued, in a timed step."""
        self._anchor: tuple[Any, float] | None = None
        self._hosts: list[torch.Tensor] = []
        self._grad_streams: list[Any] = []
        """Every stream a gradient has accumulated on (usually the default stream alone)."""
        self._routes: Routes | None = None
        self._marker = self.rt.Event(blocking=True)
        """Recorded on the H2D stream after a step's copies back (``h2d_marker``)."""

    def bind_thread(self) -> None:
        self.rt.set_device(self.index)

    def check_caller(self, what: str = "Trainer.step()") -> None:
        if self.rt.current_stream(self.index) != self.rt.default_stream(self.index):
            raise RuntimeError(f"call {what} outside any torch.cuda.stream(...) context: cgdp orders "
                               f"its copy streams against the default stream of {self.name}, and its "
                               f"buffers live there")

    def host_empty(self, shape, dtype):
        # any stream of this device: what matters is that cuda:N is current, so the registration uses its context (and
        # creates none on the caller's current device)
        with self.rt.stream(self.h2d):
            t = self.rt.host_alloc(math.prod(shape), dtype).view(shape)
        self._hosts.append(t)
        return t

    def host_release(self, t: torch.Tensor) -> None:
        for k, h in enumerate(self._hosts):
            if h is t:
                with self.rt.stream(self.h2d):
                    self.rt.host_free(self._hosts.pop(k))
                return

    def note_stream(self, c: int) -> None:
        """A gradient of chunk ``c`` accumulated on the current stream: that of the forward op that used it, which may
        be a side stream rather than the one whose hook completes the chunk."""
        s = self.rt.current_stream(self.index)
        if s not in self._grad_streams:
            self._grad_streams.append(s)

    def set_routes(self, routes: Routes) -> None:
        self._routes = routes
        rt = self.rt
        self._ready = [rt.Event() for _ in routes.units]
        self._landed = [rt.Event(blocking=True) for _ in routes.d2h]
        self._back = [rt.Event(blocking=True) for _ in range(routes.ring)]

    def send(self, unit):
        rt, r = self.rt, self._routes
        timed = self.trace is not None  # inside a timed step (begin_timing set the anchor)
        current = rt.current_stream(self.index)
        ready = self._ready[unit]
        ready.record(current)
        with rt.stream(self.d2h):
            self.d2h.wait_event(ready)  # device-side wait: no host synchronisation here
            for s in self._grad_streams:
                if s != current:  # every other stream a gradient may have accumulated on
                    ev = rt.Event()
                    ev.record(s)
                    self.d2h.wait_event(ev)
            for s in r.units[unit]:
                src, dst, stage = r.d2h[s]
                if timed:
                    start = self._event_on(self.d2h)
                if stage is not None:
                    rt.copy(stage, src)  # cast on the device: fewer bytes over the bus
                    src = stage
                rt.copy(dst, src)
                self._landed[s].record(self.d2h)
                if timed:
                    self.copies.append(("d2h", r.labels[s], start, self._event_on(self.d2h)))
        r.sent(unit)

    def wait_arrived(self, s: int, guard: Guard) -> None:
        self._landed[s].synchronize()  # note: the host thread waits for this copy, GIL released

    def give_back(self, s):
        rt, r = self.rt, self._routes
        timed = self.trace is not None
        src, dst, stage = r.h2d[s]
        with rt.stream(self.h2d):
            if timed:
                start = self._event_on(self.h2d)
            if stage is not None:
                rt.copy(stage, src)
                src = stage  # widened on the device
            rt.copy(dst, src)
            if r.ring:  # the host row is reused once this copy has read it
                self._back[s % r.ring].record(self.h2d)
            if timed:
                self.copies.append(("h2d", r.labels[s], start, self._event_on(self.h2d)))

    def wait_given_back(self, s: int, guard: Guard) -> None:
        r = self._routes
        if r.ring:
            self._back[s % r.ring].synchronize()  # note: host waits until the copy back has read the slot

    def h2d_marker(self) -> Any:
        self._marker.record(self.h2d)
        return self._marker

    def compute_wait(self, marker: Any, guard: Guard) -> None:
        # device-side wait: the update kernels queue behind the last H2D copy; the host goes on.
        self.rt.current_stream(self.index).wait_event(marker)

    def wait_marker(self, marker: Any, guard: Guard) -> None:
        marker.synchronize()  # note: host sync on the last H2D copy (timed steps only)

    def synchronize(self, guard: Guard) -> None:
        self.rt.synchronize(self.index)  # note: host sync point (plan switches, failures)

    # ---------------------------------------------------------------- timing
    def begin_timing(self) -> None:
        self.copies = []
        self.compute_done = None
        anchor = self._event_on(self.rt.current_stream(self.index))
        anchor.synchronize()  # note: host sync, in timed steps only
        self._anchor = (anchor, time.perf_counter())

    def _event_on(self, stream: Any) -> Any:
        ev = self.rt.Event(enable_timing=True, blocking=True)
        ev.record(stream)
        return ev

    def stamp(self) -> Any:
        if self.trace is None:  # not inside a timed step (``trace`` is set for those only)
            return time.perf_counter()
        return self._event_on(self.rt.current_stream(self.index))

    def backward_issued(self) -> Any:
        self.compute_done = self.stamp()
        return self.compute_done

    def resolve(self, stamp: Any) -> float:
        if isinstance(stamp, (int, float)):
            return float(stamp)
        if self._anchor is None:
            raise RuntimeError(f"a device timestamp of {self.name} outlived its timed step")
        anchor, host0 = self._anchor
        stamp.synchronize()  # note: host waits for the stamped work (timed steps only)
        return host0 + anchor.elapsed_time(stamp) / 1e3

    def end_timing(self) -> None:
        if self.trace is not None:
            for stream, label, start, done in self.copies:
                self.trace(self.name, stream, label, self.resolve(start), self.resolve(done))
        self.trace = None  # later stamps are host times; this step's stay resolvable

    def close(self) -> None:
        """Unregister the host rows once every copy is done (a step's last copies back may still read them)."""
        first: BaseException | None = None
        try:
            self.rt.synchronize(self.index)  # note: host sync before the rows are unregistered
        except BaseException as exc:  # a sticky CUDA error: release the rest anyway
            first = exc
        while self._hosts:
            t = self._hosts.pop()
            try:
                with self.rt.stream(self.h2d):
                    self.rt.host_free(t)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first


# ------------------------------------------------------------------------- typical mode
def reduce_to_first(devs: Sequence[CudaDevice], flats: Sequence[torch.Tensor]) -> None:
    """``flats[0]`` ← the sum of all: one reduce (NCCL across GPUs); replicas sharing a GPU added in device order."""
    indices = [d.index for d in devs]
    if len(set(indices)) < len(indices) or len(flats) == 1:
        for flat in flats[1:]:
            flats[0].add_(flat)
        return
    devs[0].rt.reduce_into_first(flats)


def broadcast_from_first(devs: Sequence[CudaDevice], params: list[list[nn.Parameter]]) -> None:
    """Every replica's parameters ← replica 0's, one coalesced broadcast (as ``nn.DataParallel``)."""
    indices = [d.index for d in devs]
    with torch.no_grad():
        shared = len(set(indices)) < len(indices) or len(params) == 1  # replica 0's own tensors are the source
        sources = [params[0]] * len(params) if shared else devs[0].rt.broadcast(params[0], indices)
        for others, src in zip(params[1:], sources[1:]):
            torch._foreach_copy_(others, src)


# ------------------------------------------------------------------------- random streams
class CudaRNG:
    """One random stream per replica (``manual_seed`` seeds every GPU alike), swapped into its GPU's generator around
    its forward, host-side. Replicas sharing a generator take turns under a lock. Interface of
    :class:`cgdp.engine.backend.rng.EmulatedRNG`."""

    def __init__(self, devs: Sequence[CudaDevice]):
        self._devs = list(devs)
        base = torch.initial_seed()
        self.states = [d.rt.new_rng_state(d.index, cuda_replica_seed(base, j)) for j, d in enumerate(devs)]
        with _RNG_LOCKS_LOCK:  # one lock per generator, shared by every trainer of the process
            self._locks = {k: _RNG_LOCKS.setdefault(k, threading.Lock())
                           for k in {d.rt.rng_key(d.index) for d in devs}}

    may_rerun = False

    def forward_all(self, run: Callable[[], Any], restore: Callable[[], None] = lambda: None) -> Any:
        """Each replica has its own stream from the start: no forward is redone (``restore`` is never needed)."""
        return run()

    def on_device(self, j: int, fn: Callable[[], Any]) -> Any:
        d = self._devs[j]
        with self._locks[d.rt.rng_key(d.index)]:
            outer = d.rt.get_rng_state(d.index)  # the user's stream stays untouched
            d.rt.set_rng_state(self.states[j], d.index)
            try:
                return fn()
            finally:
                self.states[j] = d.rt.get_rng_state(d.index)
                d.rt.set_rng_state(outer, d.index)


_RNG_LOCKS: dict[Any, threading.Lock] = {}
_RNG_LOCKS_LOCK = threading.Lock()


def cuda_replica_seed(base: int, j: int) -> int:
    """Replica j's seed: distinct per replica, within the 64-bit range generators accept."""
    return (base * 6364136223846793005 + 1442695040888963407 * (j + 1)) % (1 << 63)
