"""What the host knows of the optimizer it steps (``update="host"``): its state kept restorable,
its step hooks, its fused CPU kernel.

With ``update="host"`` overlapped (:class:`~cgdp.engine.core.host_update.HostUpdate`), a chunk's
update runs before the step is known to succeed: a backward that raises partway, a NaN/Inf in a
later chunk, or the optimizer's step raising on a later chunk must leave the optimizer as one
device's failed step does (untouched). :class:`StateSnapshot` copies a chunk's optimizer state
aside before its step (``torch._foreach_copy_`` into buffers kept from step to step: no allocation
after the first step) and puts it back on failure. Runs on the host update thread (save) and on
the caller's thread with nothing in flight (restore).

The update after backward (:func:`step_or_undo`) is undone the same way when the optimizer's step
raises: a step hook (a logger, an EMA) or an optimizer of the user's, once. No replica was written
yet, so the masters retake the replicas' parameters, and the state goes back to what it was: the
failed ``Trainer.step()`` changes nothing, as a step rejected for a NaN/Inf does.

:func:`has_step_hooks` says whether the update must run once, after backward (a step hook would
see part of the parameters per chunk); :func:`prefer_fused` picks torch's fused CPU kernel.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer


class StateSnapshot:
    """Per parameter stepped in this step: its optimizer state before the step (None: it had none)."""

    def __init__(self) -> None:
        self._bufs: dict[torch.Tensor, dict] = {}
        self._saved: list[tuple[torch.Tensor, dict | None]] = []

    def clear(self) -> None:
        self._saved = []

    def save(self, state: dict, params: list[torch.Tensor]) -> None:
        """Copy ``state[p]`` of every ``p`` in ``params`` aside."""
        src, dst = [], []
        for p in params:
            s = state.get(p)
            if not s:
                self._saved.append((p, None))
                continue
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
            self._saved.append((p, snap))
        if src:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)

    def restore(self, state: dict) -> None:
        """Every saved parameter's state as it was before this step's update of it."""
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
    """Whether a step pre- or post-hook is registered on ``opt``, or one of the user's on every optimizer."""
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return True
    return bool(torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


def may_write_then_raise(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` may raise after writing its state: a step post-hook (the optimizer's
    own, or a user's global one), or a step that is not torch's own (a subclass outside
    ``torch.optim``, an instance's ``step`` replaced; an LR scheduler's counter around it is not
    a replacement). A pre-hook raises before anything is written."""
    own = vars(opt).get("step")
    while getattr(own, "_wrapped_by_lr_sched", False):  # an LR scheduler's counter around the class's step
        own = own.__wrapped__
    if (opt._optimizer_step_post_hooks or own not in (None, type(opt).step)
            or not type(opt).__module__.startswith("torch.optim")):
        return True
    return bool(torch_optimizer._global_optimizer_post_hooks)


def step_or_undo(opt: torch.optim.Optimizer, states: StateSnapshot, masters: Any) -> None:
    """``opt.step()`` over ``masters`` (a :class:`~cgdp.engine.core.host_update.HostMasters`);
    if it raises, the masters and ``opt``'s state as before, then the error. Both are copied
    aside first only when the step may raise after writing them (:func:`may_write_then_raise`:
    the state, 8 bytes per AdamW parameter read and written, on the caller's thread; the masters
    retake the replicas' parameters, or with a bf16 wire, which rounds them, a copy of them);
    torch's own step without post-hooks raises before it writes (a pre-hook, its checks of the
    gradients) and costs nothing."""
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
"""Optimizers whose ``fused=True`` CPU kernel the host uses when the user chose no implementation:
measured 3-9x faster than the default single-tensor loop on CPU (``bench/bench_host_update.py``)."""


def prefer_fused(opt: torch.optim.Optimizer) -> list[int]:
    """Set ``fused=True`` in the groups of ``opt`` that chose neither ``fused`` nor ``foreach``
    (an explicit ``foreach=False`` or ``fused=False`` is kept; results agree with the default to
    float32 rounding); the indices of the groups changed."""
    if type(opt) not in FUSED_CPU:
        return []
    changed = []
    for k, g in enumerate(opt.param_groups):
        if g.get("fused") is None and g.get("foreach") is None and not g.get("differentiable"):
            g["fused"] = True
            changed.append(k)
    return changed
