"""Adam/AdamW on the host without a copy to undo: the moments flat, in two sides, stepped out of place.

:class:`FlatAdam` keeps the masters' ``exp_avg`` and ``exp_avg_sq`` in flat buffers, two sides each. A chunk's step reads
its parameters' moments from their current side and writes the other (one compiled call per chunk and parameter group,
the masters in place: they are taken again from the replicas after a failure). :meth:`FlatAdam.commit` makes the
written side current (the optimizer's state entries are views of it); :meth:`FlatAdam.discard` forgets it, so a failed
or rejected step leaves masters and optimizer state bitwise as before, at no cost.

The arithmetic is torch's fused CPU kernel's (``torch._fused_adam_``/``_fused_adamw_``,
``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``) for float32, bit for bit, on each CPU capability: per tensor, its
first ``n - n % VW`` elements as torch's vector loop (``VW`` 16 on AVX512, 8 otherwise), the rest as its scalar loop,
of which the compiler vectorises ``EW`` elements at a time first (8 on AVX512; none on AVX2), a rounding different from its
scalar remainder's; fused multiply-adds where torch's build has them (none on the DEFAULT capability). Double-precision
bias corrections per tensor, as torch. Only what matches is taken (:func:`usable`): Adam/AdamW with ``fused=True``, no
amsgrad, capturable, differentiable, tensor lr or betas, nor a grad scaler; the rest keeps torch's step.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Sequence

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from cgdp.engine.core.host_state import may_write_then_raise

_WIDTHS = {"AVX512": (16, 8, True), "AVX2": (8, 0, True), "DEFAULT": (8, 0, False)}
"""CPU capability → (torch's vector width, its compiler's epilogue width, fused multiply-adds)."""


@intrinsic
def _fma(typingctx, a, b, c):
    """float32 fused multiply-add (one rounding), as ``vec::fmadd`` and the compiler's contractions on AVX2/AVX512."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        return builder.call(builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f])), args)
    return sig, codegen


@intrinsic
def _sqrt(typingctx, a):
    """float32 square root (correctly rounded, as ``Vectorized::sqrt`` and ``std::sqrt``): an LLVM intrinsic, which
    vectorises (Numba's ``np.sqrt`` calls libm)."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        return builder.call(builder.module.declare_intrinsic("llvm.sqrt", [f], ir.FunctionType(f, [f])), args)
    return sig, codegen


@intrinsic
def _store_nt(typingctx, arr, i, val):
    """``arr[i] = val``, non-temporal (``vmovntps`` once vectorised: no read of the line before it is written). The
    64-byte alignment it states holds for the vector stores :func:`_chunk` lets it make (aligned runs of NT_RUN)."""
    sig = types.void(arr, i, val)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        store = builder.store(args[2], builder.gep(data, [args[1]], inbounds=True), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _fence(typingctx):
    """Orders the non-temporal stores before what follows (the step's completion, seen by another thread)."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


NT_RUN = 256
NT_FROM = 1 << 22
"""Masters from which the moments are stored non-temporally (32 MB of them; measured: 1.5x faster at 8 M elements
read from DRAM, 2x slower at 16 K stepped again from cache)."""
"""Elements per non-temporal run: a multiple of any vector width times unroll, so no scalar store of it runs."""


@njit(nogil=True, inline="always", cache=True)
def _adam(pi, gi, m0i, v0i, c):
    """One element: (exp_avg, exp_avg_sq, parameter) after the step, rounded as torch's kernel in ``mode``; the
    gradient as torch's kernel takes it: maximize (``* -1``), Adam's L2 term (``l2``)."""
    sign, wd, l2, coeff, small, c2, b2, decay, ss, bc, eps, mode = c
    gi = gi * sign
    gw = pi * wd + gi if mode == 2 else _fma(pi, wd, gi)
    gi = gw if l2 else gi
    d = gi - m0i
    base = m0i if small else gi
    mi = coeff * d + base if mode == 2 else _fma(coeff, d, base)
    cg = c2 * gi
    vb = v0i * b2
    vi = _fma(cg, gi, vb) if mode == 0 else (_fma(v0i, b2, cg * gi) if mode == 1 else vb + cg * gi)
    return mi, vi, pi * decay - (ss * mi) / (_sqrt(vi) / bc + eps)


@njit(nogil=True, inline="never", cache=True, error_model="numpy")  # x / 0 is inf, unchecked: the loop vectorises
def _span(p, g, m0, v0, m1, v1, k, mode, flags, nt):
    """One run of one tensor: ``k`` = (step size, sqrt of bias correction 2, decay, weight decay, 1 - beta1, beta2,
    1 - beta2, eps); ``mode`` 0: torch's vector loop, 1: its scalar remainder, 2: no fused multiply-add (DEFAULT);
    ``flags`` = (maximize, AdamW, weight decay); ``nt``: the moments stored non-temporally. Every choice a select
    (LLVM versions the loop; a loop compiled per mode and store measured no faster)."""
    one = np.float32(1.0)
    sign = -one if flags[0] else one  # g * -1, as torch's vector loop: -g exactly
    decay = k[2] if flags[1] and flags[2] else one  # AdamW: p * (1 - lr * wd); by 1: p exactly
    l2 = flags[2] and not flags[1]  # Adam: g + p * wd
    small = abs(k[4]) < np.float32(0.5)
    coeff = k[4] if small else k[4] - one  # exp_avg.lerp_(grad, 1 - beta1), from exp_avg's side or grad's
    c = (sign, k[3], l2, coeff, small, k[6], k[5], decay, k[0], k[1], k[7], mode)
    if nt:
        for i in range(p.shape[0]):
            mi, vi, p[i] = _adam(p[i], g[i], m0[i], v0[i], c)
            _store_nt(m1, i, mi)
            _store_nt(v1, i, vi)
    else:
        for i in range(p.shape[0]):
            m1[i], v1[i], p[i] = _adam(p[i], g[i], m0[i], v0[i], c)


@njit(nogil=True, cache=True)
def _chunk(p, g, ma, mb, va, vb, plo, glo, sizes, side, ks, flags, vw, ew, fused, nt):
    """Every tensor ``j`` of a chunk: masters ``p[plo[j]:]``, gradient ``g[glo[j]:]``, moments read from side
    ``side[j]`` (0: ``ma``, ``va``; 1: ``mb``, ``vb``) and written to the other; ``ks[j]`` its constants (:func:`_span`);
    ``nt``: long runs stored non-temporally (the step's moments are read again only by the next step)."""
    for j in range(plo.shape[0]):
        n, a, b = sizes[j], plo[j], glo[j]
        m0, v0, m1, v1 = (ma, va, mb, vb) if side[j] == 0 else (mb, vb, ma, va)
        vec = n - n % vw
        ep = vec + ((n - vec) // ew) * ew if ew else vec
        cuts = (0, vec, ep, n)
        for r in range(3):  # with nt, the vector loop's 64-byte aligned runs of NT_RUN stored non-temporally
            lo, hi, mode = cuts[r], cuts[r + 1], 2 if not fused else (1 if r == 2 else 0)
            s = min(hi, lo + (-(a + lo)) % 16) if nt and r == 0 else hi  # the moments' buffers are 64-byte aligned
            e = s + (hi - s) // NT_RUN * NT_RUN
            for x, y, t in ((lo, s, False), (s, e, True), (e, hi, False)):
                if y > x:
                    _span(p[a + x:a + y], g[b + x:b + y], m0[a + x:a + y], v0[a + x:a + y], m1[a + x:a + y],
                          v1[a + x:a + y], ks[j], mode, flags, t)
    _fence()


def usable(opt: torch.optim.Optimizer) -> bool:
    """Whether :class:`FlatAdam` steps ``opt`` as ``opt.step()`` would, bit for bit (torch's own step: not a
    user's, nor one with post-hooks)."""
    if (type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or may_write_then_raise(opt)
            or torch.backends.cpu.get_cpu_capability() not in _WIDTHS or not agrees_with_torch()):
        return False
    if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
        return False
    return all(g.get("fused") and not g.get("amsgrad") and not g.get("capturable") and not g.get("differentiable")
               and not any(isinstance(x, torch.Tensor) for x in (g["lr"], *g["betas"], g["eps"], g["weight_decay"]))
               for g in opt.param_groups)


@functools.cache
def agrees_with_torch() -> bool:
    """Once per process: two steps of tensors with vector runs and tails, Adam with L2 and AdamW, against torch's own
    (a build of torch compiled otherwise may round otherwise; then torch's step is kept)."""
    gen = torch.Generator().manual_seed(0)
    # vector runs and every kind of tail (n % 16 below and from 8: AVX-512's vectorised epilogue), both lerp branches
    sizes, same = [37, 5, 48, 25, 9, 15], True
    offsets = [0, *itertools.accumulate(sizes)][:-1]
    for cls, kw in ((torch.optim.Adam, {"weight_decay": 0.1}), (torch.optim.AdamW, {"weight_decay": 0.1}),
                    (torch.optim.AdamW, {"maximize": True, "betas": (0.3, 0.95)})):
        flat = torch.randn(sum(sizes), generator=gen)
        ref = [torch.nn.Parameter(t.clone()) for t in flat.split(sizes)]
        ps = [torch.nn.Parameter(t) for t in flat.split(sizes)]
        opts = [cls(q, lr=0.1, fused=True, **kw) for q in (ref, ps)]
        mine = FlatAdam(opts[1], ps, offsets, flat)
        for _ in range(2):
            row = torch.randn(sum(sizes), generator=gen)
            for p, g in zip(ref, row.split(sizes)):
                p.grad = g.clone()
            opts[0].step()
            mine.sync(), mine.step(list(range(len(sizes))), [0] * len(sizes), row, offsets), mine.commit()
            same = same and all(torch.equal(a, b) and all(torch.equal(opts[0].state[a][k], opts[1].state[b][k])
                                                          for k in ("exp_avg", "exp_avg_sq"))
                                for a, b in zip(ref, ps))
    return same


class FlatAdam:
    """The moments of ``masters`` (float32 tensors at ``offsets`` of one flat buffer) in two flat sides each."""

    def __init__(self, opt: torch.optim.Optimizer, masters: Sequence[torch.Tensor], offsets: Sequence[int],
                 flat: torch.Tensor):
        self.opt, self.masters = opt, list(masters)
        total = flat.numel()
        self._m = [torch.zeros(total), torch.zeros(total)]  # separate storages: a saved state holds one side
        self._v = [torch.zeros(total), torch.zeros(total)]
        self._storages = {t.untyped_storage().data_ptr() for t in self._m + self._v}
        self._np = (flat.numpy(), *(t.numpy() for t in self._m), *(t.numpy() for t in self._v))
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.sizes = np.asarray([t.numel() for t in self.masters], dtype=np.int64)
        self.side = np.zeros(len(self.masters), dtype=np.int64)
        self.steps = np.zeros(len(self.masters))  # each master's step count (0: no state)
        self._views = [[(m[o:o + n].view(t.shape), v[o:o + n].view(t.shape)) for o, n, t
                        in zip(self.offsets, self.sizes, self.masters)] for m, v in zip(self._m, self._v)]
        self._pending: list[int] = []
        self.vw, self.ew, self.fused = _WIDTHS[torch.backends.cpu.get_cpu_capability()]
        # non-temporal stores need 64-byte alignment; they pay where the moments do not stay in cache between steps
        self.nt = total >= NT_FROM and all(a.ctypes.data % 64 == 0 for a in self._np[1:])

    def sync(self) -> None:
        """Before a step (caller's thread): state entries that are not this side's views (a load, a step of torch's
        own that created state, a user's edit) are copied in and replaced by views."""
        state = self.opt.state
        for pid, t in enumerate(self.masters):
            s, (em, ev) = state.get(t), self._views[self.side[pid]][pid]
            if not s:
                if self.steps[pid]:
                    em.zero_(), ev.zero_()
                self.steps[pid] = 0
                continue
            if s.get("exp_avg") is not em or s.get("exp_avg_sq") is not ev:
                with torch.no_grad():
                    em.copy_(s["exp_avg"]), ev.copy_(s["exp_avg_sq"])
                s["exp_avg"], s["exp_avg_sq"] = em, ev
            self.steps[pid] = float(s["step"])

    def step(self, pids: Sequence[int], groups: Sequence[int], row: torch.Tensor, goffsets: Sequence[int]) -> None:
        """One out-of-place step of ``pids`` (their group indices ``groups``), gradients ``row[goffsets[pid]:]``."""
        pids = np.asarray(pids, dtype=np.int64)
        if not len(pids):
            return
        groups = np.asarray(groups)
        glo = np.asarray(goffsets, dtype=np.int64)[pids]
        for k in np.unique(groups):
            sel = pids[groups == k]
            ks, flags = self._constants(self.opt.param_groups[k], self.steps[sel] + 1)
            _chunk(self._np[0], row.numpy(), *self._np[1:], self.offsets[sel], glo[groups == k],
                   self.sizes[sel], self.side[sel], ks, flags, self.vw, self.ew, self.fused, self.nt)
        self._pending.extend(pids.tolist())

    @staticmethod
    def _constants(group: dict, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Python floats (double), as torch takes them: a numpy float32 lr would otherwise compute in float32
        lr, b1, b2, wd, eps = map(float, (group["lr"], *group["betas"], group["weight_decay"], group["eps"]))
        adamw = group.get("decoupled_weight_decay", False)
        rows = {st: (lr / (1 - b1 ** st), math.sqrt(1 - b2 ** st), 1 - lr * wd, wd, 1 - b1, b2, 1 - b2, eps)
                for st in set(steps.tolist())}  # once per step count, in double with libm's pow, as torch
        ks = np.array([rows[st] for st in steps.tolist()], dtype=np.float32)  # cast to float32 as it does
        return ks, np.asarray([group["maximize"], adamw, wd != 0], dtype=np.bool_)

    def unshown_bytes(self) -> int:
        """Bytes of the flat sides that ``optimizer.state`` does not show (the other side; both before a first step),
        for ``memory_report()``."""
        shown = sum(v.numel() * 4 for t in self.masters for k, v in self.opt.state.get(t, {}).items()
                    if k in ("exp_avg", "exp_avg_sq") and v.untyped_storage().data_ptr() in self._storages)
        return 4 * sum(t.numel() for t in self._m + self._v) - shown

    def commit(self) -> None:
        """The step succeeded: the written sides become current, state entries their views, steps counted."""
        state, counts = self.opt.state, []
        for pid in self._pending:
            self.side[pid] ^= 1
            self.steps[pid] += 1
            s = state[self.masters[pid]]
            if "step" not in s:
                s["step"] = torch.zeros((), dtype=torch.float32)
            counts.append(s["step"])
            s["exp_avg"], s["exp_avg_sq"] = self._views[self.side[pid]][pid]
        if counts:
            torch._foreach_add_(counts, 1)  # one call, as torch's step (one += per tensor: 3 us each)
        self._pending = []

    def discard(self) -> None:
        """The step failed: the written sides are scratch again."""
        self._pending = []
