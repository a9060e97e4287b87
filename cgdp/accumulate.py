"""The host kernel: ``out[:] = scale * (parts[0] + parts[1] + ...)``, at memory bandwidth.

This is step 4 of the data path. Invariants:

* Parts are summed in the order given (device order in the engine), element by element in the
  parts' dtype, then scaled once: the result does not depend on how many threads run it or on
  arrival order, so it is bitwise reproducible and equals NumPy's ``scale * sum(parts)``.
* The work is cut into cache-sized blocks; each block is summed in L1/L2 while the parts stream
  through once, so the bytes moved are (len(parts) reads + 1 write) of the output size, no more.
* Non-finite results are counted in the same pass (no extra read of the data): the return value
  is the number of NaN/Inf elements written.
* Numba kernels are ``nogil``: the engine's accumulator thread runs them while the device threads
  keep executing Python.
* bf16 parts (``uint16`` arrays holding bfloat16 bits, e.g. ``torch_bf16.view(torch.int16)``)
  are widened to float32 on the fly.
"""
from __future__ import annotations

from typing import Sequence

import numba
import numpy as np
from numba import njit, prange

BLOCK = 8192
"""Elements per block: 32 KiB of float32, so a block of out plus one part fits in L1/L2."""
SERIAL_BELOW = 1 << 16
"""Below this many elements a parallel launch costs more than it saves."""


def _body(out, parts, scale):
    n = out.shape[0]
    nparts = len(parts)
    nblocks = (n + BLOCK - 1) // BLOCK
    bad = 0
    for b in prange(nblocks):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        p0 = parts[0]
        for i in range(lo, hi):
            out[i] = p0[i]
        for j in range(1, nparts):
            pj = parts[j]
            for i in range(lo, hi):
                out[i] += pj[i]
        nb = 0
        for i in range(lo, hi):
            v = out[i] * scale
            out[i] = v
            # v - v is 0 for finite v and NaN for NaN/Inf; counted in the same pass.
            if v - v != 0:
                nb += 1
        bad += nb
    return bad


def _body_bf16(out, parts, scale):
    n = out.shape[0]
    nparts = len(parts)
    nblocks = (n + BLOCK - 1) // BLOCK
    bad = 0
    for b in prange(nblocks):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        ob = out[lo:hi].view(np.uint32)
        p0 = parts[0]
        for i in range(lo, hi):
            ob[i - lo] = np.uint32(p0[i]) << np.uint32(16)
        for j in range(1, nparts):
            pj = parts[j]
            tmp = np.empty(1, np.uint32)
            tf = tmp.view(np.float32)
            for i in range(lo, hi):
                tmp[0] = np.uint32(pj[i]) << np.uint32(16)
                out[i] += tf[0]
        nb = 0
        for i in range(lo, hi):
            v = out[i] * scale
            out[i] = v
            if v - v != 0:
                nb += 1
        bad += nb
    return bad


_par = njit(parallel=True, nogil=True, cache=True)(_body)
_ser = njit(nogil=True, cache=True)(_body)
_par_bf16 = njit(parallel=True, nogil=True, cache=True)(_body_bf16)
_ser_bf16 = njit(nogil=True, cache=True)(_body_bf16)


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
    if dt == np.uint16:
        if out.dtype != np.float32:
            raise TypeError("bf16 parts (uint16 bits) accumulate into a float32 out")
    elif dt != out.dtype:
        raise TypeError(f"parts are {dt} but out is {out.dtype}; they must match "
                        f"(or pass bf16 bits as uint16 with a float32 out)")
    return parts


def accumulate(out: np.ndarray, parts: Sequence[np.ndarray], scale: float = 1.0) -> int:
    """``out[:] = scale * sum(parts)``, parts summed in the order given; returns the number of
    non-finite elements written (0 when all is well). ``out`` may alias ``parts[0]``."""
    parts = _check(out, parts)
    return accumulate_unchecked(out, parts, scale)


def accumulate_unchecked(out: np.ndarray, parts: tuple[np.ndarray, ...], scale: float = 1.0) -> int:
    """The engine's entry: no argument checks (the engine's buffers are right by construction)."""
    s = out.dtype.type(scale)
    if parts[0].dtype == np.uint16:
        kern = _par_bf16 if out.shape[0] >= SERIAL_BELOW else _ser_bf16
    else:
        kern = _par if out.shape[0] >= SERIAL_BELOW else _ser
    return int(kern(out, parts, s))


def warm_up(dtype: np.dtype = np.float32, nparts: int = 2) -> None:
    """Compile (or load from cache) the kernels for ``nparts`` parts, so the first step is not slow."""
    for n in (16, SERIAL_BELOW):
        out = np.zeros(n, dtype)
        accumulate_unchecked(out, tuple(np.zeros(n, dtype) for _ in range(nparts)))


def set_threads(n: int) -> None:
    """Threads the parallel kernel uses from the calling thread (thread-local in Numba)."""
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
