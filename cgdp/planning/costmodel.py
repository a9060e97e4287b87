"""The paper's cost model of the backward phase (Le et al., ICPE 2018, §3.2), exactly.

Every function takes per-layer times as sequences in *backward order*: element 0 is the layer
computed first in backward (the paper's layer l), the last element is the layer computed last (the
paper's layer 1). Times are in any one unit (the result is in the same unit).

* ``t_bp``: back-propagation time of the layer on the device (steps B-1..B-4).
* ``t_as``: synchronisation of the compute stream with the host before the layer's gradient is
  sent (step B-4-1); zero in the typical training.
* ``t_aa``: sending the layer's gradient to the host and accumulating it there (step B-4-2); in the
  typical training, the accumulation on the server device.
* ``t_bc``: broadcasting the accumulated gradient back to the devices (step B-4-3); in the typical
  training, the parameter broadcast (§3.2 assumes the two are equal per layer).

The model assumes every device runs at the same pace and that the host work of different layers
overlaps freely (no queueing on links or host threads). :mod:`cgdp.planning.simulator` drops those two
assumptions; with uncontended stages it reproduces :func:`cgdp_backward_time` exactly.

Chunks (§4.1) enter through :func:`chunk_times`: a chunk behaves as one layer whose ``t_bp``,
``t_aa`` and ``t_bc`` are the sums over its layers and which pays one ``t_as``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def _floats(name: str, values: Sequence[float], n: int | None = None) -> list[float]:
    out = [float(v) for v in values]
    if n is not None and len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but t_bp has {n}; give one time per layer, "
                         f"in backward order")
    for v in out:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must hold finite non-negative times, got {v!r}")
    return out


def layer_completion_times(t_bp: Sequence[float], t_as: Sequence[float], t_aa: Sequence[float],
                           t_bc: Sequence[float]) -> list[float]:
    """Definition 3.2: per layer (backward order), T_BP^i = Σ_{j=l..i}(t_bp^j + t_as^j) + t_aa^i + t_bc^i,
    the time from the start of backward until the layer's averaged gradient is on the device."""
    bp = _floats("t_bp", t_bp)
    n = len(bp)
    a_s, a_a, b_c = _floats("t_as", t_as, n), _floats("t_aa", t_aa, n), _floats("t_bc", t_bc, n)
    out, prefix = [], 0.0
    for i in range(n):
        prefix += bp[i] + a_s[i]
        out.append(prefix + a_a[i] + b_c[i])
    return out


def cgdp_backward_time(t_bp: Sequence[float], t_as: Sequence[float], t_aa: Sequence[float],
                       t_bc: Sequence[float]) -> float:
    """Definition 3.3: T = max_i T_BP^i, the backward phase of CGDP training (0 for no layers)."""
    return max(layer_completion_times(t_bp, t_as, t_aa, t_bc), default=0.0)


def backprop_time(t_bp: Sequence[float]) -> float:
    """Definition 3.1: T_BP = Σ t_bp^i, back-propagation alone."""
    return sum(_floats("t_bp", t_bp))


def typical_backward_time(t_bp: Sequence[float], t_aa: Sequence[float], t_bc: Sequence[float]) -> float:
    """Definition 3.4: T' = T_BP + Σ_i (t_aa^i + t_bc^i), the backward phase of typical training."""
    bp = _floats("t_bp", t_bp)
    n = len(bp)
    return sum(bp) + sum(_floats("t_aa", t_aa, n)) + sum(_floats("t_bc", t_bc, n))


def typical_overhead(t_aa: Sequence[float], t_bc: Sequence[float]) -> float:
    """T'_O = T' − T_BP = Σ_i (t_aa^i + t_bc^i)."""
    a_a = _floats("t_aa", t_aa)
    return sum(a_a) + sum(_floats("t_bc", t_bc, len(a_a)))


def cgdp_overhead(t_as: Sequence[float], t_aa: Sequence[float], t_bc: Sequence[float]) -> float:
    """T_O = Σ_i t_as^i + t_aa^1 + t_bc^1: the paper's simplified CGDP overhead, assuming the host
    work of every layer but the last one of backward hides behind later back-propagation."""
    a_s = _floats("t_as", t_as)
    a_a, b_c = _floats("t_aa", t_aa, len(a_s)), _floats("t_bc", t_bc, len(a_s))
    if not a_s:
        return 0.0
    return sum(a_s) + a_a[-1] + b_c[-1]


def cgdp_exact_overhead(t_bp: Sequence[float], t_as: Sequence[float], t_aa: Sequence[float],
                        t_bc: Sequence[float]) -> float:
    """T − T_BP from Definition 3.3, without the perfect-overlap simplification."""
    return cgdp_backward_time(t_bp, t_as, t_aa, t_bc) - backprop_time(t_bp)


def cgdp_wins(t_as: Sequence[float], t_aa: Sequence[float], t_bc: Sequence[float]) -> bool:
    """§3.2: CGDP is faster than typical training when T_O < T'_O."""
    return cgdp_overhead(t_as, t_aa, t_bc) < typical_overhead(t_aa, t_bc)


def paper_win_condition(t_as: Sequence[float], t_aa: Sequence[float], t_bc: Sequence[float]) -> bool:
    """§3.2's sufficient form when layer 1 is small: Σ_{i=l..1} t_as^i < Σ_{i=l..2} (t_aa^i + t_bc^i),
    i.e. the syncs cost less than the host work of every layer but the last one of backward."""
    a_s = _floats("t_as", t_as)
    a_a, b_c = _floats("t_aa", t_aa, len(a_s)), _floats("t_bc", t_bc, len(a_s))
    return sum(a_s) < sum(a_a[:-1]) + sum(b_c[:-1])


@dataclass(frozen=True)
class ChunkTimes:
    """Per-chunk times for the cost model, in the plan's send order."""

    t_bp: list[float]
    """Back-propagation of the chunk's layers (sum)."""
    t_as: list[float]
    """One synchronisation per chunk."""
    t_aa: list[float]
    """Send and accumulate the chunk (sum over its layers, §4.1)."""
    t_bc: list[float]
    """Broadcast the chunk back (sum over its layers)."""


def chunk_times(sizes: Sequence[int], t_bp: Sequence[float], t_as: float | Sequence[float],
                t_aa: Sequence[float], t_bc: Sequence[float]) -> ChunkTimes:
    """Group per-layer times (backward order) into chunks of the given sizes (backward order).

    ``t_as`` is the cost of one synchronisation: a number, or per layer (then the chunk pays the
    value of its last layer, where its sync happens).
    """
    bp = _floats("t_bp", t_bp)
    n = len(bp)
    a_a, b_c = _floats("t_aa", t_aa, n), _floats("t_bc", t_bc, n)
    a_s = [float(t_as)] * n if isinstance(t_as, (int, float)) else _floats("t_as", t_as, n)
    if sum(sizes) != n or any(s < 1 for s in sizes):
        raise ValueError(f"chunk sizes {list(sizes)} must be positive and add up to the {n} layers")
    out = ChunkTimes([], [], [], [])
    start = 0
    for s in sizes:
        end = start + s
        out.t_bp.append(sum(bp[start:end]))
        out.t_as.append(a_s[end - 1])
        out.t_aa.append(sum(a_a[start:end]))
        out.t_bc.append(sum(b_c[start:end]))
        start = end
    return out
