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

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from cgdp.sync import Guard

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

    @abstractmethod
    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device can copy to and from asynchronously (pinned on CUDA)."""

    @abstractmethod
    def send(self, src: torch.Tensor, dst: torch.Tensor, on_arrived: Callable[[], None],
             label: str) -> None:
        """After all compute work issued so far, copy ``src`` (device) into ``dst`` (host) on the
        D2H stream; then run ``on_arrived()`` on a host thread. Only enqueues."""

    @abstractmethod
    def give_back(self, src: torch.Tensor, dst: torch.Tensor, label: str) -> None:
        """Copy ``src`` (host) into ``dst`` (device) on the H2D stream. Only enqueues."""

    @abstractmethod
    def h2d_marker(self) -> Any:
        """A marker that completes when every ``give_back`` issued so far has completed."""

    @abstractmethod
    def compute_wait(self, marker: Any, guard: Guard) -> None:
        """Make later compute work wait for ``marker``."""

    @abstractmethod
    def synchronize(self, guard: Guard) -> None:
        """Block the host until all streams of this device are idle."""

    def mark(self) -> Any:
        """A compute-stream timestamp for profiling (resolved by ``elapsed``)."""
        return None

    def close(self) -> None:
        pass
