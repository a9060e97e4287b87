"""Steps 3 to 6 of the data path for G replicas: hooks, flat buffers, the host, the copy back.

:class:`GradientStream`, shared by both faces, owns for the whole run: one flat gradient buffer per device in chunk
order (:mod:`~.flatgrad`; every ``param.grad`` is a view into it), one :class:`~.hooks.DeviceHooks` per replica
(writing the owner's :class:`~.hooks.StepMarks`), and (streaming only) the :class:`~.host.HostAccumulator`.

``transfer=torch.bfloat16``: segments are cast to bf16 on the device and summed by the host's 16-bit path
(:mod:`cgdp.engine.core.precision`). Each device's bf16 *stage* buffer serves both directions: a segment's copy back is
issued only after every device's copy out of it has completed.

``host_memory``: the host slots are a ring (:mod:`cgdp.engine.core.host`); devices send segments in plan order, and a
segment whose slot is busy waits, without blocking the hook, for a later hook or the flush; only the flush waits.

The stream is transport: the gradients' state belongs to :mod:`cgdp.engine.core.gradients`. Per backward (the owner
reset the marks): :meth:`arm` → backward (hooks send) → per device :meth:`flush`, :meth:`wait_returned` →
:meth:`bad_count` → :meth:`disarm`. :meth:`set_plan` and :attr:`want_norm` only between steps.
"""
from __future__ import annotations

import functools
import math
import operator
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from cgdp.comm import Comm
from cgdp.engine.backend.base import Device, TraceSink
from cgdp.engine.core.clip import device_norm, scale_gradients
from cgdp.engine.core.flatgrad import Layout, align, attach_grads, make_layout
from cgdp.engine.core.hooks import DeviceHooks, StepMarks
from cgdp.engine.core.host import HostAccumulator
from cgdp.engine.core.layers import nonfinite_layers
from cgdp.engine.core.lifetime import weak_call
from cgdp.engine.core.precision import LOW_PRECISION, kernel_dtype
from cgdp.engine.sync import Guard
from cgdp.planning.chunks import Plan


class GradientStream:
    def __init__(self, devs: Sequence[Device], params: Sequence[Sequence[nn.Parameter]],
                 layer_pids: Sequence[Sequence[int]], dtype: torch.dtype, marks: StepMarks, *, segment_bytes: int,
                 streaming: bool, guard: Guard, comm: Comm | None, host_threads: int,
                 transfer: torch.dtype | None = None, host_memory: int | None = None):
        """``params[j]``: replica j's trainable parameters; ``layer_pids[l]``: layer l's parameter ids; ``host_memory``:
        registered bytes for a ring, or None for full-size rows."""
        self.devs = list(devs)
        self.params = [list(p) for p in params]
        self.layer_pids = [list(p) for p in layer_pids]
        self.numels = [p.numel() for p in self.params[0]]
        self.dtype = dtype
        self._segment = segment_bytes
        self._guard = guard
        self.streaming = streaming
        self.transfer = transfer
        """The dtype on the wire, when it is not ``dtype`` (only ``torch.bfloat16``)."""
        self.wire_itemsize = (transfer or dtype).itemsize
        """Bytes per element over the bus."""
        self.flats: list[torch.Tensor] = []
        self.stages: list[torch.Tensor] | None = None
        self.layout: Layout | None = None
        self.marks = marks
        self.host: HostAccumulator | None = None
        self.ring = 0 if host_memory is None or not streaming else ring_slots(
            host_memory, len(self.devs), segment_bytes, self.wire_itemsize,
            widened=(transfer or dtype) in LOW_PRECISION and comm is not None)
        """Host slots in the ring (0: full-size rows)."""
        self._sends = [self._chunk_done(j, dev) for j, dev in enumerate(self.devs)]
        self.hooks = [DeviceHooks(self.params[j], marks, j, self._sends[j], dev.stamp, dev.note_stream)  # disarmed
                      for j, dev in enumerate(self.devs)]
        self.views = [h.views for h in self.hooks]
        """Per replica, each parameter's gradient view into its flat buffer (what ``.grad`` must be)."""
        if streaming:
            from cgdp.engine.core.accumulate import warm_up
            warm_up(kernel_dtype(transfer or dtype), len(self.devs))
            self.host = HostAccumulator(self.devs, transfer or dtype, guard, comm, host_threads)

    @property
    def plan(self) -> Plan:
        return [list(c) for c in self.layout.plan]

    def set_plan(self, plan: Plan) -> None:
        """Lay the flat buffers out for ``plan``. Only between steps, with nothing in flight."""
        layout = make_layout(plan, self.layer_pids, self.numels, self._segment // self.wire_itemsize)
        if not self.flats:
            self.flats = [torch.zeros(max(layout.total, 1), dtype=self.dtype, device=d.torch_device)
                          for d in self.devs]
            if self.transfer is not None and self.streaming:
                self.stages = [torch.empty(max(layout.total, 1), dtype=self.transfer, device=d.torch_device)
                               for d in self.devs]
        else:  # keep .grad's values across a plan switch, in the same buffers
            for flat in self.flats:
                relay(flat, self.layout, layout)
        for j, params in enumerate(self.params):
            views = attach_grads(self.flats[j], params, layout)  # the owner sets .grad None where it has none
            self.hooks[j].set_layout(layout.param_chunk, views)
        self.marks.set_layout(layout.chunk_params)
        self.layout = layout
        # which parameters arrive whole in a Trainer's step (see :data:`LARGE_ELEMS`)
        self.large = [pid for pid, n in enumerate(self.numels) if n >= LARGE_ELEMS]
        self.large_mask = bytes(n >= LARGE_ELEMS for n in self.numels)
        self.small_views = [[v for v, large in zip(views, self.large_mask) if not large] for views in self.views]
        if self.host is not None:
            for dev, routes in zip(self.devs, self.host.set_layout(layout, self.flats, self.stages, self.ring)):
                dev.set_routes(routes)

    def arm(self, timing: bool = False, sink: TraceSink | None = None, sending: bool = True) -> None:
        """Ready hooks and host for one backward, flat buffers kept; ``sending=False``: hooks only mark touched."""
        for h in self.hooks:
            h.mode.timing = timing
            h.mode.streaming = self.streaming and sending
        if self.host is not None and sending:
            self.host.trace = sink
            self.host.begin_step()

    def disarm(self) -> None:
        """Between backwards: hooks only mark parameters touched, never send."""
        for h in self.hooks:
            h.mode.streaming = False

    def _chunk_done(self, j: int, dev: Device) -> Callable[[int], None]:
        """What device j's hooks call on a complete chunk; it holds the stream weakly (no stream <-> hooks cycle)."""
        sent = self.marks.sent[j]
        if self.ring:
            send_ring = weak_call(self._send_ring, j, False)  # never waits in a hook: a busy slot is sent later

            def done(c: int) -> None:
                sent[c] = 1
                send_ring()
            return done
        def done(c: int) -> None:
            sent[c] = 1
            dev.send(c)  # one call per chunk: one event wait, one context
        return done

    def _send_ring(self, j: int, block: bool) -> bool:
        """Ring: send device j's complete segments in plan order while slots are free (``block``: wait). All sent?"""
        lay, ring, host, dev = self.layout, self.ring, self.host, self.devs[j]
        complete, s, n = self.marks.sent[j], self.marks.next[j], len(lay.segments)
        while s < n and complete[lay.segment_chunk[s]]:
            if s >= ring and host.summed.done < s - ring + 1:  # its slot still holds segment s - ring
                if not block:
                    break
                # note: back-pressure: the host waits until it has summed the slot's last segment
                host.summed.wait(s - ring + 1, self._guard, "a free host slot (host_memory)")
            dev.send(s)
            s += 1
        self.marks.next[j] = s
        return s == n

    @contextmanager
    def holding(self, j: int) -> Iterator[None]:
        """Device j's backward inside keeps its gradients on the device (micro-batches but the last); its thread."""
        mode = self.hooks[j].mode
        mode.streaming = False
        try:
            yield
        finally:
            mode.streaming = self.streaming

    def flush(self, j: int) -> None:
        """After device j's backward, on its thread: send the chunks never completed (ring: all waiting for a slot)."""
        if not self.streaming:
            return
        m, views = self.marks, self.views[j]
        for pid in self.large:
            if m.stolen[j][pid] and not m.touched[j][pid]:
                # unused here this step: its view still holds last step's average, and it is sent
                views[pid].zero_()
                self.params[j][pid].grad = views[pid]
        if self.ring:
            m.sent[j][:] = b"\x01" * len(m.sent[j])
            self._send_ring(j, block=True)
        else:  # the chunks backward never completed (layers unused this step), in plan order
            for c, done in enumerate(m.sent[j]):
                if not done:
                    self._sends[j](c)

    def flush_all(self) -> None:
        """:meth:`flush` for every device from one thread; with a ring, waiting only when no device can send."""
        if not self.streaming or not self.ring:
            for j in range(len(self.devs)):
                self.flush(j)
            return
        for p in self.marks.sent:
            p[:] = b"\x01" * len(p)
        while True:
            seen = self.host.summed.done  # before the round: a slot freed during it is not missed
            done = [self._send_ring(j, block=False) for j in range(len(self.devs))]
            if all(done):
                return
            # note: host waits for the host to free a slot (every device that has not sent the earliest segment still
            # missing can send it, so the sum advances)
            self.host.summed.wait(seen + 1, self._guard, "a free host slot (host_memory)")

    def wait_returned(self, j: int) -> None:
        """Device j's compute stream waits until every averaged chunk is back on the device."""
        if not self.streaming:
            return
        dev = self.devs[j]
        # note: host waits until every chunk has been averaged and its copy back issued
        self._guard.wait(self.host.returned, f"the averaged gradients for {dev.name}")
        marker = dev.h2d_marker()
        dev.compute_wait(marker, self._guard)
        if self.hooks[j].mode.timing:  # so that the phase times are true; untimed steps do not wait
            dev.wait_marker(marker, self._guard)

    def bad_count(self) -> float:
        """NaN/Inf values in the averaged gradient (counted during accumulation)."""
        return float(sum(self.host.bad)) if self.host is not None else 0.0

    def bad_layers(self, names: Sequence[str]) -> str:
        if self.host is None:  # typical and single modes: replica 0 holds the summed gradient
            return nonfinite_layers(self.params[0], self.layer_pids, names)
        chunks = sorted({self.layout.segment_chunk[s] for s, b in enumerate(self.host.bad) if b})
        return ", ".join(names[i] or "<root>" for c in chunks for i in self.layout.plan[c]) or "unknown"

    def _set_want_norm(self, on: bool) -> None:
        """Whether the host computes the gradient norm while it sums (set between steps; never read back)."""
        if self.host is not None:
            self.host.want_sumsq = bool(on)

    want_norm = property(fset=_set_want_norm, doc=_set_want_norm.__doc__)

    def grad_norm(self, read: bool = True) -> float | torch.Tensor:
        """The 2-norm of the averaged gradient (over all ranks), after :meth:`wait_returned`: from the host's sum
        (``want_norm``) or from device 0's flat buffer (``read=False``: a float64 device scalar)."""
        if self.host is not None:
            if not self.host.want_sumsq:
                raise RuntimeError("set stream.want_norm = True before the step to get its gradient norm")
            return math.sqrt(functools.reduce(operator.add, self.host.sumsq, 0.0))  # segment order (not sum()'s)
        return device_norm(self.flats[0], read)

    def scale_grads(self, coef: torch.Tensor, j: int | None = None) -> None:
        """Multiply device j's (every device's if None) gradients by ``coef``, on the thread that drives device j."""
        for flat in (self.flats if j is None else [self.flats[j]]):
            scale_gradients(flat, coef)

    def close(self, keep_grads: bool = False) -> None:
        """Every ``.grad`` None, or (``keep_grads``) replica 0's a copy of its own."""
        for h in self.hooks:
            h.remove()
        if self.host is not None:
            self.host.close()
        for j, params in enumerate(self.params):
            for p in params:
                p.grad = p.grad.clone() if keep_grads and j == 0 and p.grad is not None else None
        self.flats = []
        self.stages = None

    def profile_inputs(self) -> dict[str, Any]:
        """What :func:`cgdp.engine.trainer.timing.build_profile` needs of the stream."""
        host = self.host  # registered host bytes, and the host bytes moved per step (0 without a host)
        figures = ({"registered_bytes": 0, "bytes_moved": 0} if host is None
                   else {"registered_bytes": host.registered_bytes, "bytes_moved": host.traffic()["total"]})
        return {"marks": self.marks, "layer_pids": self.layer_pids, "layout": self.layout,
                "itemsize": self.wire_itemsize, "host": figures}


LARGE_ELEMS = 1 << 14
"""Parameters this large get ``.grad = None`` before a Trainer's backward: the hook writes autograd's gradient into the
flat buffer in one pass instead of zero-then-add (for smaller ones the extra calls cost more than they save)."""

MIN_SLOTS = 2
"""The fewest ring slots ``host_memory`` may buy: one being summed while the next arrives."""

MIN_SEGMENT = 1024
"""The smallest ``segment_bytes``: every segment is a copy and a task of its own."""


def check_sizes(segment_bytes: int, host_memory: int | None) -> None:
    """``segment_bytes`` and ``host_memory`` of either face, before anything is built."""
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < MIN_SEGMENT:
        raise ValueError(f"segment_bytes must be an int number of bytes >= {MIN_SEGMENT} (the default is "
                         f"4 << 20, 4 MiB), got {segment_bytes!r}")
    if host_memory is not None and (isinstance(host_memory, bool) or not isinstance(host_memory, int)
                                    or host_memory < 1):
        raise ValueError(f"host_memory must be a positive int (the bytes of registered host memory, e.g. "
                         f"64 << 20) or None (full-size host slots); got {host_memory!r}")


def ring_slots(host_memory: int, devices: int, segment_bytes: int, wire_itemsize: int,
               widened: bool = False) -> int:
    """Slots of ``devices + 1`` rows (plus a float32 row for a widened allreduce) that fit in ``host_memory``."""
    check_sizes(segment_bytes, host_memory)
    elems = align(segment_bytes // wire_itemsize)
    slot = (devices + 1) * elems * wire_itemsize + (4 * elems if widened else 0)
    slots = host_memory // slot
    if slots < MIN_SLOTS:
        raise ValueError(f"host_memory={host_memory} bytes holds {slots} slot(s) of {slot} bytes "
                         f"({devices + 1} rows of one {segment_bytes}-byte segment); it needs at least "
                         f"{MIN_SLOTS * slot} bytes, or a smaller segment_bytes")
    return slots


def wire_dtype(grad_transfer: str | None, dtype: torch.dtype, mode: str) -> torch.dtype | None:
    """The dtype gradients travel in (None: the parameters' own)."""
    if grad_transfer is None:
        return None
    if grad_transfer != "bf16":
        raise ValueError(f"grad_transfer must be None or 'bf16', got {grad_transfer!r}")
    if dtype != torch.float32:
        raise ValueError(f"grad_transfer='bf16' narrows float32 gradients; these parameters are {dtype} "
                         f"(16-bit parameters already travel in 16 bits)")
    if mode != "cgdp":
        raise ValueError(f"grad_transfer='bf16' applies to mode='cgdp' (the host round trip), not {mode!r}")
    return torch.bfloat16


def relay(flat: torch.Tensor, old: Layout, new: Layout) -> None:
    """Move each parameter's gradient from its ``old`` place to its ``new`` one, via host memory; padding becomes 0."""
    staged = flat.to("cpu")  # note: host sync (between steps, nothing in flight)
    out = torch.zeros_like(staged)
    for a, b, n in zip(old.offsets, new.offsets, new.numels):
        out[b:b + n] = staged[a:a + n]
    flat.copy_(out)
