"""One model, one engine: a model's parameters belong to at most one open ``Trainer`` or ``DataParallel``.

An engine makes the model it is given its replica 0: the parameters' ``.grad`` become views of the engine's flat buffer,
its hooks sit on them, and (``DataParallel``) optimizer steps on them are recognised by parameter identity. A second
engine on the same model takes all of that over while the first still runs: the first's gradients go silently wrong, or
its hooks fail inside backward, and freeing it would undo the second's registrations. So each engine *claims* the
parameters of the model when it is built (:func:`claim`, a clear error if another open engine holds any of them) and
gives them back last, when it is closed or freed (:meth:`Claim.release`, which removes its own entries only). A claim of
an engine that is closed, or no longer alive, does not count; one held only through a reference cycle (an engine dropped
without ``close()``) is collected first. A model that contains an engine (``cgdp.DataParallel(cgdp.DataParallel(net))``)
is refused: the engine is not a model to replicate.
"""
from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

from torch import nn

_CLAIMS: dict[int, weakref.ref] = {}
"""id(parameter) -> the engine that holds it."""
_lock = threading.Lock()


class Claim:
    def __init__(self, ref: weakref.ref, ids: list[int]):
        self._ref, self._ids = ref, ids

    def release(self) -> None:
        """Give back this engine's parameters (once; entries another engine holds stay)."""
        with _lock:
            for i in self._ids:
                if _CLAIMS.get(i) is self._ref:
                    del _CLAIMS[i]
        self._ids = []


def holder(module: nn.Module) -> Any:
    """The open engine that holds some parameter of ``module``, or None."""
    with _lock:
        for p in module.parameters():
            ref = _CLAIMS.get(id(p))
            engine = ref() if ref is not None else None
            if engine is not None and not engine.closed:
                return engine
    return None


def claim(engine: Any, module: nn.Module, what: str) -> Claim:
    """``engine`` (``what``: "cgdp.Trainer" or "cgdp.DataParallel"; it has a ``closed`` attribute) takes the parameters
    of ``module``."""
    inner = next((m for m in module.modules() if getattr(type(m), "cgdp_engine", False)), None)
    if inner is not None:
        where = "is" if inner is module else "contains"
        raise TypeError(f"{what} was given a model that {where} a cgdp.DataParallel; an engine does not wrap "
                        f"another: give it the model itself (the DataParallel's .module, after closing it)")
    other = holder(module)
    if other is not None:
        del other
        gc.collect()  # an engine dropped without close() and held only in a cycle: freed now
        other = holder(module)
    if other is not None:
        kind = "cgdp.DataParallel" if getattr(type(other), "cgdp_engine", False) else "cgdp.Trainer"
        raise RuntimeError(f"this model is already being trained by an open {kind} (its parameters are that "
                           f"engine's replica 0); a model can be in one cgdp engine at a time, or the first "
                           f"one's gradients go wrong: call close() on the other {kind} first (or keep "
                           f"using it)")
    ref = weakref.ref(engine)
    ids = list(dict.fromkeys(id(p) for p in module.parameters()))
    with _lock:
        for i in ids:
            _CLAIMS[i] = ref
    return Claim(ref, ids)
