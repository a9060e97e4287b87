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
* 16-bit parts are widened to float32 on the fly and summed in float32: bf16 as ``uint16``
  arrays holding its bits (e.g. ``torch_bf16.view(torch.int16)``), fp16 as ``float16`` arrays.
* Optionally (``sumsq``), the same call returns the sum of squares of what it wrote, for the
  gradient norm: each block is squared and summed in float64 right after it is written, while
  it is in L1 (no second pass over memory), and the blocks' sums are added in block order, so
  the result is bitwise the same for any thread count.
* Optionally (``rounded``, 16-bit parts only), the same pass also rounds each block's float32
  result to the parts' dtype (to nearest even, as torch), for the copy back of 16-bit parameters.
"""
from __future__ import annotations

from typing import Sequence

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from cgdp.engine.core import fork

BLOCK = 4096
"""Elements per block: 16 KiB of float32 output stays in L1 while up to four parts stream through."""
SERIAL_BELOW = 1 << 16
"""Below this many elements a parallel launch costs more than it saves."""

# Each inner loop is its own small function over block slices: indexing a slice from 0 lets LLVM
# drop Numba's negative-index check and vectorise the loop (indexing the whole array over
# range(lo, hi) does not vectorise). Up to four parts are added per pass over a block, always
# left to right, so the sum is the same as adding the parts one after another.
_loop = njit(nogil=True, inline="never", cache=True)


@intrinsic
def _bits_to_f32(typingctx, u):
    """Reinterpret a uint32 as float32 (a register bit cast; vectorises, unlike an array view)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


@_loop
def _set1s(o, a, s):
    nb = 0
    for i in range(o.shape[0]):
        v = a[i] * s
        o[i] = v
        nb += (v - v) != 0  # v - v is 0 for finite v, NaN for NaN/Inf: counted in the same pass
    return nb


@_loop
def _set2s(o, a, b, s):
    nb = 0
    for i in range(o.shape[0]):
        v = (a[i] + b[i]) * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@_loop
def _set3s(o, a, b, c, s):
    nb = 0
    for i in range(o.shape[0]):
        v = ((a[i] + b[i]) + c[i]) * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@_loop
def _set4s(o, a, b, c, d, s):
    nb = 0
    for i in range(o.shape[0]):
        v = (((a[i] + b[i]) + c[i]) + d[i]) * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@_loop
def _set4(o, a, b, c, d):
    for i in range(o.shape[0]):
        o[i] = ((a[i] + b[i]) + c[i]) + d[i]


@_loop
def _add4(o, a, b, c, d):
    for i in range(o.shape[0]):
        o[i] = (((o[i] + a[i]) + b[i]) + c[i]) + d[i]


@_loop
def _add1s(o, a, s):
    nb = 0
    for i in range(o.shape[0]):
        v = (o[i] + a[i]) * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@_loop
def _add2s(o, a, b, s):
    nb = 0
    for i in range(o.shape[0]):
        v = ((o[i] + a[i]) + b[i]) * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@_loop
def _add3s(o, a, b, c, s):
    nb = 0
    for i in range(o.shape[0]):
        v = (((o[i] + a[i]) + b[i]) + c[i]) * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@_loop
def _add4s(o, a, b, c, d, s):
    nb = 0
    for i in range(o.shape[0]):
        v = ((((o[i] + a[i]) + b[i]) + c[i]) + d[i]) * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@intrinsic
def _half_to_f32(typingctx, u):
    """Widen fp16 bits (uint16) to float32 (``fpext half``: one instruction with F16C)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


@njit(nogil=True, inline="always", cache=True)
def widen(u, half):
    """16-bit bits to float32: IEEE half if ``half``, else bfloat16. ``half`` is the same for a
    whole loop: LLVM unswitches the loop on it and vectorises each version."""
    if half:
        return _half_to_f32(u)
    return _bits_to_f32(np.uint32(u) << np.uint32(16))


@intrinsic
def _f32_bits(typingctx, x):
    """Reinterpret a float32 as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return sig, codegen


@intrinsic
def _f32_to_half_bits(typingctx, x):
    """Round a float32 to IEEE half (``fptrunc``: to nearest even, as torch) and return its bits."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return sig, codegen


@njit(nogil=True, inline="always", cache=True)
def narrow(x, half):
    """float32 to 16-bit bits, rounded to nearest even exactly as ``tensor.to(torch.bfloat16 or
    torch.float16)`` rounds finite values (NaN becomes a quiet NaN)."""
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
def _wset2s(o, a, b, s, half):
    nb = 0
    for i in range(o.shape[0]):
        v = (widen(a[i], half) + widen(b[i], half)) * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@_loop
def _scale_count(o, s):
    nb = 0
    for i in range(o.shape[0]):
        v = o[i] * s
        o[i] = v
        nb += (v - v) != 0
    return nb


@_loop
def _wset1(o, a, half):
    for i in range(o.shape[0]):
        o[i] = widen(a[i], half)


@_loop
def _wset2(o, a, b, half):
    for i in range(o.shape[0]):
        o[i] = widen(a[i], half) + widen(b[i], half)


@_loop
def _wadd1(o, a, half):
    for i in range(o.shape[0]):
        o[i] = o[i] + widen(a[i], half)


@_loop
def _wadd2(o, a, b, half):
    for i in range(o.shape[0]):
        o[i] = (o[i] + widen(a[i], half)) + widen(b[i], half)


@njit(nogil=True, inline="never", cache=True, fastmath={"reassoc", "nsz"})
def _sumsq(o):
    """Sum of squares of one block in float64. ``reassoc`` lets LLVM vectorise the sum (4x faster
    than eight scalar lanes, which LLVM leaves unvectorised): the order within a block is then
    the compiled code's vector order, fixed for a build and CPU (the same bits on every run and
    any thread count, but CPUs with other vector widths may differ in the last bits: the trainer
    makes MPI ranks agree by using rank 0's value)."""
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


# One kernel per part count up to four, each calling its fused loop with the parts as plain
# arguments: indexing the tuple of parts with a run-time index costs half the bandwidth.
# With ``want_sq``, each block's sum of squares is taken right after the block is written, while
# it is still in L1 (no second pass over memory), into its own slot of ``sq``; the slots are then
# added in block order, so the total is the same whatever the thread count.
def _k1(out, a, s, want_sq):
    n = out.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks if want_sq else 0)
    bad = 0
    for blk in prange(nblocks):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        bad += _set1s(out[lo:hi], a[lo:hi], s)
        if want_sq:
            sq[blk] = _sumsq(out[lo:hi])
    return bad, _ordered_sum(sq)


def _k2(out, a, b, s, want_sq):
    n = out.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks if want_sq else 0)
    bad = 0
    for blk in prange(nblocks):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        bad += _set2s(out[lo:hi], a[lo:hi], b[lo:hi], s)
        if want_sq:
            sq[blk] = _sumsq(out[lo:hi])
    return bad, _ordered_sum(sq)


def _k3(out, a, b, c, s, want_sq):
    n = out.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks if want_sq else 0)
    bad = 0
    for blk in prange(nblocks):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        bad += _set3s(out[lo:hi], a[lo:hi], b[lo:hi], c[lo:hi], s)
        if want_sq:
            sq[blk] = _sumsq(out[lo:hi])
    return bad, _ordered_sum(sq)


def _k4(out, a, b, c, d, s, want_sq):
    n = out.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks if want_sq else 0)
    bad = 0
    for blk in prange(nblocks):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        bad += _set4s(out[lo:hi], a[lo:hi], b[lo:hi], c[lo:hi], d[lo:hi], s)
        if want_sq:
            sq[blk] = _sumsq(out[lo:hi])
    return bad, _ordered_sum(sq)


def _wk2(out, a, b, s, want_sq, half, back):
    n = a.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks if want_sq else 0)
    bad = 0
    for blk in prange(nblocks):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        # an empty out: the float32 block lives in a scratch that stays in cache (only back is written)
        o = out[lo:hi] if out.shape[0] else np.empty(hi - lo, np.float32)
        bad += _wset2s(o, a[lo:hi], b[lo:hi], s, half)
        if want_sq:
            sq[blk] = _sumsq(o)
        if back.shape[0]:
            _narrow(o, back[lo:hi], half)
    return bad, _ordered_sum(sq)


def _body(out, parts, scale, want_sq):
    """More than four parts: the first four in one pass, then up to four more per pass."""
    n = out.shape[0]
    nparts = len(parts)
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks if want_sq else 0)
    bad = 0
    for blk in prange(nblocks):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        o = out[lo:hi]
        _set4(o, parts[0][lo:hi], parts[1][lo:hi], parts[2][lo:hi], parts[3][lo:hi])
        j = 4
        while nparts - j > 4:  # middle groups of four; the last group is fused with the scale
            _add4(o, parts[j][lo:hi], parts[j + 1][lo:hi], parts[j + 2][lo:hi], parts[j + 3][lo:hi])
            j += 4
        k = nparts - j
        if k == 1:
            bad += _add1s(o, parts[j][lo:hi], scale)
        elif k == 2:
            bad += _add2s(o, parts[j][lo:hi], parts[j + 1][lo:hi], scale)
        elif k == 3:
            bad += _add3s(o, parts[j][lo:hi], parts[j + 1][lo:hi], parts[j + 2][lo:hi], scale)
        else:
            bad += _add4s(o, parts[j][lo:hi], parts[j + 1][lo:hi], parts[j + 2][lo:hi],
                          parts[j + 3][lo:hi], scale)
        if want_sq:
            sq[blk] = _sumsq(o)
    return bad, _ordered_sum(sq)


def _body_wide(out, parts, scale, want_sq, half, back):
    """16-bit parts (bf16 or fp16 bits), widened to float32 on the fly; with a non-empty ``back``,
    each block's float32 result is also rounded into it, while the block is in L1. An empty
    ``out`` keeps each float32 block in a scratch of its own: only ``back`` is written."""
    n = parts[0].shape[0]
    nparts = len(parts)
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks if want_sq else 0)
    bad = 0
    for b in prange(nblocks):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        o = out[lo:hi] if out.shape[0] else np.empty(hi - lo, np.float32)
        z = nparts - nparts
        if nparts == 1:
            _wset1(o, parts[z][lo:hi], half)
            j = 1
        else:
            _wset2(o, parts[z][lo:hi], parts[z + 1][lo:hi], half)
            j = 2
        while j < nparts:
            if nparts - j >= 2:
                _wadd2(o, parts[j][lo:hi], parts[j + 1][lo:hi], half)
                j += 2
            else:
                _wadd1(o, parts[j][lo:hi], half)
                j += 1
        bad += _scale_count(o, scale)
        if want_sq:
            sq[b] = _sumsq(o)
        if back.shape[0]:
            _narrow(o, back[lo:hi], half)
    return bad, _ordered_sum(sq)


_par = [njit(parallel=True, nogil=True, cache=True)(k) for k in (_body, _k1, _k2, _k3, _k4)]
_ser = [njit(nogil=True, cache=True)(k) for k in (_body, _k1, _k2, _k3, _k4)]
_par_wide = [njit(parallel=True, nogil=True, cache=True)(k) for k in (_body_wide, _wk2)]
_ser_wide = [njit(nogil=True, cache=True)(k) for k in (_body_wide, _wk2)]
_WIDEN = {np.dtype(np.uint16): False, np.dtype(np.float16): True}
"""16-bit parts: uint16 arrays hold bf16 bits, float16 arrays IEEE half (Numba has no float16
arithmetic on the CPU: the kernel reads their bits as uint16 and widens each value exactly)."""


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
    """``out[:] = scale * sum(parts)``, parts summed in the order given; returns the number of
    non-finite elements written (0 when all is well), and with ``sumsq=True`` also the sum of
    squares of ``out`` (float64, the same bits whatever the thread count). ``out`` may alias
    ``parts[0]``."""
    parts = _check(out, parts)
    bad, sq = accumulate_unchecked(out, parts, scale, sumsq)
    return (bad, sq) if sumsq else bad


def accumulate_unchecked(out: np.ndarray | None, parts: tuple[np.ndarray, ...], scale: float = 1.0,
                         sumsq: bool = False, rounded: np.ndarray | None = None) -> tuple[int, float]:
    """The engine's entry, without argument checks (the engine's buffers are right by
    construction): ``(non-finite count, sum of squares of out or 0.0)``. With 16-bit parts,
    ``rounded`` (an array of the parts' dtype, like ``out``) also receives ``out`` rounded to that
    dtype, in the same pass, and ``out`` may be None: the float32 sum is then never written to
    memory, only its rounding (2 bytes per element written instead of 6)."""
    s = np.float32(scale) if out is None else out.dtype.type(scale)
    parallel = _parallel(parts[0].shape[0])
    half = _WIDEN.get(parts[0].dtype)
    if half is not None:
        bits = tuple(p.view(np.uint16) for p in parts)
        back = _NO_BACK if rounded is None else rounded.view(np.uint16)
        if out is None:
            out = _NO_OUT
        kernels = _par_wide if parallel else _ser_wide
        if len(parts) == 2:
            bad, sq = kernels[1](out, *bits, s, sumsq, half, back)
        else:
            bad, sq = kernels[0](out, bits, s, sumsq, half, back)
    else:
        kernels = _par if parallel else _ser
        if len(parts) <= 4:
            bad, sq = kernels[len(parts)](out, *parts, s, sumsq)
        else:
            bad, sq = kernels[0](out, parts, s, sumsq)
    return int(bad), float(sq)


_NO_BACK = np.zeros(0, np.uint16)
_NO_OUT = np.zeros(0, np.float32)


def _parallel(n: int) -> bool:
    """Whether n elements are worth a parallel launch; never in a child forked after cgdp ran
    (:mod:`cgdp.engine.core.fork`: GNU OpenMP does not survive a fork)."""
    if n < SERIAL_BELOW or fork.forked_child or numba.get_num_threads() <= 1:
        return False
    fork.engine_started()
    return True


def round_into(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst[:] = src`` rounded from float32 to ``dst``'s 16-bit dtype (uint16 for bf16 bits, or
    float16): for a chunk summed across ranks, rounded after its allreduce."""
    kernel = _round_blocks if _parallel(src.shape[0]) else _round_blocks_serial
    kernel(src, dst.view(np.uint16), dst.dtype == np.float16)


def _round_blocks_py(src, dst, half):
    n = src.shape[0]
    for blk in prange((n + BLOCK - 1) // BLOCK):
        lo = blk * BLOCK
        hi = min(lo + BLOCK, n)
        _narrow(src[lo:hi], dst[lo:hi], half)


_round_blocks = njit(parallel=True, nogil=True, cache=True)(_round_blocks_py)
_round_blocks_serial = njit(nogil=True, cache=True)(_round_blocks_py)


def sum_of_squares(x: np.ndarray) -> float:
    """Sum of squares of a float32 (or float64) array, with the blocks and order of the kernels
    above: for a chunk summed across ranks after accumulation (one more read of it)."""
    kernel = _sumsq_blocks if _parallel(x.shape[0]) else _sumsq_blocks_serial
    return float(kernel(x))


def _sumsq_blocks_py(x):
    n = x.shape[0]
    nblocks = (n + BLOCK - 1) // BLOCK
    sq = np.zeros(nblocks)
    for blk in prange(nblocks):
        lo = blk * BLOCK
        sq[blk] = _sumsq(x[lo:min(lo + BLOCK, n)])
    return _ordered_sum(sq)


_sumsq_blocks = njit(parallel=True, nogil=True, cache=True)(_sumsq_blocks_py)
_sumsq_blocks_serial = njit(nogil=True, cache=True)(_sumsq_blocks_py)


def warm_up(dtype: np.dtype = np.float32, nparts: int = 2) -> None:
    """Compile (or load from cache) the kernels for ``nparts`` parts of ``dtype`` (float32,
    float64, uint16 for bf16 bits or float16), so the first step is not slow."""
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
    """Threads the parallel kernel uses when called from the calling thread (Numba's setting is
    per thread: call this on the thread that runs the kernel)."""
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
