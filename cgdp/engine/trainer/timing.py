"""Profiles and traces of one step, built from what the streams recorded.

While a step is timed, streams and threads append ``(device, stream, name, start, end)`` events to one list and the
hooks stamp each gradient's arrival; after it, :meth:`Timing.finish` makes a timeline and :func:`build_profile` a
:class:`~cgdp.planning.profile.StepProfile` (the paper's Table 4), which the tuner and calibration read.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from cgdp.engine.backend.base import Device
from cgdp.engine.core.flatgrad import Layout
from cgdp.engine.core.hooks import StepMarks
from cgdp.planning.profile import ChunkTiming, StepProfile

Event = tuple[str, str, str, float, float]
"""``(device, stream, name, start, end)``; times on the host clock."""


class Timing:
    """Which steps are timed, a timed step's events, and the last results: :meth:`choose`, :meth:`start`, then after an
    applied step :meth:`finish` (a failed step keeps the previous ones)."""

    def __init__(self, always: bool):
        self.always = always  # Trainer(profile=True)
        self.profile_once = self.trace_once = False  # Trainer.profile_next(), trace_next()
        self.profiling = self.tracing = False  # this step
        self.events: list[Event] | None = None  # this step's, while it is timed
        self.last_profile: StepProfile | None = None
        self.last_trace: list[dict[str, Any]] | None = None

    def choose(self, tuner_wants: bool) -> None:
        """Whether this step is profiled (always, once, or for the tuner) and traced."""
        self.profiling = self.always or self.profile_once or tuner_wants
        self.tracing = self.trace_once
        self.profile_once = self.trace_once = False

    def start(self, devs: Sequence[Device]) -> tuple[bool, Any]:
        """Before the first forward: whether this step is timed, and its event sink (or None)."""
        timing = self.profiling or self.tracing
        events: list[Event] | None = [] if timing else None
        self.events = events
        # the sink holds the list, not the trainer: no reference cycle through the devices
        sink = (lambda *e: events.append(e)) if events is not None else None
        for d in devs:
            d.trace = sink
            if timing:
                d.begin_timing()
        return timing, sink

    def finish(self, devs: Sequence[Device], fw, bw, up, t_start: float,
               profile_inputs: Callable[[], dict[str, Any]]) -> None:
        """After an applied step, if timed: its trace and profile (``profile_inputs()`` gives :func:`build_profile`'s
        rest). Stamps are resolved before ``end_timing()``."""
        events = self.events
        if events is None:
            return
        events += [(d.name, "compute", name, d.resolve(span[0]), d.resolve(span[1])) for j, d in enumerate(devs)
                   for name, span in (("forward", fw[j][1:3]), ("backward", bw[j][1:3]), ("update", up[j]))
                   if span is not None]  # the compute-stream spans, on the devices' clocks
        inputs = profile_inputs() if self.profiling else None
        bw_start = [d.resolve(b[1]) for d, b in zip(devs, bw)]
        for d in devs:
            d.end_timing()  # emits the device-timed copies into the events
        if self.tracing:
            self.last_trace = [{"device": dev, "stream": stream, "name": name, "start": a - t_start,
                                "end": b - t_start} for dev, stream, name, a, b in events]
        if inputs is not None:
            self.last_profile = build_profile(devs=devs, bw_start=bw_start, events=events, **inputs)


def build_profile(*, devs: Sequence[Device], marks: StepMarks, bw_start: Sequence[float],
                  layer_pids: Sequence[Sequence[int]], layout: Layout, events: Sequence[Event],
                  itemsize: int, stats: dict[str, float], layer_bytes: Sequence[int], mode: str,
                  ranks: int, host: dict[str, int]) -> StepProfile:
    """The step's profile. ``bw_start[j]``: when device j's backward started (resolved)."""
    ready = []
    for pids in layer_pids:
        best = max([-1.0] + [devs[j].resolve(at[pid]) - bw_start[j]
                             for j, (touched, at) in enumerate(zip(marks.touched, marks.ready_at))
                             for pid in pids if touched[pid]])
        ready.append(best if best >= 0 else math.nan)
    t0 = min(bw_start)
    by: dict[tuple[str, str], list[tuple[str, float, float]]] = {}
    for dev, stream, name, a, b in events:
        by.setdefault((stream, name), []).append((dev, a, b))
    g = len(devs)
    busy = lambda xs, k: sum(b - a for _, a, b in xs) / k  # noqa: E731  (segments add up)
    chunks = []
    for c, layers in enumerate(layout.plan):
        lo, hi = layout.chunk_bounds[c]
        d2h, acc, comm, h2d = (by.get((stream, f"chunk {c}"), []) for stream in ("d2h", "accumulate", "comm", "h2d"))
        chunks.append(ChunkTiming(
            index=c, layers=list(layers), bytes=(hi - lo) * itemsize,
            d2h_s=busy(d2h, g), acc_s=busy(acc, 1), comm_s=busy(comm, 1), h2d_s=busy(h2d, g),
            sent_s=(min(a for _, a, _ in d2h) - t0) if d2h else 0.0,
            back_s=(max(b for _, _, b in h2d) - t0) if h2d else 0.0))
    return StepProfile(
        devices=g, ranks=ranks, mode=mode, layer_bytes=list(layer_bytes), layer_ready_s=ready,
        plan=[list(c) for c in layout.plan], chunks=chunks, host_registered_bytes=host["registered_bytes"],
        host_bytes_moved=host["bytes_moved"],
        **{k: stats[k] for k in ("forward_s", "backward_s", "exposed_comm_s", "update_s", "step_s")})


def step_stats(devs: Sequence[Device], fw: Sequence[tuple[Any, Any, Any]],
               bw: Sequence[tuple[float, Any, Any, Any]], up: Sequence[tuple[Any, Any] | None],
               t_start: float, t_bw: float, t_up: float, t_end: float, samples: int) -> dict[str, float]:
    """The phase times of one step (``Trainer.stats``). ``fw[j]``: (loss, start, end); ``bw[j]``: (loss value, start,
    end, gradients back); ``up[j]``: (start, end) or None. Timed CUDA steps stamp device events; otherwise host times
    (issue times for a GPU's forward and update)."""
    r = [d.resolve for d in devs]
    ups = [(r[j](u[0]), r[j](u[1])) for j, u in enumerate(up) if u is not None]
    bw_end = max(r[j](b[2]) for j, b in enumerate(bw))
    return {
        "forward_s": max(r[j](f[2]) - r[j](f[1]) for j, f in enumerate(fw)),
        "backward_s": max(r[j](b[2]) - r[j](b[1]) for j, b in enumerate(bw)),
        # from the end of the last device's backward until the gradients are back everywhere (a device that finished
        # early waits for the others: that is not communication)
        "exposed_comm_s": max(0.0, max(r[j](b[3]) for j, b in enumerate(bw)) - bw_end),
        "update_s": max((b - a for a, b in ups), default=0.0),
        "step_s": max([t_end] + [b for _, b in ups]) - t_start,
        "host_s": t_up - t_bw,
        "samples": float(samples),
    }

