"""One flat gradient buffer per device, laid out in chunk order.

Parameters are numbered (``pid``) in forward layer order. The layout places the parameters of chunk 0 first, then chunk
1, ..., each parameter aligned to ``ALIGN`` elements, so that every chunk is one contiguous slice ``[lo, hi)`` and
travels as a single copy. ``param.grad`` of every replica is a view into its device's buffer: autograd accumulates
straight into it (``grad += new`` in place, since the buffer is zeroed before backward), so no gradient is ever copied
on the device. Padding elements stay zero and are summed like the rest.

A chunk travels as one or more *segments* of at most ``segment`` elements. Segments of one chunk leave together, but the
host sums each as soon as it has arrived from every device and sends it back at once, so the copy out, the sum and the
copy back of a large chunk overlap each other: the unhidden tail after backward is about the slowest of the three
stages, not their sum.
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


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def make_layout(plan: Plan, layer_pids: list[list[int]], numels: list[int],
                segment: int | None = None) -> Layout:
    offsets = [0] * len(numels)
    param_chunk = [0] * len(numels)
    bounds, counts = [], []
    pos = 0
    for c, chunk in enumerate(plan):
        lo, n = pos, 0
        for layer in chunk:
            for pid in layer_pids[layer]:
                offsets[pid] = pos
                param_chunk[pid] = c
                pos += _align(numels[pid])
                n += 1
        bounds.append((lo, pos))
        counts.append(n)
    step = _align(segment) if segment else 0
    segments, segment_chunk, chunk_segments = [], [], []
    for c, (lo, hi) in enumerate(bounds):
        first = len(segments)
        cuts = list(range(lo, hi, step)) if step else [lo]
        for a, b in zip(cuts, cuts[1:] + [hi]):
            segments.append((a, b))
            segment_chunk.append(c)
        chunk_segments.append(range(first, len(segments)))
    return Layout(plan, offsets, list(numels), param_chunk, bounds, counts, pos,
                  segments, segment_chunk, chunk_segments)


def attach_grads(flat: torch.Tensor, params: list[torch.nn.Parameter], layout: Layout) -> list[torch.Tensor]:
    """Point every ``param.grad`` at its slice of ``flat``; return those views (by pid).

    Each view has its parameter's strides when the parameter is dense (``channels_last`` convolutions): autograd's
    layout contract, which one device keeps, gives such a parameter a gradient of the same strides. The slice is still
    the parameter's ``numel`` elements, in the same order on every replica, so chunks and the host sum do not see the
    difference."""
    views = []
    for pid, p in enumerate(params):
        off = layout.offsets[pid]
        part = flat[off:off + layout.numels[pid]]
        p.grad = part.as_strided(p.shape, p.stride()) if _dense_not_contiguous(p) else part.view_as(p)
        views.append(p.grad)
    return views


def _dense_not_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill exactly ``numel`` places in another order than row-major (non-overlapping and
    dense, as autograd's layout contract says, but not contiguous)."""
    if t.is_contiguous() or t.numel() == 0:
        return False
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
