"""The host sum's Numba kernels: every compiled loop behind :mod:`cgdp.engine.core.accumulate`.

* Work is cut into cache-sized blocks (``BLOCK``), summed in L1/L2 while the parts stream through once; within a block
  parts are added left to right.
* The non-finite count, the sum of squares (``want_sq``, blocks' sums added in block order) and the rounding to 16 bits
  (``back``) are taken in that pass: the same bits for any thread count.
* Every kernel is ``nogil`` and compiled twice, parallel (``prange`` over blocks) and serial.
* Every compiled function and its callees live in this file: Numba's cache sees changes to a kernel's own file only.
"""
from __future__ import annotations

from types import FunctionType

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

BLOCK = 4096
"""Elements per block: 16 KiB of float32 output stays in L1 while up to four parts stream through."""

# Each inner loop is its own small function over block slices: indexing a slice from 0 lets LLVM drop Numba's
# negative-index check and vectorise the loop (indexing the whole array over range(lo, hi) does not vectorise). Up to
# four parts are added per pass over a block, always left to right, so the sum is the same as adding the parts one after
# another.
_loop = njit(nogil=True, inline="never", cache=True)


def _cast(result, arg, convert):
    """An intrinsic from ``arg`` to ``result``: ``convert(builder, value)``, register casts that vectorise (unlike an
    array view)."""
    def cast(typingctx, x):
        def codegen(context, builder, signature, args):
            return convert(builder, args[0])
        return result(arg), codegen
    return intrinsic(cast)


_bits_to_f32 = _cast(types.float32, types.uint32, lambda b, u: b.bitcast(u, ir.FloatType()))
_f32_bits = _cast(types.uint32, types.float32, lambda b, x: b.bitcast(x, ir.IntType(32)))
# IEEE half: ``fpext`` widens (one instruction with F16C), ``fptrunc`` rounds to nearest even, as torch
_half_to_f32 = _cast(types.float32, types.uint16, lambda b, u: b.fpext(b.bitcast(u, ir.HalfType()), ir.FloatType()))
_f32_to_half_bits = _cast(types.uint16, types.float32,
                          lambda b, x: b.bitcast(b.fptrunc(x, ir.HalfType()), ir.IntType(16)))


@njit(nogil=True, cache=True)
def _rest(v, parts, i):
    """``v`` plus element ``i`` of ``parts[1:]`` (up to three), left to right; ``len(parts)`` is a compile-time
    constant, so only its additions are compiled."""
    n = len(parts)
    if n > 1:
        v = v + parts[1][i]
    if n > 2:
        v = v + parts[2][i]
    if n > 3:
        v = v + parts[3][i]
    return v


@_loop
def _set(o, s, *parts):
    """``o = (parts[0] + parts[1] + ...) * s`` for one to four parts; the non-finite count (``s`` None: unscaled, 0)."""
    nb = 0
    for i in range(o.shape[0]):
        v = _rest(parts[0][i], parts, i)
        if s is not None:
            v = v * s
            nb += (v - v) != 0  # v - v is 0 for finite v, NaN for NaN/Inf: counted in the same pass
        o[i] = v
    return nb


@_loop
def _add(o, s, *parts):
    """:func:`_set` onto ``o``: ``o = (o + parts[0] + ...) * s``."""
    nb = 0
    for i in range(o.shape[0]):
        v = _rest(o[i] + parts[0][i], parts, i)
        if s is not None:
            v = v * s
            nb += (v - v) != 0
        o[i] = v
    return nb


@njit(nogil=True, inline="always", cache=True)
def widen(u, half):
    """16-bit bits to float32: IEEE half if ``half``, else bfloat16. ``half`` is the same for a whole loop: LLVM
    unswitches the loop on it and vectorises each version."""
    if half:
        return _half_to_f32(u)
    return _bits_to_f32(np.uint32(u) << np.uint32(16))


@njit(nogil=True, inline="always", cache=True)
def narrow(x, half):
    """float32 to 16-bit bits, rounded to nearest even exactly as ``tensor.to(torch.bfloat16 or torch.float16)`` rounds
    finite values (NaN becomes a quiet NaN)."""
    if half:
        return _f32_to_half_bits(x)
    u = _f32_bits(x)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@_loop
def _narrow(o, d, half):
    for i in range(o.shape[0]):
        d[i] = narrow(o[i], half)


@_loop
def _wset(o, s, half, *parts):
    """``o = (parts[0] + parts[1]) * s`` for one or two 16-bit parts widened; the non-finite count (``s`` None:
    unscaled, 0)."""
    nb = 0
    for i in range(o.shape[0]):
        v = widen(parts[0][i], half)
        if len(parts) > 1:
            v = v + widen(parts[1][i], half)
        if s is not None:
            v = v * s
            nb += (v - v) != 0
        o[i] = v
    return nb


@_loop
def _wadd(o, half, *parts):
    """``o += parts[0] (+ parts[1])``, one or two 16-bit parts widened, left to right."""
    for i in range(o.shape[0]):
        v = o[i] + widen(parts[0][i], half)
        if len(parts) > 1:
            v = v + widen(parts[1][i], half)
        o[i] = v


@_loop
def _scale_count(o, s):
    nb = 0
    for i in range(o.shape[0]):
        v = o[i] * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@njit(nogil=True, inline="never", cache=True, fastmath={"reassoc", "nsz"})
def _sumsq(o):
    """Sum of squares of one block in float64. ``reassoc`` lets LLVM vectorise it (4x): the order is then fixed for a
    build and CPU, but other vector widths may differ in the last bits (the trainer uses rank 0's value)."""
    a = 0.0
    for i in range(o.shape[0]):
        x = np.float64(o[i])
        a += x * x
    return a


@_loop
def _ordered_sum(sq):
    t = 0.0
    for i in range(sq.shape[0]):
        t += sq[i]
    return t


# The drivers take the parts as ``*parts``: their count is a compile-time constant, so only its branch is compiled, and
# up to four parts reach their fused loop as plain arguments (static indices: indexing the tuple of parts with a
# run-time index costs half the bandwidth). With ``want_sq``, each block's sum of squares is taken right after the block
# is written, while it is still in L1 (no second pass over memory), into its own slot of ``sq``; the slots are then
# added in block order, so the total is the same whatever the thread count.
def _sum(out, scale, want_sq, *parts):
    """Up to four parts in one fused pass; more: the first four in one pass, then up to four more per pass."""
    n = out.shape[0]
    nparts = len(parts)
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks if want_sq else 0)
    bad = 0
    for blk in prange(nblocks):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        o = out[lo:hi]
        if nparts == 1:
            bad += _set(o, scale, parts[0][lo:hi])
        elif nparts == 2:
            bad += _set(o, scale, parts[0][lo:hi], parts[1][lo:hi])
        elif nparts == 3:
            bad += _set(o, scale, parts[0][lo:hi], parts[1][lo:hi], parts[2][lo:hi])
        elif nparts == 4:
            bad += _set(o, scale, parts[0][lo:hi], parts[1][lo:hi], parts[2][lo:hi], parts[3][lo:hi])
        else:
            _set(o, None, parts[0][lo:hi], parts[1][lo:hi], parts[2][lo:hi], parts[3][lo:hi])
            j = 4
            while nparts - j > 4:  # middle groups of four; the last group is fused with the scale
                _add(o, None, parts[j][lo:hi], parts[j + 1][lo:hi], parts[j + 2][lo:hi], parts[j + 3][lo:hi])
                j += 4
            k = nparts - j
            if k == 1:
                bad += _add(o, scale, parts[j][lo:hi])
            elif k == 2:
                bad += _add(o, scale, parts[j][lo:hi], parts[j + 1][lo:hi])
            elif k == 3:
                bad += _add(o, scale, parts[j][lo:hi], parts[j + 1][lo:hi], parts[j + 2][lo:hi])
            else:
                bad += _add(o, scale, parts[j][lo:hi], parts[j + 1][lo:hi], parts[j + 2][lo:hi], parts[j + 3][lo:hi])
        if want_sq:
            sq[blk] = _sumsq(o)
    return bad, _ordered_sum(sq)


def _sum_wide(out, scale, want_sq, half, back, *parts):
    """16-bit parts widened to float32 on the fly (two: in the summing pass); a non-empty ``back`` also gets each block
    rounded; an empty ``out`` keeps each block in a scratch that stays in cache (only ``back`` is written)."""
    n = parts[0].shape[0]
    nparts = len(parts)
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks if want_sq else 0)
    bad = 0
    for blk in prange(nblocks):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        o = out[lo:hi] if out.shape[0] else np.empty(hi - lo, np.float32)
        if nparts == 2:
            bad += _wset(o, scale, half, parts[0][lo:hi], parts[1][lo:hi])
        else:
            if nparts == 1:
                _wset(o, None, half, parts[0][lo:hi])
                j = 1
            else:
                _wset(o, None, half, parts[0][lo:hi], parts[1][lo:hi])
                j = 2
            while j < nparts:
                if nparts - j >= 2:
                    _wadd(o, half, parts[j][lo:hi], parts[j + 1][lo:hi])
                    j += 2
                else:
                    _wadd(o, half, parts[j][lo:hi])
                    j += 1
            bad += _scale_count(o, scale)
        if want_sq:
            sq[blk] = _sumsq(o)
        if back.shape[0]:
            _narrow(o, back[lo:hi], half)
    return bad, _ordered_sum(sq)


def _round_blocks(src, dst, half):
    n = src.shape[0]
    for blk in prange((n + BLOCK - 1) // BLOCK):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        _narrow(src[lo:hi], dst[lo:hi], half)


def _sumsq_blocks(x):
    n = x.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks)
    for blk in prange(nblocks):
        lo = blk * BLOCK
        sq[blk] = _sumsq(x[lo:min(lo + BLOCK, n)])
    return _ordered_sum(sq)


def _compiled(kernel):
    """``{parallel: compiled}``: ``prange`` over blocks, or serial (below accumulate.SERIAL_BELOW elements, or in a
    forked child). The serial one compiles a copy named apart: Numba's cache keys a function by its name, code and
    signature, not by ``parallel``, so one would load the other's machine code."""
    serial = FunctionType(kernel.__code__, kernel.__globals__, kernel.__name__ + "_serial")
    serial.__qualname__ = kernel.__qualname__ + "_serial"
    return {True: njit(parallel=True, nogil=True, cache=True)(kernel), False: njit(nogil=True, cache=True)(serial)}


SUM = _compiled(_sum)
SUM_WIDE = _compiled(_sum_wide)
ROUND = _compiled(_round_blocks)
SUMSQ = _compiled(_sumsq_blocks)
