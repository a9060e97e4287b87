"""One model, one engine: a model's parameters belong to at most one open ``Trainer`` or ``DataParallel``.

An engine owns its replica 0's ``.grad`` views and hooks; a second engine on the same model would silently break the
first. So each engine *claims* the parameters when built (:func:`claim`: a clear error if another open engine holds any)
and releases only its own entries last (:meth:`Claim.release`). Claims of closed or dead engines do not count. A model
containing an engine is refused.
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

    def add(self, params: Any) -> None:
        """The engine's other replicas' parameters too: no optimizer of another engine may hold them."""
        ids = [id(p) for p in params]
        with _lock:
            for i in ids:
                _CLAIMS.setdefault(i, self._ref)
        self._ids += ids

    def release(self) -> None:
        """Give back this engine's parameters (once; entries another engine holds stay)."""
        with _lock:
            for i in self._ids:
                if _CLAIMS.get(i) is self._ref:
                    del _CLAIMS[i]
        self._ids = []


def _open(ref: weakref.ref | None) -> Any:
    engine = ref() if ref is not None else None
    return engine if engine is not None and not engine.closed else None


def claimed(param: nn.Parameter) -> bool:
    """Whether an open engine holds ``param``."""
    return _open(_CLAIMS.get(id(param))) is not None  # one dict read: no lock needed


def holder(module: nn.Module) -> Any:
    """The open engine that holds some parameter of ``module``, or None."""
    with _lock:
        return next((e for p in module.parameters() if (e := _open(_CLAIMS.get(id(p)))) is not None), None)


def claim(engine: Any, module: nn.Module, what: str) -> Claim:
    """``engine`` (``what``: its class name; it has ``closed``) takes the parameters of ``module``."""
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
    ids = [id(p) for p in module.parameters()]
    with _lock:
        for i in ids:
            _CLAIMS[i] = ref
    return Claim(ref, ids)
