"""Chrome / Perfetto traces of training iterations (``--trace FILE``).

The engine reports, for a traced step, a list of spans ``{"device", "stream", "name", "start",
"end"}`` in seconds from the step's start (``Trainer.last_trace``). This module lays them out as a
Trace Event Format file (``{"traceEvents": [...]}``, complete events ``"ph": "X"`` in microseconds)
that ``chrome://tracing`` and https://ui.perfetto.dev open: one process per device, in device
order, then ``host``; one thread per stream, always in data-path order (compute, d2h, h2d on a
device; accumulate, comm on the host), so two traces of different runs line up.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable

STREAM_ORDER = ("compute", "d2h", "h2d", "accumulate", "comm", "step")
DEVICE_STREAMS = ("compute", "d2h", "h2d")
HOST_STREAMS = ("accumulate",)


def _device_key(dev: str) -> tuple[int, int, str]:
    if dev == "host":
        return (1, 0, dev)
    kind, _, idx = dev.partition(":")
    return (0, int(idx) if idx.isdigit() else 0, kind)


def stats_compute_spans(devices: Iterable[str], stats: dict[str, float]) -> list[dict]:
    """Forward / backward / update spans per device from a step's ``Trainer.stats``.

    Used when the engine's trace has no ``compute`` spans of its own; the times are the maxima
    over devices, so every device shows the same spans (marked ``approx`` in their args).
    """
    f, b, u, s = (stats.get(k, 0.0) for k in ("forward_s", "backward_s", "update_s", "step_s"))
    spans = []
    for d in devices:
        spans += [{"device": d, "stream": "compute", "name": "forward", "start": 0.0, "end": f, "approx": True},
                  {"device": d, "stream": "compute", "name": "backward", "start": f, "end": f + b, "approx": True},
                  {"device": d, "stream": "compute", "name": "update", "start": max(s - u, f + b), "end": s,
                   "approx": True}]
    return spans


def chrome_trace(steps: list[tuple[int, float, float, list[dict]]], devices: list[str]) -> dict:
    """Build the trace of ``steps``: tuples ``(step, offset_s, step_s, spans)``, where ``offset_s``
    places the step on the common time line and ``step_s`` is its length. Every stream of every
    device in ``devices`` and the host accumulator get a named thread, even if empty."""
    names = {d: list(DEVICE_STREAMS) for d in devices}
    names["host"] = list(HOST_STREAMS) + ["step"]
    for _, _, _, spans in steps:
        for e in spans:
            streams = names.setdefault(e["device"], [])
            if e["stream"] not in streams:
                streams.append(e["stream"])
    pids = {d: i + 1 for i, d in enumerate(sorted(names, key=_device_key))}
    tids: dict[tuple[str, str], int] = {}
    events: list[dict] = []
    for d, pid in pids.items():
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": d}})
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        order = sorted(names[d], key=lambda s: STREAM_ORDER.index(s) if s in STREAM_ORDER else len(STREAM_ORDER))
        for t, stream in enumerate(order, start=1):
            tids[(d, stream)] = t
            events.append({"ph": "M", "pid": pid, "tid": t, "name": "thread_name", "args": {"name": stream}})
            events.append({"ph": "M", "pid": pid, "tid": t, "name": "thread_sort_index", "args": {"sort_index": t}})
    for step, offset, length, spans in steps:
        events.append({"ph": "X", "pid": pids["host"], "tid": tids[("host", "step")], "name": f"step {step}",
                       "ts": offset * 1e6, "dur": length * 1e6, "args": {"step": step}})
        for e in spans:
            args = {"step": step, **({"approx": True} if e.get("approx") else {})}
            events.append({"ph": "X", "pid": pids[e["device"]], "tid": tids[(e["device"], e["stream"])],
                           "name": e["name"], "ts": (offset + e["start"]) * 1e6,
                           "dur": max(e["end"] - e["start"], 0.0) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "cgdp", "steps": [s for s, _, _, _ in steps]}}


class Recorder:
    """Collects the traced steps of a run: ``count`` steps from ``first`` (0-based step numbers)."""

    def __init__(self, path: str, first: int, count: int, devices: list[str]):
        self.path, self.first, self.count, self.devices = path, first, count, devices
        self.steps: list[tuple[int, float, float, list[dict]]] = []
        self._t0: float | None = None

    def wants(self, step: int) -> bool:
        return bool(self.path) and self.first <= step < self.first + self.count

    def add(self, step: int, started: float, stats: dict[str, float], spans: list[dict] | None) -> None:
        """Record step number ``step`` (1-based), begun at ``started`` (``time.perf_counter``)."""
        self._t0 = started if self._t0 is None else self._t0
        spans = list(spans or [])
        if not any(e["stream"] == "compute" for e in spans):
            spans += stats_compute_spans(self.devices, stats)
        self.steps.append((step, started - self._t0, stats.get("step_s", 0.0), spans))

    def write(self) -> str | None:
        """Write the trace file if anything was traced; return a note saying so."""
        if not self.steps:
            return None
        write(self.path, chrome_trace(self.steps, self.devices))
        return f"trace of step(s) {[s for s, *_ in self.steps]} written to {self.path}"


def write(path: str | os.PathLike, trace: dict) -> None:
    """Write ``trace`` as JSON (through a temporary file, so a reader never sees half a trace);
    a full disk is an :class:`~cgdp.cli.output.OutputError` and leaves no partial file."""
    from cgdp.cli.output import disk_error, write_text
    path = pathlib.Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise disk_error(e, path, "the run's checkpoint and metrics are intact") from None
    write_text(path, json.dumps(trace), "the run's checkpoint and metrics are intact")
