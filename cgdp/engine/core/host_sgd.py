"""SGD with momentum on the host, its buffers flat in two sides (:class:`~cgdp.engine.core.host_flat.FlatState`).

:class:`FlatSGD` keeps the masters' ``momentum_buffer`` flat and steps a chunk out of place, torch's fused CPU kernel's
arithmetic (``torch._fused_sgd_``, ``aten/src/ATen/native/cpu/FusedSGDKernel.cpp``) for float32, bit for bit, on each
CPU capability: weight decay, dampening, nesterov, maximize; a tensor's first step takes the gradient as its buffer (as
torch's ``is_first_step``). Only what matches is taken (:func:`usable`): SGD with ``fused=True`` and momentum in every
group, not differentiable, no tensor lr, nor a grad scaler. Without momentum SGD has no state: nothing to copy aside
for a failure, so torch's step is kept (flat, it would hold two unused sides of the parameters' size).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from cgdp.engine.core.host_flat import FlatState, fma, runs


@njit(nogil=True, inline="always", cache=True)
def _sgd(pi, gi, m0i, c):
    """One element: (momentum buffer, parameter) after the step, rounded as torch's kernel in ``mode``."""
    sign, wd, decay, mom, damp, lr, first, nesterov, mode = c
    gi = gi * sign
    gw = pi * wd + gi if mode == 2 else fma(pi, wd, gi)
    gi = gw if decay else gi
    # buf * momentum + grad * (1 - dampening): torch's vector loop contracts the second product, its scalar the first
    mc = m0i * mom + gi * damp if mode == 2 else (fma(gi, damp, m0i * mom) if mode == 0 else fma(m0i, mom, gi * damp))
    mi = gi if first else mc
    gn = gi + mi * mom if mode == 2 else fma(mi, mom, gi)
    gi = gn if nesterov else mi
    return mi, pi - gi * lr if mode == 2 else fma(gi, -lr, pi)


@njit(nogil=True, inline="never", cache=True)
def _span(p, g, m0, m1, k, flags, first, mode):
    """One run of one tensor: ``k`` = (weight decay, momentum, 1 - dampening, lr); ``flags`` = (maximize, weight decay,
    nesterov); ``first``: no buffer yet. Every choice a select (LLVM versions the loop)."""
    one = np.float32(1.0)
    c = (-one if flags[0] else one, k[0], flags[1], k[1], k[2], k[3], first, flags[2], mode)
    for i in range(p.shape[0]):
        m1[i], p[i] = _sgd(p[i], g[i], m0[i], c)


@njit(nogil=True, cache=True)
def _chunk(p, g, ma, mb, plo, glo, sizes, side, first, k, flags, vw, ew, fused):
    """Every tensor ``j`` of a chunk: masters ``p[plo[j]:]``, gradient ``g[glo[j]:]``, buffer read from side ``side[j]``
    (0: ``ma``; 1: ``mb``) and written to the other."""
    for j in range(plo.shape[0]):
        n, a, b = sizes[j], plo[j], glo[j]
        m0, m1 = (ma, mb) if side[j] == 0 else (mb, ma)
        for lo, hi, mode in runs(n, vw, ew, fused):
            if hi > lo:
                _span(p[a + lo:a + hi], g[b + lo:b + hi], m0[a + lo:a + hi], m1[a + lo:a + hi], k, flags, first[j],
                      mode)


class FlatSGD(FlatState):
    """The momentum buffers of ``masters`` (float32 tensors at ``offsets`` of one flat buffer) in two flat sides."""

    keys = ("momentum_buffer",)
    classes = (torch.optim.SGD,)
    checks = ((torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1, "dampening": 0.3}),
              (torch.optim.SGD, {"momentum": 0.8, "nesterov": True, "maximize": True, "weight_decay": 0.1}))

    @staticmethod
    def takes(group: dict) -> bool:
        return group["momentum"] != 0

    def _kernel(self, group: dict, pids: np.ndarray, glo: np.ndarray, row: np.ndarray) -> None:
        # Python floats (double), as torch takes them, cast to float32 as its kernel does
        lr, mom, damp, wd = map(float, (group["lr"], group["momentum"], group["dampening"], group["weight_decay"]))
        k = np.array([wd, mom, 1 - damp, lr], dtype=np.float32)
        flags = np.asarray([group["maximize"], wd != 0, group["nesterov"]], dtype=np.bool_)
        _chunk(self._np[0], row, *self._np[1:], self.offsets[pids], glo, self.sizes[pids], self.side[pids],
               self.steps[pids] == 0, k, flags, self.vw, self.ew, self.fused)


usable = FlatSGD.usable
