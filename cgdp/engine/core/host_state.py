"""The host optimizer's state kept restorable, its step hooks, its fused CPU kernel (``update="host"``).

An overlapped chunk is stepped before the step is known to succeed; a later failure must leave the optimizer untouched,
as one device's failed step does. Adam/AdamW on torch's fused kernel step out of place and need no copy
(:mod:`cgdp.engine.core.host_adam`); for any other optimizer :class:`StateSnapshot` copies a chunk's state aside before
its step (into buffers kept across steps) on the host update thread and restores it on the caller's thread, nothing in
flight.
:func:`step_or_undo` undoes a raising step after backward the same way: the failed step changes nothing.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer


class StateSnapshot:
    """Per parameter stepped: its optimizer state before the step (None: it had none)."""

    def __init__(self) -> None:
        self._bufs: dict[torch.Tensor, dict] = {}
        self._saved: list[tuple[torch.Tensor, dict | None]] = []

    def clear(self) -> None:
        self._saved = []

    def save(self, state: dict, params: list[torch.Tensor]) -> None:
        src, dst = [], []
        for p in params:
            s = state.get(p) or {}
            bufs = self._bufs.setdefault(p, {})
            snap = {}
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    b = bufs.get(k)
                    if b is None or b.shape != v.shape or b.dtype != v.dtype or b.device != v.device:
                        b = bufs[k] = torch.empty_like(v)
                    src.append(v)
                    dst.append(b)
                    v = b
                snap[k] = v
            self._saved.append((p, snap if s else None))
        if src:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)

    def restore(self, state: dict) -> None:
        with torch.no_grad():
            for p, snap in self._saved:
                if snap is None:
                    state.pop(p, None)
                    continue
                s = state[p]
                for k in [k for k in s if k not in snap]:
                    del s[k]
                for k, v in snap.items():
                    if isinstance(v, torch.Tensor) and isinstance(s.get(k), torch.Tensor):
                        s[k].copy_(v)
                    else:
                        s[k] = v.clone() if isinstance(v, torch.Tensor) else v
        self._saved = []


def has_step_hooks(opt: torch.optim.Optimizer) -> bool:
    """Step hooks (``opt``'s or global) would see part of the parameters per chunk: update once after backward."""
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


def may_write_then_raise(opt: torch.optim.Optimizer) -> bool:
    """A post-hook, or a step not torch's own (an LR scheduler's wrapper counts as torch's); pre-hooks raise first."""
    own = vars(opt).get("step")
    while getattr(own, "_wrapped_by_lr_sched", False):
        own = own.__wrapped__
    return bool(opt._optimizer_step_post_hooks or torch_optimizer._global_optimizer_post_hooks
                or own not in (None, type(opt).step) or not type(opt).__module__.startswith("torch.optim"))


def step_or_undo(opt: torch.optim.Optimizer, states: StateSnapshot, masters: Any) -> None:
    """``opt.step()``; if it raises, masters and state as before, then the error. Saved only when the step may raise
    after writing (:func:`may_write_then_raise`); otherwise free."""
    keep = may_write_then_raise(opt)
    states.clear()
    if keep:
        states.save(opt.state, masters.masters)
        if masters.wire is not None:
            masters.wire.keep()
    try:
        opt.step()
    except BaseException:
        if keep:
            masters.wire.put_back() if masters.wire is not None else masters.refresh()
            states.restore(opt.state)
        raise


FUSED_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""``fused=True`` unless the user chose: 3-9x faster on CPU (``bench/bench_host_update.py``)."""


def prefer_fused(opt: torch.optim.Optimizer) -> None:
    if type(opt) not in FUSED_CPU:
        return
    for g in opt.param_groups:
        if g.get("fused") is None and g.get("foreach") is None and not g.get("differentiable"):
            g["fused"] = True
