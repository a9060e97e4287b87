"""Bringing the engine to rest before buffers are relaid and after a failed step (a late copy back would write into a
buffer with another meaning): wait for every device's streams, then the host, then the streams again."""
from __future__ import annotations

from typing import Sequence

from cgdp.engine.backend.base import Device
from cgdp.engine.core.host import HostAccumulator
from cgdp.engine.sync import Guard


def _settle(devs: Sequence[Device], host: HostAccumulator | None, g: Guard, host_s: float) -> bool:
    for d in devs:
        d.synchronize(g)  # note: host waits on every stream
    if host is not None:
        if not host.drain(host_s):
            return False
        for d in devs:  # copies back issued by what the host just finished
            d.synchronize(g)
    return True


def quiesce(devs: Sequence[Device], host: HostAccumulator | None, timeout_s: float | None) -> None:
    """Wait until no copy is in flight on any device; ``TimeoutError`` if one never ends."""
    if not _settle(devs, host, Guard(timeout_s), timeout_s or 60.0):
        raise TimeoutError("the host accumulator did not drain")


def drain_after_failure(devs: Sequence[Device], host: HostAccumulator | None) -> str | None:
    """Let every stream and the host stop after a failed step; why the engine is unusable, if it is."""
    try:
        if not _settle(devs, host, Guard(30.0), 30.0):
            return "the host accumulator did not stop after a failed step"
    except BaseException as drain_exc:  # pragma: no cover - only when a stream is wedged
        return f"a stream did not drain after a failed step ({drain_exc})"
    return None
