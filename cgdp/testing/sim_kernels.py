"""Which stream each operator of a simulated device runs on, as torch's CUDA kernels choose it.

Part of :mod:`cgdp.testing.cuda_sim`: :class:`KernelMode` is the simulator's
:class:`~cgdp.testing.stream_check.AccessMode`, on every thread that touches simulated CUDA. What
torch does on a GPU, whichever thread issues the kernel (one that never chose a device included):

* a kernel runs on the calling thread's current stream *of its tensors' device* (the
  dispatcher's device guard), the default stream unless a stream context set another;
* a copy (``copy_``, ``_foreach_copy_``, ``_to_copy``) runs on the source's device when the source
  is device memory, else on the destination's (``aten/src/ATen/native/cuda/Copy.cu``); between two
  devices it is ordered by two barriers: the copy's stream waits for the destination's current
  stream before, and the destination's current stream waits for the copy after;
* a copy between the host and a device without ``non_blocking`` (or into pageable host memory) is
  followed by a synchronisation of its stream (``memcpy_and_sync``), as is a read of device data
  by the host (``.item()``, ``torch.equal``, and every operator whose kernel reads the device:
  :func:`host_waits`); a ``non_blocking`` copy from pageable host memory is staged when issued (the
  source may be reused at once), its device side still queued; a ``_to_copy`` that names no other
  device (a dtype cast) stays on its device, asynchronous;
* an operator over tensors of several devices is an error on CUDA; the test helpers compare
  replicas so, and it is taken as what a valid comparison does: the host reading each device's
  tensors (each read on its device's current stream, then that stream synchronised);
* NCCL's reduce and broadcast (the fakes of :mod:`cgdp.testing.fake_cuda`) run on each device's
  current stream, each input read on its own device's stream (:meth:`KernelMode.collective`).

The barriers and synchronisations are fired as torch fires them on a GPU (its GPU trace
callbacks), so the ordering checker learns them the way it learns them on a GPU.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from cgdp.testing.stream_check import HOST, AccessMode, stream_key, tensor_bytes

__all__ = ["KernelMode"]

aten = torch.ops.aten
COPIES = {aten.copy_.default, aten._foreach_copy_.default, aten._to_copy.default}
HOST_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default,
              aten._linalg_check_errors.default}
"""Operators whose result the host reads: on a GPU each synchronises its stream (one wait)."""
SIZED_BY_DATA = {aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
                 aten.unique_consecutive, aten.unique_dim_consecutive}
"""Operators whose output size is read from the device first (one ``memcpy_and_sync``: Nonzero.cu,
Unique.cu; ``argwhere``, ``where(cond)``, ``nonzero_static`` excepted, go through ``nonzero``)."""
_BOOL = (torch.bool, torch.uint8)
_OFF = object()


class KernelMode(AccessMode):
    """The simulator's access mode: every operator on the stream torch would run it on."""

    def __init__(self, sim: Any):
        super().__init__(sim.checker, lambda tensors: None, self._run)
        self.sim = sim

    # ------------------------------------------------------------------ which stream
    def _devices(self, tensors: list[torch.Tensor]) -> list[int]:
        out: list[int] = []
        for t in tensors:
            d = self.sim.syncs.device_of(t)
            if d is not None and d not in out:
                out.append(d)
        return out

    def _copy_devices(self, func: Any, kwargs: dict, reads: list, writes: list) -> tuple[list[int], list[int]]:
        src, dst = self._devices(reads), self._devices(writes)
        if func is aten._to_copy.default:
            d = self.sim.syncs.index(kwargs.get("device"))
            # a cast that names no other device stays on its device (asynchronous, no host wait):
            # ``x.to(torch.float64)``, ``x.type_as(y)``, or ``x.to(x.device, ...)`` (which torch, to
            # which the tensor is host memory, receives as ``device=cpu``); only a move to the host
            # (``.cpu()``, ``.to("cpu")``) leaves it
            dst = [d] if d is not None else [] if self.sim.syncs.moving_to_host() else src
        return src, dst

    def stream_for(self, func, args, kwargs, reads, writes):
        self.sim._local.operands = (reads, writes)  # (for _run: the mode is shared by threads)
        forced = getattr(self.sim._local, "force", None)
        if forced is not None:
            return None if forced is _OFF else forced
        if func in COPIES:
            src, dst = self._copy_devices(func, kwargs, reads, writes)
            devs = src or dst
        else:
            devs = self._devices(reads + writes)
            if len(devs) > 1:
                return None  # several devices: the host reads each (finish)
        if not devs:  # host work: recorded where it touches page-locked memory a copy may use
            return HOST if any(self.sim.syncs.locked(t) for t in reads + writes) else None
        return stream_key(self.sim.current_stream(devs[0]))

    def alloc_stream(self, func, kwargs, stream):
        if func is aten._to_copy.default and getattr(self.sim._local, "force", None) is None:
            d = self.sim.syncs.index(kwargs.get("device"))
            if d is not None and stream not in (None, HOST) and d != stream[0]:
                return stream_key(self.sim.current_stream(d))  # (empty on the destination, then copy_)
        return stream

    # ------------------------------------------------------------------ around the operator
    def _run(self, func: Any, args: tuple, kwargs: dict, stream: Any) -> Any:
        sim = self.sim
        if stream not in (None, HOST) and func in COPIES and getattr(sim._local, "force", None) is None:
            s = sim.stream_by_key(stream)
            for d in self._others(func, kwargs, s):
                self.barrier(sim.current_stream(d), s)  # the copy waits for the destination
        elif stream is None and getattr(sim._local, "force", None) is None:
            reads, writes = sim._local.operands
            devs = self._devices(reads + writes)
            if len(devs) > 1:
                for d in devs:  # the host reads each device's tensors: they are complete first
                    sim._drain(sim.current_stream(d))
        return sim._execute(func, args, kwargs, stream)

    def _others(self, func: Any, kwargs: dict, s: Any) -> list[int]:
        reads, writes = self.sim._local.operands
        src, dst = self._copy_devices(func, kwargs, reads, writes)
        return [d for d in dict.fromkeys(src + dst) if d != s.device_index]

    def finish(self, func, args, kwargs, stream, reads, writes):
        sim = self.sim
        if getattr(sim._local, "force", None) is not None:
            return
        if stream is None:
            devs = self._devices(reads + writes)
            if len(devs) > 1 and func not in COPIES:
                for d in devs:
                    s = sim.current_stream(d)
                    rr = [r for t in reads + writes if sim.syncs.device_of(t) == d and (r := tensor_bytes(t))]
                    self.checker.access(stream_key(s), rr, [], f"{func.__name__} (host read by "
                                        f"{threading.current_thread().name})")
                    self.synchronize(s)
            return
        if stream == HOST:
            return
        s = sim.stream_by_key(stream)
        if func in COPIES:
            src, dst = self._copy_devices(func, kwargs, reads, writes)
            for d in dict.fromkeys(src + dst):
                if d != s.device_index:
                    self.barrier(s, sim.current_stream(d))  # the destination waits for the copy
            host = [t for t in reads + writes if sim.syncs.device_of(t) is None and tensor_bytes(t)]
            to_host = func is aten._to_copy.default and not dst and src
            nb = _non_blocking(func, args, kwargs)
            pageable_out = func is not aten._to_copy.default and src and any(
                sim.syncs.device_of(t) is None and not sim.syncs.locked(t) for t in writes)
            if (host or to_host) and (src or dst) and (not nb or pageable_out):
                self.synchronize(s)  # memcpy_and_sync (or a copy into pageable memory)
        else:
            waits = host_waits(func, args, kwargs, sim.syncs)
            if waits:
                if not sim.syncs.reading():  # (inside ``.item()`` or ``repr``: counted as that read)
                    sim.syncs.count("read", waits)
                self.synchronize(s)

    # ------------------------------------------------------------------ device-side order
    def barrier(self, before: Any, after: Any) -> None:
        """``after`` waits for the work issued so far on ``before`` (an event record and a
        stream wait, as torch's Copy.cu and NCCL make them), firing the trace callbacks."""
        if before is after:
            return
        sim = self.sim
        with sim._lock:
            sim._events += 1
            eid = 0x10_0000 + sim._events
        gate = threading.Event()
        sim._fire(before.device_index, "EventRecordCallbacks", eid, before.cuda_stream)
        sim._submit(before, gate.set)
        sim._fire(after.device_index, "EventWaitCallbacks", eid, after.cuda_stream)
        if after.compute:
            sim._hold(gate, "a barrier between two devices' streams")
        sim._submit(after, lambda: sim._hold(gate, "a barrier between two devices' streams"))

    def synchronize(self, s: Any) -> None:
        """The host waits for stream ``s`` (a blocking copy's or a read's cudaStreamSynchronize)."""
        self.sim._drain(s)
        self.sim._fire(s.device_index, "StreamSynchronizationCallbacks", s.cuda_stream)

    @contextlib.contextmanager
    def forced(self, stream: Any = None) -> Iterator[None]:
        """Operators of this thread recorded on ``stream`` (None: not recorded), as a fake
        collective records them itself."""
        loc = self.sim._local
        prev, loc.force = getattr(loc, "force", None), _OFF if stream is None else stream
        try:
            yield
        finally:
            loc.force = prev

    def collective(self, reads: dict[int, list[torch.Tensor]], writes: dict[int, list[torch.Tensor]],
                   root: int, what: str) -> None:
        """An NCCL collective: every device's tensors read on its current stream, each of those
        streams ordered before ``root``'s and the written ones after it."""
        sim = self.sim
        rs = sim.current_stream(root)
        for d, ts in reads.items():
            s = sim.current_stream(d)
            self.checker.access(stream_key(s), _ranges(ts), [], what)
            self.barrier(s, rs)
        for d, ts in writes.items():
            s = sim.current_stream(d)
            self.barrier(rs, s)
            self.checker.access(stream_key(s), [], _ranges(ts), what)


def host_waits(func: Any, args: tuple, kwargs: dict, syncs: Any) -> int:
    """How many times a CUDA operator on device data blocks the host (its ``memcpy_and_sync`` and
    ``.item()`` calls, from torch's CUDA kernels), for an operator that runs on a device's stream."""
    if func in HOST_READS:
        return 1
    packet = func.overloadpacket
    if packet in SIZED_BY_DATA:
        return 1
    if packet is aten.index or packet in (aten.index_put_, aten.index_put, aten._index_put_impl_):
        # each boolean index becomes ``nonzero()`` (expandTensors); a put of one host scalar
        # through one mask of the tensor's device is a ``masked_fill_`` instead (canDispatchToMaskedFill)
        indices = [i for i in (args[1] if len(args) > 1 else kwargs.get("indices", [])) if i is not None]
        masks = [i for i in indices if i.dtype in _BOOL and syncs.device_of(i) is not None]
        if packet is not aten.index and masks:
            value = args[2] if len(args) > 2 else kwargs.get("values")
            accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
            if (not accumulate and len(indices) == 1 and syncs.device_of(value) is None
                    and value.numel() == 1 and syncs.device_of(masks[0]) == syncs.device_of(args[0])):
                return 0
        return len(masks)
    if packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor:
        # without output_size: the total and the check that no repeat is negative (Repeat.h)
        repeats = args[0]
        return 2 if kwargs.get("output_size") is None and repeats.numel() > 0 else 0
    if packet is aten.bincount:
        # the check that no value is negative (but for uint8), then the largest value (SummaryOps.cu)
        t = args[0]
        return 0 if t.numel() == 0 else 1 if t.dtype == torch.uint8 else 2
    if packet is aten.histc:
        # min == max (both 0 by default): the range is read from the data, its min and max (SummaryOps.cu)
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return 2 if lo == hi and args[0].numel() > 0 else 0
    return 0


def _ranges(ts: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [r for t in ts if (r := tensor_bytes(t)) is not None]


def _non_blocking(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is aten._to_copy.default:
        return bool(kwargs.get("non_blocking", False))
    return bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
