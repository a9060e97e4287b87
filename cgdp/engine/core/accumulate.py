"""The host kernel, step 4 of the data path: ``out[:] = scale * (parts[0] + parts[1] + ...)``, at memory bandwidth.

Entry points here (checks, parallel or serial, warm-up, threads); the Numba kernels in :mod:`cgdp.engine.core.kernels`.

* Parts are summed in the order given, in their dtype, then scaled once: bitwise reproducible for any thread count,
  equal to NumPy's ``scale * sum(parts)``.
* The NaN/Inf count (the return value), the sum of squares (``sumsq``) and the rounding to 16 bits (``rounded``) are
  taken in the same pass.
* The kernels are ``nogil``; 16-bit parts (bf16 bits as ``uint16``, fp16 as ``float16``) are summed in float32.
"""
from __future__ import annotations

from typing import Sequence

import numba
import numpy as np

from cgdp.engine.core import fork
from cgdp.engine.core.kernels import ROUND, SUM, SUM_WIDE, SUMSQ

SERIAL_BELOW = 1 << 16
"""Below this many elements a parallel launch costs more than it saves."""
_WIDEN = {np.dtype(np.uint16): False, np.dtype(np.float16): True}
"""uint16 arrays hold bf16 bits, float16 arrays IEEE half (read as bits and widened exactly)."""


def _check(out: np.ndarray, parts: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    if not isinstance(out, np.ndarray) or out.ndim != 1:
        raise TypeError(f"out must be a 1-D NumPy array, got {type(out).__name__} "
                        f"{getattr(out, 'shape', '')}")
    if out.dtype not in (np.float32, np.float64):
        raise TypeError(f"out must be float32 (or float64), got {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be a contiguous, writeable array")
    if len(parts) == 0:
        raise ValueError("accumulate needs at least one part")
    parts = tuple(parts)
    dt = parts[0].dtype if isinstance(parts[0], np.ndarray) else None
    for k, p in enumerate(parts):
        if not isinstance(p, np.ndarray) or p.ndim != 1:
            raise TypeError(f"part {k} must be a 1-D NumPy array, got {type(p).__name__}")
        if p.dtype != dt:
            raise TypeError(f"all parts must share one dtype; part 0 is {dt}, part {k} is {p.dtype}")
        if p.shape != out.shape:
            raise ValueError(f"part {k} has {p.shape[0]} elements but out has {out.shape[0]}")
        if not p.flags.c_contiguous:
            raise ValueError(f"part {k} must be contiguous")
    if dt in _WIDEN:
        if out.dtype != np.float32:
            raise TypeError("16-bit parts (bf16 bits as uint16, or float16) accumulate into a float32 out")
    elif dt != out.dtype:
        raise TypeError(f"parts are {dt} but out is {out.dtype}; they must match "
                        f"(or pass bf16 bits as uint16, or float16, with a float32 out)")
    return parts


def accumulate(out: np.ndarray, parts: Sequence[np.ndarray], scale: float = 1.0, *,
               sumsq: bool = False) -> int | tuple[int, float]:
    """``out[:] = scale * sum(parts)``; returns the non-finite count, and with ``sumsq`` the float64 sum of squares.
    ``out`` may alias ``parts[0]``."""
    parts = _check(out, parts)
    bad, sq = accumulate_unchecked(out, parts, scale, sumsq)
    return (bad, sq) if sumsq else bad


def accumulate_unchecked(out: np.ndarray | None, parts: tuple[np.ndarray, ...], scale: float = 1.0,
                         sumsq: bool = False, rounded: np.ndarray | None = None) -> tuple[int, float]:
    """The engine's entry, unchecked: ``(non-finite count, sumsq or 0.0)``. 16-bit parts: ``rounded`` also receives
    ``out`` rounded in the same pass, and ``out`` may be None (only the rounding is written)."""
    s = np.float32(scale) if out is None else out.dtype.type(scale)
    parallel = _parallel(parts[0].shape[0])
    half = _WIDEN.get(parts[0].dtype)
    if half is None:
        bad, sq = SUM[parallel](out, s, sumsq, *parts)
    else:
        bad, sq = SUM_WIDE[parallel](_NO_OUT if out is None else out, s, sumsq, half,
                                     _NO_BACK if rounded is None else rounded.view(np.uint16),
                                     *(p.view(np.uint16) for p in parts))
    return int(bad), float(sq)


_NO_BACK = np.zeros(0, np.uint16)
_NO_OUT = np.zeros(0, np.float32)


def _parallel(n: int) -> bool:
    """Whether n elements are worth a parallel launch; never in a forked child (:mod:`cgdp.engine.core.fork`)."""
    if n < SERIAL_BELOW or fork.forked_child or numba.get_num_threads() <= 1:
        return False
    fork.engine_started()
    return True


def round_into(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[:] = src`` rounded to ``dst``'s 16-bit dtype (a chunk summed across ranks, after its allreduce)."""
    ROUND[_parallel(src.shape[0])](src, dst.view(np.uint16), dst.dtype == np.float16)


def sum_of_squares(x: np.ndarray) -> float:
    """Sum of squares with the kernels' blocks and order (a chunk summed across ranks)."""
    return float(SUMSQ[_parallel(x.shape[0])](x))


def warm_up(dtype: np.dtype = np.float32, nparts: int = 2) -> None:
    """Compile or load the kernels for ``nparts`` parts of ``dtype``, so the first step is not slow."""
    dtype = np.dtype(dtype)
    out_dtype = np.float32 if dtype in _WIDEN else dtype
    for n in (16, SERIAL_BELOW):
        out = np.zeros(n, out_dtype)
        parts = tuple(np.zeros(n, dtype) for _ in range(nparts))
        for sumsq in (False, True):
            accumulate_unchecked(out, parts, 1.0, sumsq)
            if dtype in _WIDEN:
                accumulate_unchecked(out, parts, 1.0, sumsq, np.zeros(n, dtype))
                accumulate_unchecked(None, parts, 1.0, sumsq, np.zeros(n, dtype))
        if dtype in _WIDEN:
            round_into(out, np.zeros(n, dtype))
        sum_of_squares(out)


def set_threads(n: int) -> None:
    """Threads of the parallel kernel on the calling thread (Numba's setting is per thread)."""
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
