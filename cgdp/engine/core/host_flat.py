"""Optimizer state on the host without a copy to undo: flat, in two sides, stepped out of place.

:class:`FlatState` keeps the masters' state tensors (Adam's moments: :mod:`~cgdp.engine.core.host_adam`, SGD's momentum:
:mod:`~cgdp.engine.core.host_sgd`) in flat float32 buffers, two sides each. A chunk's step reads its parameters' state
from their current side and writes the other (one compiled call per chunk and parameter group, the masters in place:
they are taken again from the replicas after a failure). :meth:`FlatState.commit` makes the written side current (the
optimizer's state entries are views of it); :meth:`FlatState.discard` forgets it, so a failed or rejected step leaves
masters and optimizer state bitwise as before, at no cost.

Each kernel is torch's fused CPU kernel's arithmetic for float32, bit for bit, on each CPU capability: per tensor, its
first ``n - n % VW`` elements as torch's vector loop (``VW`` 16 on AVX512, 8 otherwise), the rest as its scalar loop,
of which the compiler vectorises ``EW`` elements at a time first (8 on AVX512; none on AVX2), rounded as the vector
loop and not as its scalar remainder; fused multiply-adds where torch's build has them (none on the DEFAULT capability).
Only what matches is taken (:meth:`FlatState.usable`), and only where a once-per-process check against torch's own
step agrees (:func:`agrees_with_torch`); the rest keeps torch's step.
"""
from __future__ import annotations

import functools
import itertools
from typing import Sequence

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from cgdp.engine.core.host_state import may_write_then_raise

WIDTHS = {"AVX512": (16, 8, True), "AVX2": (8, 0, True), "DEFAULT": (8, 0, False)}
"""CPU capability → (torch's vector width, its compiler's epilogue width, fused multiply-adds)."""


@intrinsic
def fma(typingctx, a, b, c):
    """float32 fused multiply-add (one rounding), as ``vec::fmadd`` and the compiler's contractions on AVX2/AVX512."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        return builder.call(builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f])), args)
    return sig, codegen


@njit(nogil=True, inline="always", cache=True)
def runs(n, vw, ew, fused):
    """A tensor's runs (start, end, mode) as torch's kernel steps them; mode 0: its vector loop (and the compiler's
    vectorised epilogue), 1: its scalar remainder, 2: no fused multiply-add (DEFAULT)."""
    vec = n - n % vw
    ep = vec + ((n - vec) // ew) * ew if ew else vec
    return ((0, vec, 0 if fused else 2), (vec, ep, 0 if fused else 2), (ep, n, 1 if fused else 2))


class FlatState:
    """The state entries ``keys`` of ``masters`` (float32 tensors at ``offsets`` of one flat buffer) in two flat sides
    each. A kernel's class says which optimizers it steps (``classes``, ``takes``), checks itself against torch
    (``checks``) and steps a group's tensors (``_kernel``)."""

    keys: tuple[str, ...] = ()
    classes: tuple[type, ...] = ()
    checks: tuple[tuple[type, dict], ...] = ()
    """(torch optimizer, its arguments) for :func:`agrees_with_torch`."""

    def __init__(self, opt: torch.optim.Optimizer, masters: Sequence[torch.Tensor], offsets: Sequence[int],
                 flat: torch.Tensor):
        self.opt, self.masters = opt, list(masters)
        total = flat.numel()
        sides = [[torch.zeros(total) for _ in self.keys] for _ in range(2)]  # separate storages: a state holds one
        self._storages = {t.untyped_storage().data_ptr() for s in sides for t in s}
        self._np = (flat.numpy(), *(sides[i][k].numpy() for k in range(len(self.keys)) for i in range(2)))
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.sizes = np.asarray([t.numel() for t in self.masters], dtype=np.int64)
        self.side = np.zeros(len(self.masters), dtype=np.int64)
        self.steps = np.zeros(len(self.masters))  # each master's step count (0: no state)
        self._views = [[tuple(t[o:o + n].view(m.shape) for t in s) for o, n, m
                        in zip(self.offsets, self.sizes, self.masters)] for s in sides]
        self._pending: list[int] = []
        self.vw, self.ew, self.fused = WIDTHS[torch.backends.cpu.get_cpu_capability()]

    @classmethod
    def usable(cls, opt: torch.optim.Optimizer) -> bool:
        """Whether this class steps ``opt`` as ``opt.step()`` would, bit for bit (torch's own step: not a user's, nor
        one with post-hooks; ``fused=True``, no tensor hyperparameter, no grad scaler)."""
        if (type(opt) not in cls.classes or may_write_then_raise(opt)
                or torch.backends.cpu.get_cpu_capability() not in WIDTHS):
            return False
        if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
            return False
        return all(g.get("fused") and not g.get("capturable") and not g.get("differentiable") and cls.takes(g)
                   and not any(isinstance(x, torch.Tensor) for k, v in g.items() if k != "params"
                               for x in (v if isinstance(v, tuple) else (v,)))
                   for g in opt.param_groups) and agrees_with_torch(cls)

    @staticmethod
    def takes(group: dict) -> bool:
        return True

    def sync(self) -> None:
        """Before a step (caller's thread): state entries that are not this side's views (a load, a step of torch's
        own that created state, a user's edit) are copied in and replaced by views."""
        state = self.opt.state
        for pid, t in enumerate(self.masters):
            s, views = state.get(t), self._views[self.side[pid]][pid]
            if not s or any(s.get(k) is None for k in self.keys):  # a None buffer: none yet, as torch's SGD reads it
                if self.steps[pid]:
                    for v in views:
                        v.zero_()
                self.steps[pid] = 0
                continue
            if any(s.get(k) is not v for k, v in zip(self.keys, views)):
                with torch.no_grad():
                    for k, v in zip(self.keys, views):
                        v.copy_(s[k])
                        s[k] = v
            self.steps[pid] = float(s.get("step", 1))  # SGD counts no steps: 1 for "has state"

    def step(self, pids: Sequence[int], groups: Sequence[int], row: torch.Tensor, goffsets: Sequence[int]) -> None:
        """One out-of-place step of ``pids`` (their group indices ``groups``), gradients ``row[goffsets[pid]:]``."""
        pids = np.asarray(pids, dtype=np.int64)
        if not len(pids):
            return
        groups = np.asarray(groups)
        glo = np.asarray(goffsets, dtype=np.int64)[pids]
        for k in np.unique(groups):
            self._kernel(self.opt.param_groups[k], pids[groups == k], glo[groups == k], row.numpy())
        self._pending.extend(pids.tolist())

    def _kernel(self, group: dict, pids: np.ndarray, glo: np.ndarray, row: np.ndarray) -> None:
        raise NotImplementedError

    def unshown_bytes(self) -> int:
        """Bytes of the flat sides that ``optimizer.state`` does not show (the other side; both before a first step),
        for ``memory_report()``."""
        shown = sum(v.numel() * 4 for t in self.masters for k, v in self.opt.state.get(t, {}).items()
                    if k in self.keys and v.untyped_storage().data_ptr() in self._storages)
        return 4 * 2 * len(self.keys) * self._np[0].size - shown

    def commit(self) -> None:
        """The step succeeded: the written sides become current, state entries their views, steps counted."""
        state = self.opt.state
        for pid in self._pending:
            self.side[pid] ^= 1
            self.steps[pid] += 1
            state[self.masters[pid]].update(zip(self.keys, self._views[self.side[pid]][pid]))
        self._pending = []

    def discard(self) -> None:
        """The step failed: the written sides are scratch again."""
        self._pending = []


@functools.cache
def agrees_with_torch(cls: type[FlatState]) -> bool:
    """Once per process and class: two steps of tensors with vector runs and tails against torch's own (a build of
    torch compiled otherwise may round otherwise; then torch's step is kept)."""
    gen = torch.Generator().manual_seed(0)
    # vector runs and every kind of tail (n % 16 below and from 8: AVX-512's vectorised epilogue)
    sizes, same = [37, 5, 48, 25, 9, 15], True
    offsets = [0, *itertools.accumulate(sizes)][:-1]
    for opt_cls, kw in cls.checks:
        flat = torch.randn(sum(sizes), generator=gen)
        ref = [torch.nn.Parameter(t.clone()) for t in flat.split(sizes)]
        ps = [torch.nn.Parameter(t) for t in flat.split(sizes)]
        opts = [opt_cls(q, lr=0.1, fused=True, **kw) for q in (ref, ps)]
        mine = cls(opts[1], ps, offsets, flat)
        for _ in range(2):
            row = torch.randn(sum(sizes), generator=gen)
            for p, g in zip(ref, row.split(sizes)):
                p.grad = g.clone()
            opts[0].step()
            mine.sync(), mine.step(list(range(len(sizes))), [0] * len(sizes), row, offsets), mine.commit()
            same = same and all(torch.equal(a, b) and all(torch.equal(opts[0].state[a][k], opts[1].state[b][k])
                                                          for k in cls.keys) for a, b in zip(ref, ps))
    return same
