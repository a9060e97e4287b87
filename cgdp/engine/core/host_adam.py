"""Adam/AdamW on the host, its moments flat in two sides (:class:`~cgdp.engine.core.host_flat.FlatState`).

:class:`FlatAdam` keeps the masters' ``exp_avg`` and ``exp_avg_sq`` flat and steps a chunk out of place, torch's fused
CPU kernel's arithmetic (``torch._fused_adam_``/``_fused_adamw_``, ``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``)
for float32, bit for bit, on each CPU capability; double-precision bias corrections per tensor, as torch. Only what
matches is taken (:func:`usable`): Adam/AdamW with ``fused=True``, no amsgrad, capturable, differentiable, tensor lr
or betas, nor a grad scaler; the rest keeps torch's step.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from cgdp.engine.core.host_flat import FlatState, fma as _fma, runs

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
        for lo, hi, mode in runs(n, vw, ew, fused):  # with nt, the vector loop's 64-byte aligned runs of NT_RUN
            s = min(hi, lo + (-(a + lo)) % 16) if nt and lo == 0 else hi  # stored non-temporally (buffers aligned)
            e = s + (hi - s) // NT_RUN * NT_RUN
            for x, y, t in ((lo, s, False), (s, e, True), (e, hi, False)):
                if y > x:
                    _span(p[a + x:a + y], g[b + x:b + y], m0[a + x:a + y], v0[a + x:a + y], m1[a + x:a + y],
                          v1[a + x:a + y], ks[j], mode, flags, t)
    _fence()


class FlatAdam(FlatState):
    """The moments of ``masters`` (float32 tensors at ``offsets`` of one flat buffer) in two flat sides each."""

    keys = ("exp_avg", "exp_avg_sq")
    classes = (torch.optim.Adam, torch.optim.AdamW)
    # both lerp branches (1 - beta1 above 0.5 too), Adam's L2 and AdamW's decay, maximize
    checks = ((torch.optim.Adam, {"weight_decay": 0.1}), (torch.optim.AdamW, {"weight_decay": 0.1}),
              (torch.optim.AdamW, {"maximize": True, "betas": (0.3, 0.95)}))

    def __init__(self, opt: torch.optim.Optimizer, masters: Sequence[torch.Tensor], offsets: Sequence[int],
                 flat: torch.Tensor):
        super().__init__(opt, masters, offsets, flat)
        # non-temporal stores need 64-byte alignment; they pay where the moments do not stay in cache between steps
        self.nt = flat.numel() >= NT_FROM and all(a.ctypes.data % 64 == 0 for a in self._np[1:])

    @staticmethod
    def takes(group: dict) -> bool:
        return not group.get("amsgrad")

    def _kernel(self, group: dict, pids: np.ndarray, glo: np.ndarray, row: np.ndarray) -> None:
        ks, flags = self._constants(group, self.steps[pids] + 1)
        _chunk(self._np[0], row, *self._np[1:], self.offsets[pids], glo, self.sizes[pids], self.side[pids], ks, flags,
               self.vw, self.ew, self.fused, self.nt)

    @staticmethod
    def _constants(group: dict, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Python floats (double), as torch takes them: a numpy float32 lr would otherwise compute in float32
        lr, b1, b2, wd, eps = map(float, (group["lr"], *group["betas"], group["weight_decay"], group["eps"]))
        adamw = group.get("decoupled_weight_decay", False)
        rows = {st: (lr / (1 - b1 ** st), math.sqrt(1 - b2 ** st), 1 - lr * wd, wd, 1 - b1, b2, 1 - b2, eps)
                for st in set(steps.tolist())}  # once per step count, in double with libm's pow, as torch
        ks = np.array([rows[st] for st in steps.tolist()], dtype=np.float32)  # cast to float32 as it does
        return ks, np.asarray([group["maximize"], adamw, wd != 0], dtype=np.bool_)

    def commit(self) -> None:
        """As :meth:`FlatState.commit`, and each stepped tensor's ``step`` counted."""
        state, counts = self.opt.state, []
        for pid in self._pending:
            s = state[self.masters[pid]]
            if "step" not in s:
                s["step"] = torch.zeros((), dtype=torch.float32)
            counts.append(s["step"])
        if counts:
            torch._foreach_add_(counts, 1)  # one call, as torch's step (one += per tensor: 3 us each)
        super().commit()


usable = FlatAdam.usable
