"""``mode="typical"``: the paper's baseline (§2.3), after backward.

Device 0 gathers every device's gradient and sums it in device order, steps its optimizer, and
broadcasts the parameters to the other replicas. Nothing overlaps backward: this is the reference
cgdp is measured against. On GPUs both collectives are coalesced, as in the paper's baseline and
``nn.DataParallel`` (one NCCL reduce of the flat buffers, which are already coalesced, and one
bucketed ``broadcast_coalesced`` of the parameters), so the comparison does not flatter cgdp.
Emulated devices add in device order.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from cgdp.engine.backend.base import Device
from cgdp.engine.core.precision import sum_dtype


def gather_on_first(devs: Sequence[Device], flats: list[torch.Tensor]) -> float:
    """Device 0's flat buffer ← the sum of every device's, in device order; the NaN/Inf count.
    16-bit gradients are summed in float32 and rounded once, as the host does. On GPUs, float32
    and float64 buffers are reduced with one collective (:func:`~cgdp.engine.backend.cuda.reduce_to_first`)."""
    first = flats[0]
    if devs[0].is_cuda and sum_dtype(first.dtype) == first.dtype:
        from cgdp.engine.backend.cuda import reduce_to_first
        reduce_to_first(devs, flats)
        return float((~torch.isfinite(first)).sum())  # note: CPU-GPU sync point
    total = first.to(sum_dtype(first.dtype))  # first itself for float32/float64
    for flat in flats[1:]:
        total.add_(flat.to(first.device, non_blocking=True))
    if total is not first:
        first.copy_(total)
    return float((~torch.isfinite(first)).sum())  # note: CPU-GPU sync point


def broadcast_parameters(devs: Sequence[Device], params: list[list[nn.Parameter]]) -> None:
    """Every replica's parameters ← replica 0's."""
    if devs[0].is_cuda:
        from cgdp.engine.backend.cuda import broadcast_from_first
        broadcast_from_first(devs, params)
        return
    with torch.no_grad():
        for others in params[1:]:
            torch._foreach_copy_(others, params[0])
