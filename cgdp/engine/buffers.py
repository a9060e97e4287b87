"""Step 7, buffers: floating buffers (BatchNorm statistics) made identical on every replica.

Each replica updated its running statistics on its own part of the batch; after the update every
replica's floating buffers are set to their batch-weighted mean (the weights of the gradient, so
over all ranks with a comm), which is what one device would hold for an even split.
"""
from __future__ import annotations

import torch

from cgdp.comm import Comm


def sync_buffers(buffers: list[list[torch.Tensor]], weights: list[float], comm: Comm | None) -> None:
    """``buffers[j]``: replica j's floating buffers, in the same order on every replica."""
    if not buffers[0] or (len(buffers) == 1 and comm is None):
        return
    with torch.no_grad():
        first = buffers[0]
        acc = torch._foreach_mul(first, weights[0])
        for j in range(1, len(buffers)):
            torch._foreach_add_(acc, [b.to(first[0].device) for b in buffers[j]], alpha=weights[j])
        if comm is not None:
            flat = torch.cat([a.reshape(-1).double().cpu() for a in acc]).numpy()
            flat = comm.allreduce_small(flat)
            pos = 0
            for a in acc:
                a.copy_(torch.from_numpy(flat[pos:pos + a.numel()]).view_as(a))
                pos += a.numel()
        for bufs in buffers:
            torch._foreach_copy_(bufs, [a.to(bufs[0].device) for a in acc])
