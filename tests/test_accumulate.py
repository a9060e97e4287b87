import numpy as np
import pytest
import torch

import cgdp
from cgdp.engine.core.accumulate import SERIAL_BELOW
from cgdp.engine.core.kernels import BLOCK


@pytest.mark.parametrize("nparts", [1, 2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize("n", [1, 7, BLOCK + 3, SERIAL_BELOW + 17, 3 * SERIAL_BELOW])
def test_matches_numpy_bitwise(nparts, n):
    rng = np.random.default_rng(n + nparts)
    parts = [rng.standard_normal(n).astype(np.float32) for _ in range(nparts)]
    out = np.empty(n, np.float32)
    assert cgdp.accumulate(out, parts, scale=0.3) == 0
    ref = 0.3 * sum(parts)
    assert ref.dtype == np.float32
    np.testing.assert_array_equal(out, ref)


def test_order_is_the_order_given():
    # values chosen so that float32 addition is not associative
    a = np.full(4, 1e8, np.float32)
    b = np.full(4, -1e8, np.float32)
    c = np.full(4, 1.0, np.float32)
    out = np.empty(4, np.float32)
    cgdp.accumulate(out, [a, b, c])
    assert (out == 1.0).all()
    cgdp.accumulate(out, [a, c, b])
    assert (out == 0.0).all()


def test_out_may_alias_first_part_and_float64():
    x = np.arange(100, dtype=np.float64)
    y = np.ones(100)
    cgdp.accumulate(x, [x, y], scale=2.0)
    np.testing.assert_array_equal(x, 2 * (np.arange(100) + 1.0))


def test_counts_non_finite_in_the_same_pass():
    n = SERIAL_BELOW + 5
    parts = [np.zeros(n, np.float32) for _ in range(3)]
    parts[1][3] = np.inf
    parts[2][n - 1] = np.nan
    parts[0][10] = np.float32(3e38)
    parts[2][10] = np.float32(3e38)  # overflows to inf in the sum
    out = np.empty(n, np.float32)
    assert cgdp.accumulate(out, parts) == 3


@pytest.mark.parametrize("nparts", [1, 2, 3, 5])
def test_bf16_parts_accumulate_in_float32(nparts):
    n = SERIAL_BELOW + 3
    ts = [torch.randn(n).bfloat16() for _ in range(nparts)]
    parts = [t.view(torch.int16).numpy().view(np.uint16) for t in ts]
    out = np.empty(n, np.float32)
    cgdp.accumulate(out, parts, scale=0.5)
    ref = ts[0].float()
    for t in ts[1:]:
        ref = ref + t.float()
    np.testing.assert_array_equal(out, (0.5 * ref).numpy())


@pytest.mark.parametrize("bad, match", [
    (lambda o, p: (o.reshape(2, -1), p), "1-D"),
    (lambda o, p: (o, []), "at least one"),
    (lambda o, p: (o, [p[0][:-1], p[1]]), "elements"),
    (lambda o, p: (o, [p[0], p[1].astype(np.float64)]), "one dtype"),
    (lambda o, p: (o.astype(np.int32), p), "float32"),
    (lambda o, p: (o, [p[0][::2], p[1][::2]]), "elements|contiguous"),
])
def test_bad_arguments_are_rejected(bad, match):
    out = np.zeros(10, np.float32)
    parts = [np.ones(10, np.float32), np.ones(10, np.float32)]
    o, p = bad(out, parts)
    with pytest.raises((TypeError, ValueError), match=match):
        cgdp.accumulate(o, p)


@pytest.mark.parametrize("nparts", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_sum_of_squares_in_the_same_pass_is_exact_and_thread_independent(nparts, dtype):
    from cgdp.engine.core.accumulate import set_threads
    n = 3 * SERIAL_BELOW + 5
    g = torch.Generator().manual_seed(nparts)
    ts = [torch.randn(n, generator=g) for _ in range(nparts)]
    if dtype == "bf16":
        parts = [t.bfloat16().view(torch.int16).numpy().view(np.uint16) for t in ts]
        wide = [t.bfloat16().float().numpy() for t in ts]
    elif dtype == "f16":
        parts = [t.half().numpy() for t in ts]
        wide = [p.astype(np.float32) for p in parts]
    else:
        parts = wide = [t.numpy() for t in ts]
    ref = np.float32(0.5) * sum(wide[1:], wide[0].copy())  # float32, in part order
    results = []
    for threads in (1, 2):
        set_threads(threads)
        out = np.empty(n, np.float32)
        bad, sq = cgdp.accumulate(out, parts, scale=0.5, sumsq=True)
        np.testing.assert_array_equal(out, ref)
        assert bad == 0
        results.append(sq)
    set_threads(2)
    assert results[0] == results[1]  # bitwise, whatever the thread count
    assert results[0] == pytest.approx(float(np.sum(ref.astype(np.float64) ** 2)), rel=1e-12)
    assert cgdp.accumulate(np.empty(n, np.float32), parts) == 0  # without sumsq: the count only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_to_16_bits_matches_torch(dtype):
    """The host's float32 → bf16/fp16 rounding (in the summing pass, and after an allreduce) is
    torch's: ties to even, subnormals, overflow to inf."""
    from cgdp.engine.core.accumulate import accumulate_unchecked, round_into
    from cgdp.engine.core.precision import host_array
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SERIAL_BELOW + 999, generator=g) * torch.logspace(-30, 30, SERIAL_BELOW + 999)
    x[:8] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                          70000.0, -1e-7, 3e38, 0.0])  # ties both ways (bf16, fp16), overflow, tiny
    expect = x.to(dtype)
    big = torch.finfo(dtype).max / 4  # finite parts and sums (inf - inf would be NaN)
    a = x.clamp(-big, big).to(dtype)
    b = (torch.randn(x.numel(), generator=g) * a.float() * 0.3).to(dtype)  # sums between 16-bit values
    out = np.empty(x.numel(), np.float32)
    back = torch.empty_like(a)
    accumulate_unchecked(out, (host_array(a), host_array(b)), 1.0, False, host_array(back))
    assert torch.equal(back, (a.float() + b.float()).to(dtype))
    exact = torch.empty_like(a)
    round_into(x.numpy(), host_array(exact))
    assert torch.equal(exact.view(torch.int16), expect.view(torch.int16))


def test_parallel_and_serial_kernels_are_cached_apart():
    """Numba's cache keys a function by its qualified name, code and signature, not by ``parallel=``: a serial build
    cached first was loaded for the parallel one (sums on one thread). Each pair compiles two functions named apart."""
    from cgdp.engine.core import kernels
    for pair in (kernels.SUM, kernels.SUM_WIDE, kernels.ROUND, kernels.SUMSQ):
        assert pair[True].targetoptions.get("parallel") and not pair[False].targetoptions.get("parallel")
        assert pair[True].py_func.__qualname__ != pair[False].py_func.__qualname__
