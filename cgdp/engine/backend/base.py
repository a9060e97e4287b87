"""The device interface: everything the engine does that depends on the kind of device.

One :class:`Device` per entry of ``devices``, owning three in-order queues: the compute stream (fed by the device's own
host thread), a D2H and an H2D stream. The rest of the engine runs unchanged on CUDA and CPU-emulated devices.

:meth:`Device.set_routes` sets the gradient path up once per plan (:class:`Routes`: per segment, the views each copy
reads and writes), so a step creates no Python object per segment. Per step a unit (a chunk, or a segment in a ring) is
sent from a gradient hook, which never waits; the host thread waits for each segment to land, and for its copy back
before a ring slot is reused; ``compute_wait`` makes later compute wait for an ``h2d_marker``.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cgdp.engine.sync import Guard

Copy = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
"""(source, destination, stage on the device or None): one segment's copy in one direction."""
TraceSink = Callable[[str, str, str, float, float], None]
"""(device, stream, name, start, end) with times in ``time.perf_counter`` seconds."""


@dataclass
class Routes:
    """Where one device's segments travel, for one chunk plan (built by the host between steps)."""

    d2h: list[Copy]
    """Per segment: (flat buffer slice, host slot, wire-dtype stage on the device or None)."""
    h2d: list[Copy]
    """Per segment: (host sum row, flat buffer slice, widening stage or None)."""
    units: list[range]
    """The segments of each unit, in unit order: a unit is what ``send`` issues at once."""
    unit_bytes: list[int]
    """Bytes each unit moves (the largest of its segments' copies, on the wire)."""
    segment_bytes: list[int]
    """Bytes each segment moves on the wire."""
    labels: list[str]
    """Per segment, its name in traces ("chunk c")."""
    sent: Callable[[int], None]
    """Called with the unit after ``send`` issued its copies (the host counts units per device)."""
    ring: int = 0
    """Host slots in the ring (0: one full-size row per device, every segment in its own place)."""


class Device(ABC):
    name: str
    """The user's device string, e.g. ``"cuda:1"`` or ``"cpu:1"``."""
    torch_device: torch.device  # where the replica lives
    is_cuda: bool = False

    def __init__(self, name: str):
        self.name = name
        self.trace: TraceSink | None = None

    def bind_thread(self) -> None:
        """Called once on the device's own host thread (forward, backward and update run there)."""

    def check_caller(self, what: str = "Trainer.step()") -> None:
        """On the caller's thread before every step, build, relay or user optimizer step: raise if its stream context
        would break the engine's ordering."""

    note_stream: Callable[[int], None] | None = None
    """Called in each gradient hook with the gradient's chunk (CUDA only: see ``send``)."""

    @abstractmethod
    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device can copy to and from asynchronously (pinned on CUDA)."""

    def host_release(self, t: torch.Tensor) -> None:
        """Give back host memory from :meth:`host_empty` (before ``close()``, which frees all)."""

    @abstractmethod
    def set_routes(self, routes: Routes) -> None:
        """The copies of a new chunk plan (between steps, nothing in flight)."""

    @abstractmethod
    def send(self, unit: int) -> None:
        """In a gradient hook, never waiting: after all compute issued so far, copy ``unit``'s segments to the host on
        the D2H stream, then ``routes.sent(unit)``."""

    @abstractmethod
    def wait_arrived(self, s: int, guard: Guard) -> None:
        """Host thread: block until segment ``s``'s copy to the host (sent this step) has landed."""

    @abstractmethod
    def give_back(self, s: int) -> None:
        """Copy segment ``s`` of the host sum back into the flat buffer on the H2D stream, without waiting."""

    @abstractmethod
    def wait_given_back(self, s: int, guard: Guard) -> None:
        """Host thread: block until segment ``s``'s copy back has completed (its host row may be overwritten)."""

    @abstractmethod
    def h2d_marker(self) -> Any:
        """A marker that completes when every ``give_back`` issued so far has completed."""

    @abstractmethod
    def compute_wait(self, marker: Any, guard: Guard) -> None:
        """Make later compute work wait for ``marker``."""

    @abstractmethod
    def synchronize(self, guard: Guard) -> None:
        """Block the host until all streams of this device are idle."""

    def wait_marker(self, marker: Any, guard: Guard) -> None:
        """Block the host until ``marker`` has completed (timed steps only, so that phase times are true)."""

    # Timing for profiles and traces. Emulated devices use the host clock directly; CUDA records device events and
    # resolves them against an anchor after the step.
    def begin_timing(self) -> None:
        """Start of a profiled or traced step."""

    def stamp(self) -> Any:
        """A timestamp of 'now' on the compute stream (called from hooks and the device thread)."""
        return time.perf_counter()

    resolve: Callable[[Any], float] = staticmethod(float)
    """A stamp as ``time.perf_counter`` seconds (after the step's work has completed); host stamps are those seconds
    (float itself: no Python frame per stamp)."""

    def backward_issued(self) -> Any:
        """Device thread, right after backward was issued: a stamp of that point (timed steps)."""
        return self.stamp()

    def end_timing(self) -> None:
        """After the step's stamps are resolved: emit the device-timed copies to ``self.trace``."""

    def close(self) -> None:
        pass
