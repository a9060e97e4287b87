"""Step 7, buffers: floating buffers (BatchNorm statistics) made identical on every replica, set to their batch-weighted
mean (the gradient's weights, over all ranks), what one device would hold for an even split.

Only buffers the step wrote are averaged: a mean of equal values can differ from them by a unit, so a constant buffer
(rotary frequencies, a mask) would drift. :class:`BufferWatch` keeps each replica's buffers as of the last sync and
compares (the version counter misses BatchNorm's writes). Without a comm the comparison is a device mask the host never
reads; with one the host reads the flags (one wait per device). The same copy lets a forward that is rerun
(:mod:`cgdp.engine.backend.rng`) start from the old buffers (:meth:`BufferWatch.restore`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from cgdp.comm import Comm


class BufferWatch:
    """Which of the replicas' floating buffers were written since the last :meth:`synced`."""

    def __init__(self, buffers: list[list[torch.Tensor]], others: list[list[torch.Tensor]]):
        """``others[j]``: replica j's non-floating buffers (only restored, never averaged)."""
        self.buffers, self.others = buffers, others
        self._seen = [[b.detach().clone() for b in bufs] for bufs in buffers]
        self._seen_others = [[b.detach().clone() for b in bufs] for bufs in self.others]
        self._others_version = [[b._version for b in bufs] for bufs in self.others]

    def changed(self, comm: Comm | None) -> list[bool] | torch.Tensor:
        """Per buffer: written on some replica (or rank) since the last sync; without a comm, a device bool tensor."""
        if not self.buffers[0] or (len(self.buffers) == 1 and comm is None):  # nothing to make identical
            return []
        with torch.no_grad():
            # NaN != NaN: a NaN buffer counts as written, and is averaged (it stays NaN).
            flags = [torch.stack([(b != s).any() for b, s in zip(bufs, seen)])
                     for bufs, seen in zip(self.buffers, self._seen)]
            if comm is None:  # a mask on the first device, never read by the host (sync_buffers)
                mask = flags[0]
                for f in flags[1:]:
                    mask = mask | f.to(mask.device, non_blocking=True)
                return mask
            # with a comm every rank must agree: the host reads the flags
            written = np.sum([f.cpu().numpy() for f in flags], 0, np.float64)  # note: host waits for each comparison
        # every rank must average the same buffers
        return (comm.allreduce_small(written) > 0).tolist()

    def synced(self, changed: Sequence[bool] | None = None, rerun: bool = True) -> None:
        """The buffers now are the baseline (``changed``: only those moved; a device mask: all). ``rerun``: a forward
        may be done again (:meth:`restore`), so the counters' baseline moves too, and all of it where ``changed`` could
        not tell (one replica: ``[]``); else the counters' is dropped."""
        if changed is None or isinstance(changed, torch.Tensor) or (rerun and not changed and self.buffers[0]):
            self._copy(self.buffers, self._seen)
        elif any(changed):
            pick = lambda xs: [[b for b, c in zip(bufs, changed) if c] for bufs in xs]  # noqa: E731
            self._copy(pick(self.buffers), pick(self._seen))
        if rerun:
            # the other buffers (counters, masks) are written by ordinary in-place ops, which bump the version counter:
            # copy only those written since their last copy
            moved = [[b._version != v for b, v in zip(bufs, vs)]
                     for bufs, vs in zip(self.others, self._others_version)]
            pick = lambda xs: [[b for b, m in zip(bufs, mv) if m] for bufs, mv in zip(xs, moved)]  # noqa: E731
            self._copy(pick(self.others), pick(self._seen_others))
            self._others_version = [[b._version for b in bufs] for bufs in self.others]

    def restore(self) -> None:
        """Every buffer back to the baseline (a forward is to be done again)."""
        self._copy(self._seen + self._seen_others, self.buffers + self.others)

    @staticmethod
    def _copy(src: list[list[torch.Tensor]], dst: list[list[torch.Tensor]]) -> None:
        with torch.no_grad():
            for s, d in zip(src, dst):
                if s:
                    torch._foreach_copy_(d, s)


def sync_buffers(buffers: list[list[torch.Tensor]], weights: list[float], comm: Comm | None,
                 only: Sequence[bool] | None = None) -> None:
    """``buffers[j]``: replica j's floating buffers, same order everywhere; ``only``: which to average (default all)."""
    mask = only if isinstance(only, torch.Tensor) else None
    if only is not None and mask is None:
        buffers = [[b for b, keep in zip(bufs, only) if keep] for bufs in buffers]
    if not buffers[0]:  # (one replica without a comm: the callers pass nothing to average)
        return
    with torch.no_grad():
        first = buffers[0]
        acc = torch._foreach_mul(first, weights[0])
        for j in range(1, len(buffers)):
            torch._foreach_add_(acc, [b.to(first[0].device) for b in buffers[j]], alpha=weights[j])
        if mask is not None:  # (no comm) every buffer averaged, and kept only where the mask is set
            for bufs in buffers:
                m = mask.to(bufs[0].device, non_blocking=True)
                torch._foreach_copy_(bufs, [torch.where(k, a.to(b.device), b) for k, a, b in zip(m, acc, bufs)])
            return
        if comm is not None:
            flat = comm.allreduce_small(torch.cat([a.reshape(-1).double().cpu() for a in acc]).numpy())
            for a, mean in zip(acc, torch.from_numpy(flat).split([a.numel() for a in acc])):
                a.copy_(mean.view_as(a))
        for bufs in buffers:
            torch._foreach_copy_(bufs, [a.to(bufs[0].device) for a in acc])


def copy_from_first(buffers: list[list[torch.Tensor]]) -> None:
    """Every replica's buffers take replica 0's (after a forward failed on some devices, counters would differ)."""
    with torch.no_grad():
        for bufs in buffers[1:]:
            if bufs:
                torch._foreach_copy_(bufs, [b.to(d.device) for b, d in zip(buffers[0], bufs)])
