"""``mode="typical"``: the paper's baseline (§2.3), after backward.

Device 0 gathers every device's gradient and sums it in device order, steps its optimizer, and
broadcasts the parameters to the other replicas. Nothing overlaps backward: this is the reference
cgdp is measured against.
"""
from __future__ import annotations

import torch
from torch import nn


def gather_on_first(flats: list[torch.Tensor]) -> float:
    """Device 0's flat buffer ← the sum of every device's, in device order; the NaN/Inf count."""
    first = flats[0]
    for flat in flats[1:]:
        first.add_(flat.to(first.device, non_blocking=True))
    return float((~torch.isfinite(first)).sum())  # note: CPU-GPU sync point


def broadcast_parameters(params: list[list[nn.Parameter]]) -> None:
    """Every replica's parameters ← replica 0's."""
    with torch.no_grad():
        for others in params[1:]:
            # one call per device; across devices torch copies tensor by tensor
            torch._foreach_copy_(others, params[0])
