"""Fault injection for the CUDA path: device time put on a stream at each ordering point.

:class:`Delayed` wraps a runtime object (``use_runtime(Delayed(TorchCuda(), ...))``) and puts
``torch.cuda._sleep`` device work, on a GPU or on the simulator alike:

* ``"d2h"``: before every copy on a D2H stream (the host must wait for the copy's event before it
  sums the chunk);
* ``"h2d"``: before every copy on an H2D stream (the update must wait for the copies back, and
  ``close()`` for their host rows);
* ``"compute"``: right after every event recorded on a default stream (every later kernel there,
  the next chunks' gradient accumulations and the update included, runs late: a D2H copy that does
  not wait for its chunk's event reads a gradient not yet complete).

With the delays, a wait that is missing shows as a wrong result (the run is compared with
single-device autograd), where without them the GPU may happen to be fast enough to hide it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Delayed"]


class Delayed:
    """The runtime ``rt`` with ``cycles`` of device sleep at the ordering points in ``where``;
    :meth:`attach` names the devices whose copy streams are injected (a trainer's ``_devs``)."""

    def __init__(self, rt: Any, where: tuple[str, ...] = ("d2h", "h2d", "compute"), cycles: int = 20_000_000):
        unknown = set(where) - {"d2h", "h2d", "compute"}
        if unknown:
            raise ValueError(f"unknown injection points {sorted(unknown)}; use d2h, h2d, compute")
        self._rt = rt
        self.where = tuple(where)
        self.cycles = cycles
        self.injected = 0
        self._devs: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def attach(self, devs: Any) -> None:
        self._devs = list(devs)

    def _sleep(self) -> None:
        self.injected += 1
        self._rt.cuda._sleep(self.cycles)

    def copy(self, dst: Any, src: Any) -> None:
        cur = self._rt.cuda.current_stream()
        for d in self._devs:
            kind = "d2h" if cur == d.d2h else "h2d" if cur == d.h2d else None
            if kind in self.where:
                self._sleep()  # on the copy's own stream: the copy lands late
                break
        self._rt.copy(dst, src)

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> Any:  # noqa: N802
        return _Event(self, self._rt.Event(enable_timing=enable_timing, blocking=blocking))


class _Event:
    """An event whose ``record`` on a default stream is followed by device sleep there."""

    def __init__(self, owner: Delayed, ev: Any):
        self._owner = owner
        self._ev = ev

    def record(self, stream: Any = None) -> None:
        rt = self._owner._rt
        stream = stream if stream is not None else rt.cuda.current_stream()
        self._ev.record(stream)
        if "compute" in self._owner.where and stream == rt.cuda.default_stream(stream.device_index):
            with rt.cuda.stream(stream):
                self._owner._sleep()

    def wait(self, stream: Any = None) -> None:
        self._ev.wait(stream)

    def elapsed_time(self, end: "_Event") -> float:
        return self._ev.elapsed_time(getattr(end, "_ev", end))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ev, name)
