"""The one documented look inside an engine, for tests and benchmarks: :func:`inside`.

Tests prove results through public behaviour. Where one must see the engine's parts (the flat
buffers' layout, the backend's device objects, the device threads, the replicas' random streams,
which operation holds the lock), it reads them through :func:`inside`, so that what tests depend on
is named in one place and the engine's private names can change behind it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Inside:
    """A look at one engine (``cgdp.Trainer`` or ``cgdp.DataParallel``), taken now."""

    stream: Any
    """The :class:`~cgdp.engine.core.stream.GradientStream`: flat buffers (``flats``), their
    ``layout``, each device's hooks, the ``host`` accumulator; None without dense parameters."""
    devices: list
    """The backend's :class:`~cgdp.engine.backend.base.Device` of each replica."""
    threads: Any
    """The :class:`~cgdp.engine.core.threads.DeviceThreads` (``at_once``, ``stuck``)."""
    rng: Any
    """The replicas' random streams (:mod:`cgdp.engine.backend.rng`)."""
    operation: str | None
    """The operation that holds the engine's lock now (``"backward"``, ...), or None."""
    error: BaseException | None
    """The error that stopped the engine's waits (``close()`` from another thread, a device's), if any."""
    bindings: list
    """``DataParallel``: the :class:`~cgdp.engine.dataparallel.binding.Binding` of each optimizer
    bound to the model (``opt()``, ``mirrors``; empty for ``Trainer``)."""


def inside(engine: Any) -> Inside:
    steps = getattr(engine, "_steps", None)
    return Inside(stream=engine._stream, devices=list(engine._devs), threads=engine._threads, rng=engine._rng,
                  operation=engine._life.ops.what, error=engine._guard.error,
                  bindings=list(steps.bindings) if steps is not None else [])
