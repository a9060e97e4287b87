"""``mode="typical"``: the paper's baseline (§2.3), after backward.

Device 0 gathers every device's gradient and sums it in device order, steps its optimizer, and
broadcasts the parameters to the other replicas. Nothing overlaps backward: this is the reference
cgdp is measured against.
"""
from __future__ import annotations

import torch
from torch import nn

from cgdp.engine.precision import sum_dtype


def gather_on_first(flats: list[torch.Tensor]) -> float:
    """Device 0's flat buffer ← the sum of every device's, in device order; the NaN/Inf count.
    16-bit gradients are summed in float32 and rounded once, as the host does."""
    first = flats[0]
    total = first.to(sum_dtype(first.dtype))  # first itself for float32/float64
    for flat in flats[1:]:
        total.add_(flat.to(first.device, non_blocking=True))
    if total is not first:
        first.copy_(total)
    return float((~torch.isfinite(first)).sum())  # note: CPU-GPU sync point


def broadcast_parameters(params: list[list[nn.Parameter]]) -> None:
    """Every replica's parameters ← replica 0's."""
    with torch.no_grad():
        for others in params[1:]:
            # one call per device; across devices torch copies tensor by tensor
            torch._foreach_copy_(others, params[0])
