"""Bringing the engine to rest before buffers are relaid and after a failed step (a late copy back would write into a
buffer with another meaning): wait for every device's streams, then the host, then the streams again."""
from __future__ import annotations

from typing import Sequence

from cgdp.engine.backend.base import Device
from cgdp.engine.core.host import HostAccumulator
from cgdp.engine.sync import Guard


def settle(devs: Sequence[Device], host: HostAccumulator | None, timeout_s: float | None) -> bool:
    """Whether the host drained (within ``timeout_s``, 60 s if None); a stream that never ends: ``TimeoutError``."""
    g = Guard(timeout_s)
    for d in devs:
        d.synchronize(g)  # note: host waits on every stream
    if host is not None:
        if not host.drain(timeout_s or 60.0):
            return False
        for d in devs:  # copies back issued by what the host just finished
            d.synchronize(g)
    return True


def quiesce(devs: Sequence[Device], host: HostAccumulator | None, timeout_s: float | None) -> None:
    """Wait until no copy is in flight on any device; ``TimeoutError`` if one never ends."""
    if not settle(devs, host, timeout_s):
        raise TimeoutError("the host accumulator did not drain")
