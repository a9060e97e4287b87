"""The device interface: everything the engine does that depends on the kind of device.

One :class:`Device` per entry of ``devices``. It owns three in-order queues of work: the compute
stream (the device's own host thread issues forward, backward and update onto it), a D2H stream
and an H2D stream. The engine talks to a device only through these methods, so the hooks, the
chunk plan, the host accumulator, the MPI tier and the tuner run unchanged on CUDA and on
CPU-emulated devices.

Threads: ``send`` is called from the thread that runs backward for this device (inside a gradient
hook) and must only enqueue. ``give_back`` and ``h2d_marker`` are called from the host side (the
accumulator or comm thread). ``compute_wait`` is called from the device's own thread.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import torch

from cgdp.engine.sync import Guard

SendPart = tuple[torch.Tensor, torch.Tensor, Callable[[], None], "torch.Tensor | None"]
"""(src on the device, dst on the host, on_arrived, stage on the device or None)."""
TraceSink = Callable[[str, str, str, float, float], None]
"""(device, stream, name, start, end) with times in ``time.perf_counter`` seconds."""


class Device(ABC):
    name: str
    """The user's device string, e.g. ``"cuda:1"`` or ``"cpu:1"``."""
    torch_device: torch.device
    """Where the replica lives."""
    is_cuda: bool = False

    def __init__(self, name: str, fail: Callable[[BaseException], None]):
        self.name = name
        self._fail = fail
        self.trace: TraceSink | None = None

    def bind_thread(self) -> None:
        """Called once on the device's own host thread (forward, backward and update run there)."""

    def check_caller(self, what: str = "Trainer.step()") -> None:
        """Called on the caller's thread at the start of every step, and before the engine builds
        or relays buffers or the user's optimizer steps: raise if its stream context would break
        the ordering the engine relies on (``what``: the call, for the message)."""

    note_stream: Callable[[int], None] | None = None
    """Called in each gradient hook with the gradient's chunk (CUDA only: see ``send``)."""

    @abstractmethod
    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device can copy to and from asynchronously (pinned on CUDA)."""

    def host_release(self, t: torch.Tensor) -> None:
        """Give back host memory from :meth:`host_empty` (before ``close()``, which frees all)."""

    @abstractmethod
    def send(self, parts: Sequence[SendPart], label: str) -> None:
        """After all compute work issued so far, for each ``(src, dst, on_arrived, stage)`` in
        order: copy ``src`` (device) into ``dst`` (host) on the D2H stream, through ``stage`` (a
        device buffer of ``dst``'s dtype: the cast happens on the device) if it is given; then run
        ``on_arrived()`` on a host thread. Only enqueues."""

    @abstractmethod
    def give_back(self, src: torch.Tensor, dst: torch.Tensor, label: str,
                  stage: torch.Tensor | None = None) -> None:
        """Copy ``src`` (host) into ``dst`` (device) on the H2D stream, through ``stage`` (a device
        buffer of ``src``'s dtype, widened into ``dst`` on the device) if it is given. Only enqueues."""

    @abstractmethod
    def h2d_marker(self) -> Any:
        """A marker that completes when every ``give_back`` issued so far has completed."""

    @abstractmethod
    def compute_wait(self, marker: Any, guard: Guard) -> None:
        """Make later compute work wait for ``marker``."""

    @abstractmethod
    def synchronize(self, guard: Guard) -> None:
        """Block the host until all streams of this device are idle."""

    def settle(self, marker: Any, guard: Guard) -> None:
        """Block the host until ``marker`` has completed (timed steps only, so that phase times
        are true)."""

    def wait_compute(self, guard: Guard) -> None:
        """Block the host until the compute work issued so far has completed (before reading
        the loss), without spinning a core."""

    # Timing for profiles and traces. Emulated devices use the host clock directly; CUDA records
    # device events and resolves them against an anchor after the step.
    def begin_timing(self) -> None:
        """Start of a profiled or traced step."""

    def stamp(self) -> Any:
        """A timestamp of 'now' on the compute stream (called from hooks and the device thread)."""
        return time.perf_counter()

    def resolve(self, stamp: Any) -> float:
        """A stamp as ``time.perf_counter`` seconds (after the step's work has completed)."""
        return float(stamp)

    def backward_issued(self) -> Any:
        """Device thread, right after backward was issued: a stamp of that point (timed steps)."""
        return self.stamp()

    def end_timing(self) -> None:
        """After the step (and after its stamps were resolved): emit the copies timed on the
        device to ``self.trace``."""

    def close(self) -> None:
        pass
