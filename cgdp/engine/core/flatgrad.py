"""One flat gradient buffer per device, laid out in chunk order.

Parameters (``pid``, forward layer order) are placed chunk by chunk, each aligned to ``ALIGN`` elements, so a chunk is
one contiguous slice and one copy. Every ``param.grad`` is a view into it: autograd accumulates in place, nothing is
copied on the device. Padding stays zero. A chunk travels as segments of at most ``segment`` elements, each summed and
sent back as soon as every device's arrived, so copy out, sum and copy back overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cgdp.planning.chunks import Plan

ALIGN = 16
"""Elements: 64 bytes in float32, so every view starts on a cache line / vector boundary."""


@dataclass(frozen=True)
class Layout:
    plan: Plan
    offsets: list[int]
    """Start of each parameter (by pid) in the flat buffer."""
    numels: list[int]
    """Element count of each parameter (by pid)."""
    param_chunk: list[int]
    """Chunk of each parameter (by pid)."""
    chunk_bounds: list[tuple[int, int]]
    """[lo, hi) of each chunk."""
    chunk_params: list[int]
    """How many parameters each chunk holds (what its hook countdown starts from)."""
    total: int
    segments: list[tuple[int, int]]
    """[lo, hi) of each segment, chunk by chunk in plan order."""
    segment_chunk: list[int]
    """Chunk of each segment."""
    chunk_segments: list[range]
    """Segments of each chunk."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def make_layout(plan: Plan, layer_pids: list[list[int]], numels: list[int], segment: int) -> Layout:
    offsets = [0] * len(numels)
    param_chunk = [0] * len(numels)
    bounds, counts, segments, segment_chunk, chunk_segments = [], [], [], [], []
    pos = 0
    for c, chunk in enumerate(plan):
        lo = pos
        for layer in chunk:
            for pid in layer_pids[layer]:
                offsets[pid] = pos
                param_chunk[pid] = c
                pos += align(numels[pid])
        bounds.append((lo, pos))
        counts.append(sum(len(layer_pids[layer]) for layer in chunk))
        cuts = list(range(lo, pos, align(segment)))
        chunk_segments.append(range(len(segments), len(segments) + len(cuts)))
        segments += zip(cuts, cuts[1:] + [pos])
        segment_chunk += [c] * len(cuts)
    return Layout(plan, offsets, list(numels), param_chunk, bounds, counts, pos,
                  segments, segment_chunk, chunk_segments)


def attach_grads(flat: torch.Tensor, params: list[torch.nn.Parameter], layout: Layout) -> list[torch.Tensor]:
    """Point every ``param.grad`` at its slice of ``flat``; return the views (by pid). A dense non-contiguous parameter
    (``channels_last``) gets a view of its own strides, as autograd's layout contract gives it."""
    views = []
    for p, off, n in zip(params, layout.offsets, layout.numels):
        part = flat[off:off + n]
        p.grad = part.as_strided(p.shape, p.stride()) if _dense_not_contiguous(p) else part.view_as(p)
        views.append(p.grad)
    return views


def _dense_not_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` is dense and non-overlapping but not row-major."""
    if t.is_contiguous():  # also every empty tensor
        return False
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
