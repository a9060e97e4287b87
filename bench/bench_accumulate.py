"""Host accumulation (step 4 of the data path): ``cgdp.accumulate`` against its limit and its peers.

    python bench/bench_accumulate.py            # 64 MiB per part, 2/4/8 parts, float32 and bf16
    python bench/bench_accumulate.py --quick    # small arrays, a few rounds (CI smoke test)

For every dtype and part count it first checks each variant's result bitwise against a float32
reference summed in part order, then times all variants in interleaved rounds and prints GB/s of
*bytes moved*:

* float32 parts: (parts + 1) x out.nbytes (every part read once, out written once);
* bf16 parts (uint16 bit patterns): parts x 2 bytes + 4 bytes per element.

The limit is a plain copy that moves the same number of bytes (read + write: a source of half
the bytes moved copied into a destination of the same size), the fastest of ``np.copyto`` (one
thread), ``torch.Tensor.copy_`` (torch's threads) and a Numba ``prange`` copy (Numba's threads).
The peers are what a user would write instead: NumPy ``np.add(..., out=)`` chains and torch
``add_`` chains (bf16: widened into a scratch buffer for NumPy, mixed-dtype ``add_`` for torch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import njit, prange  # noqa: E402

import cgdp  # noqa: E402
from common import command_line, fmt, interleaved, machine, machine_md, median, table  # noqa: E402

# ---------------------------------------------------------------------------------- the limit
@njit(parallel=True, nogil=True, cache=True)
def _numba_copy(dst, src):
    n = src.shape[0]
    nb = (n + 65535) // 65536
    for b in prange(nb):
        lo = b * 65536
        hi = min(lo + 65536, n)
        d = dst[lo:hi]
        s = src[lo:hi]
        for i in range(hi - lo):
            d[i] = s[i]


# ---------------------------------------------------------------------------------- one case
def widen(p: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) → float32, exactly."""
    return (p.astype(np.uint32) << np.uint32(16)).view(np.float32)


def reference(parts: tuple[np.ndarray, ...], scale: float) -> np.ndarray:
    """float32, summed in part order, then scaled: the function every variant must compute."""
    f = [widen(p) if p.dtype == np.uint16 else p for p in parts]
    out = f[0].copy()
    for p in f[1:]:
        out += p
    out *= np.float32(scale)
    return out


def make_parts(dtype: str, nparts: int, n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    g = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(nparts):
        t = torch.randn(n, generator=g)
        if dtype == "bf16":
            parts.append(t.bfloat16().view(torch.int16).numpy().view(np.uint16))
        else:
            parts.append(t.numpy())
    return tuple(parts)


def bytes_moved(dtype: str, nparts: int, n: int) -> int:
    return (nparts + 1) * 4 * n if dtype == "f32" else nparts * 2 * n + 4 * n


def run_case(dtype: str, nparts: int, n: int, rounds: int, scale: float = 1.0,
             budget_s: float | None = None) -> dict:
    parts = make_parts(dtype, nparts, n)
    moved = bytes_moved(dtype, nparts, n)
    ref = reference(parts, scale)
    s32 = np.float32(scale)

    outs = {k: np.empty(n, np.float32) for k in ("cgdp", "cgdp+norm", "numpy", "torch")}
    scratch = np.empty(n, np.uint32)
    tparts = [torch.from_numpy(p.view(np.int16)).view(torch.bfloat16) if dtype == "bf16"
              else torch.from_numpy(p) for p in parts]
    tout = torch.from_numpy(outs["torch"])

    def numpy_peer() -> None:
        o = outs["numpy"]
        if dtype == "bf16":
            np.copyto(o.view(np.uint32), parts[0])
            np.left_shift(o.view(np.uint32), np.uint32(16), out=o.view(np.uint32))
            for p in parts[1:]:
                np.copyto(scratch, p)
                np.left_shift(scratch, np.uint32(16), out=scratch)
                np.add(o, scratch.view(np.float32), out=o)
        else:
            np.add(parts[0], parts[1], out=o) if nparts > 1 else np.copyto(o, parts[0])
            for p in parts[2:]:
                np.add(o, p, out=o)
        if scale != 1.0:
            np.multiply(o, s32, out=o)

    def torch_peer() -> None:
        if dtype == "bf16" or nparts == 1:
            tout.copy_(tparts[0])
            rest = tparts[1:]
        else:
            torch.add(tparts[0], tparts[1], out=tout)
            rest = tparts[2:]
        for p in rest:
            tout.add_(p)
        if scale != 1.0:
            tout.mul_(scale)

    variants = {
        "cgdp": lambda: cgdp.accumulate(outs["cgdp"], parts, scale),
        # the same pass also returns the sum of squares (the gradient norm for clipping)
        "cgdp+norm": lambda: cgdp.accumulate(outs["cgdp+norm"], parts, scale, sumsq=True),
        "numpy": numpy_peer,
        "torch": torch_peer,
    }
    # 1. the answer: every variant, bitwise, against the float32 reference
    for name, fn in variants.items():
        fn()
        if not np.array_equal(outs[name], ref):
            bad = int(np.sum(outs[name] != ref))
            raise AssertionError(f"{name} ({dtype}, {nparts} parts) differs from the reference in "
                                 f"{bad} of {n} elements; not timing a wrong answer")
    _, sq = cgdp.accumulate(outs["cgdp+norm"], parts, scale, sumsq=True)
    sq_ref = float(np.sum(ref.astype(np.float64) ** 2))
    if not abs(sq - sq_ref) <= 1e-9 * sq_ref:
        raise AssertionError(f"sum of squares {sq!r} differs from the float64 reference {sq_ref!r}")
    # 2. the limit: copies of the same bytes moved
    src = np.random.default_rng(1).random(moved // 8, dtype=np.float32)
    dst = np.empty_like(src)
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    copies = {"copy np.copyto": lambda: np.copyto(dst, src),
              "copy torch": lambda: tdst.copy_(tsrc),
              "copy numba": lambda: _numba_copy(dst, src)}
    for fn in copies.values():
        fn()
    assert np.array_equal(dst, src)
    # 3. the figures, all variants interleaved round by round
    times = interleaved({**copies, **variants}, rounds=rounds, budget_s=budget_s)
    gbps = {k: moved / median(v) / 1e9 for k, v in times.items()}
    best_copy = max(copies, key=lambda k: gbps[k])
    return {"dtype": dtype, "parts": nparts, "elements": n, "bytes_moved": moved,
            "rounds": len(times["cgdp"]), "gbps": gbps, "copy": best_copy,
            "copy_gbps": gbps[best_copy]}


def report(results: list[dict], info: dict[str, str], cmd: str, threads: str) -> str:
    rows = []
    for r in results:
        g, c = r["gbps"], r["copy_gbps"]
        rows.append([
            r["dtype"], r["parts"], f"{r['bytes_moved'] / 2**20:.0f}", r["rounds"],
            f"{fmt(c)} ({r['copy'].split()[-1]})",
            fmt(g["cgdp"]), fmt(g["cgdp+norm"]), fmt(g["cgdp+norm"] / g["cgdp"], 2), fmt(g["cgdp"] / c, 2), fmt(g["cgdp"] / g["numpy"], 2),
            fmt(g["cgdp"] / g["torch"], 2),
            fmt(g["numpy"]), fmt(g["torch"]),
        ])
    head = ["dtype", "parts", "MiB moved", "rounds", "copy limit GB/s", "cgdp GB/s",
            "cgdp+norm GB/s", "+norm / cgdp", "cgdp / copy", "cgdp / NumPy", "cgdp / torch", "NumPy GB/s", "torch GB/s"]
    worst = min(r["gbps"]["cgdp"] / r["copy_gbps"] for r in results)
    ahead = min(r["gbps"]["cgdp"] / r["gbps"]["numpy"] for r in results)
    return "\n".join([
        "## Host accumulation: `cgdp.accumulate` against the copy limit, NumPy and torch", "",
        f"Command: `{cmd}`", "", "Machine:", machine_md(info), "",
        f"Threads: {threads}. GB/s are bytes moved per second (float32: (parts + 1) x 4 B per "
        f"element; bf16: parts x 2 B + 4 B per element), median over interleaved rounds. "
        f"Copy limit: the fastest plain copy moving the same bytes (read + write). Every variant's "
        f"result was checked bitwise against a float32 reference before timing.", "",
        table(head, rows), "",
        f"Target: cgdp / copy >= 0.95 and well ahead of NumPy. Worst case here: cgdp / copy = "
        f"{worst:.2f} ({'met' if worst >= 0.95 else 'NOT met'}), cgdp / NumPy >= {ahead:.2f}.", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 MiB per part, 2 parts, 3 rounds")
    ap.add_argument("--mib", type=float, default=64.0, help="MiB per float32 part (bf16: half)")
    ap.add_argument("--parts", default="2,4,8", help="part counts, comma separated")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None,
                    help="Numba threads (default: all); torch uses the same number")
    ap.add_argument("--md", help="write the markdown table here")
    ap.add_argument("--json", help="write the raw figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.parts, args.rounds = 4.0, "2", 3
    if args.threads:
        numba.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    threads = f"Numba {numba.get_num_threads()}, torch {torch.get_num_threads()}, np.copyto 1"
    n = int(args.mib * 2**20) // 4
    info, cmd = machine(), command_line()
    results = []
    for dtype in args.dtypes.split(","):
        for nparts in (int(p) for p in args.parts.split(",")):
            r = run_case(dtype, nparts, n, args.rounds)
            g = r["gbps"]
            print(f"{dtype:5s} {nparts} parts: copy {r['copy_gbps']:.1f} GB/s | cgdp {g['cgdp']:.1f} "
                  f"(+norm {g['cgdp+norm']:.1f}) ({g['cgdp'] / r['copy_gbps']:.2f}x copy, {g['cgdp'] / g['numpy']:.2f}x NumPy, "
                  f"{g['cgdp'] / g['torch']:.2f}x torch) | NumPy {g['numpy']:.1f} "
                  f"torch {g['torch']:.1f}", flush=True)
            results.append(r)
    md = report(results, info, cmd, threads)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "command": cmd, "threads": threads, "results": results}, f,
                      indent=1)
    if not args.md:
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
