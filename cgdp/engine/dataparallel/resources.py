"""What a ``DataParallel`` holds that must be released: threads, buffers, hooks, the comm.

:class:`Resources` holds them without any reference back to the wrapper, so that a finalizer
(``weakref.finalize(wrapper, release, resources)``) can release them when a ``DataParallel`` is
dropped without ``close()``; ``close()`` runs the same finalizer. :func:`release` runs once.
"""
from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from cgdp.comm import Comm
from cgdp.engine.core.claims import Claim
from cgdp.engine.core.lifetime import settle
from cgdp.engine.core.stream import GradientStream
from cgdp.engine.core.threads import DeviceThreads
from cgdp.engine.dataparallel import mirror


class Resources:
    """What a ``DataParallel`` must release (threads, buffers, hooks), without the wrapper itself."""

    def __init__(self) -> None:
        self.devs: list = []
        self.threads: DeviceThreads | None = None
        self.stream: GradientStream | None = None
        self.comm: Comm | None = None
        self.registered: list[nn.Parameter] | None = None  # replica 0's, given to mirror.register
        self.load_hook: Any = None
        self.claim: Claim | None = None  # the model's parameters, given back last
        self.owner: Any = None  # the weak reference mirror.register returned
        self.mirrors: weakref.WeakSet = weakref.WeakSet()


def release(res: Resources) -> None:
    """``close()``, or the finalizer of a ``DataParallel`` dropped without it (runs once)."""
    try:
        settle(res.devs, res.stream)  # the last copies back may still run: nothing is freed before
    except BaseException as exc:  # a sticky CUDA error: release the rest, then report it
        failed: BaseException | None = exc
    else:
        failed = None
    if res.threads is not None:
        res.threads.close()
    if res.registered is not None:
        mirror.unregister(res.registered, res.owner)
    for m in list(res.mirrors):  # they hold the other replicas' parameters and state
        m.detach()
    if res.load_hook is not None:
        res.load_hook.remove()
    if res.stream is not None:
        kept = [None if p.grad is None else p.grad.clone() for p in res.stream.params[0]]
        res.stream.close()
        for p, g in zip(res.stream.params[0], kept):  # replica 0 keeps its gradients
            p.grad = g
    for d in res.devs:
        d.close()
    if res.comm is not None:
        res.comm.close()
    if res.claim is not None:
        res.claim.release()
    if failed is not None:
        raise failed
