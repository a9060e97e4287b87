"""How far ``update="host"``'s AdamW can go on this machine: what holds it behind DeepSpeed's CPU Adam, and the
least ``update="host"`` ÷ ``update="devices"`` the cores allow.

    python bench/bench_update_bounds.py                 # ~20 s on 2 cores
    python bench/bench_update_bounds.py --quick         # fewer rounds, smaller tensor

1. **One AdamW step, one thread, one float32 tensor** of ``--elements`` (default 37.7 M), at a step count where
   the bias corrections round to 1 in float32 (step 20,000, betas (0.9, 0.999)), so that every variant below is
   bitwise torch's fused kernel and the check compares them all with torch before timing:

   - cgdp's step as ``update="host"`` runs it (:func:`cgdp.engine.core.host_adam._span`): moments read from one
     side and written to the other (six streams: p, g, m, v read; p, m', v' written), so that a failed step is
     undone by forgetting the written side;
   - the same arithmetic in place (four streams, as DeepSpeed's): what the undo-by-sides layout costs;
   - the same in place without the division by the square root of bias correction 2 (exact here only because
     it is 1): what torch's second division costs;
   - torch's fused AdamW, and DeepSpeed's ``DeepSpeedCPUAdam`` (AdamW mode, one OpenMP thread) where installed
     (checked close to torch: its arithmetic differs).

2. **Trainer, G = 2 emulated devices, the 4x2048 MLP, fused AdamW**: wall time and the process's CPU time per
   step for ``update="host"`` and ``update="devices"``, interleaved. While the cores are busy, a step cannot take
   less wall time than its CPU time over the cores, so ``CPU(host) / cores / wall(devices)`` is the least
   ratio this machine allows for this model, whatever the host optimizer does. Checked first: after two steps
   both hold bitwise the same parameters.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_host_update import OPTS, mlp4x2048, mlp_batch  # noqa: E402
from bench.common import command_line, fmt, interleaved, machine, machine_md, median, table, write_results  # noqa: E402

import cgdp  # noqa: E402
from cgdp.engine.core import host_adam  # noqa: E402
from cgdp.engine.core.host_adam import FlatAdam, _adam, _sqrt  # noqa: E402
from cgdp.engine.core.host_flat import WIDTHS  # noqa: E402

STEP = 20000


@njit(nogil=True, error_model="numpy")
def _in_place(p, g, m, v, k, flags, divide):
    """:func:`host_adam._span`'s arithmetic (torch's vector loop), the moments read and written in place;
    ``divide=False`` drops the division by ``k[1]`` (exact only when it is 1)."""
    one = np.float32(1.0)
    sign = -one if flags[0] else one
    decay = k[2] if flags[1] and flags[2] else one
    small = abs(k[4]) < np.float32(0.5)
    coeff = k[4] if small else k[4] - one
    c = (sign, k[3], flags[2] and not flags[1], coeff, small, k[6], k[5], decay, k[0], k[1], k[7], 0)
    if divide:
        for i in range(p.shape[0]):
            m[i], v[i], p[i] = _adam(p[i], g[i], m[i], v[i], c)
    else:
        for i in range(p.shape[0]):
            m[i], v[i], p[i] = _no_bc2(p[i], g[i], m[i], v[i], c)


@njit(nogil=True, inline="always")
def _no_bc2(pi, gi, m0i, v0i, c):
    sign, wd, l2, coeff, small, c2, b2, decay, ss, bc, eps, mode = c
    mi, vi, _ = _adam(pi, gi, m0i, v0i, c)
    return mi, vi, pi * decay - (ss * mi) / (_sqrt(vi) + eps)


def _aligned(src: torch.Tensor) -> torch.Tensor:
    """A 64-byte aligned copy (the non-temporal stores of the out-of-place step need it)."""
    buf = torch.empty(src.numel() + 16)
    off = (-(buf.data_ptr() // 4)) % 16
    out = buf[off:off + src.numel()]
    out.copy_(src)
    return out


def kernels(n: int, rounds: int) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        vw = WIDTHS[torch.backends.cpu.get_cpu_capability()][0]
        n -= n % 256  # torch's vector loop only: no tail on any capability
        gen = torch.Generator().manual_seed(0)
        p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m0, v0 = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
        # torch's fused AdamW, its state at STEP
        tp = torch.nn.Parameter(p0.clone())
        tp.grad = g
        opt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.01, fused=True)
        opt.state[tp] = {"step": torch.tensor(float(STEP)), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
        ks, flags = FlatAdam._constants(opt.param_groups[0], np.array([STEP + 1.0]))
        k = ks[0]
        assert k[1] == 1.0, "the bias correction does not round to 1 at this step"
        nt = n >= host_adam.NT_FROM
        side = [_aligned(t) for t in (p0, m0, v0, m0, v0)]  # p, m, v, and the side written
        inplace = [t.clone() for t in (p0, m0, v0)]
        nodiv = [t.clone() for t in (p0, m0, v0)]
        a = [t.numpy() for t in side]
        gn = g.numpy()
        fns = {
            "cgdp (update='host': out of place, two sides)":
                lambda: host_adam._span(a[0], gn, a[1], a[2], a[3], a[4], k, 0, flags, nt),
            "same arithmetic, in place":
                lambda: _in_place(inplace[0].numpy(), gn, inplace[1].numpy(), inplace[2].numpy(), k, flags, True),
            "in place, no division by bias correction 2":
                lambda: _in_place(nodiv[0].numpy(), gn, nodiv[1].numpy(), nodiv[2].numpy(), k, flags, False),
            "torch fused AdamW": opt.step}
        # check: one step of each from the same start, all bitwise torch's
        for f in fns.values():
            f()
        want = (tp.detach(), opt.state[tp]["exp_avg"], opt.state[tp]["exp_avg_sq"])
        for name, got in (("out of place", (side[0], side[3], side[4])), ("in place", inplace),
                          ("no division", nodiv)):
            assert all(torch.equal(x, y) for x, y in zip(got, want)), f"{name} differs from torch's fused AdamW"
        fns.update(_deepspeed(p0, g))
        t = {name: median(v) for name, v in interleaved(fns, rounds).items()}
        ds = t.get("DeepSpeedCPUAdam (adamw_mode, 1 thread)")
        return [{"what": name, "melem_s": n / s / 1e6, "of_deepspeed": (ds / s) if ds else float("nan"),
                 "elements": n, "vector_width": vw, "nt": nt} for name, s in t.items()]
    finally:
        torch.set_num_threads(threads)


def _deepspeed(p0: torch.Tensor, g: torch.Tensor) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"  # its own OpenMP runtime, read when its extension loads
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or its op does not build
        print(f"DeepSpeedCPUAdam skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {}
    ps = [torch.nn.Parameter(p0.clone()) for _ in range(2)]
    for q in ps:
        q.grad = g.clone()
    ds = DeepSpeedCPUAdam([ps[0]], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    ds.step()
    torch.optim.AdamW([ps[1]], lr=1e-3, weight_decay=0.01, fused=True).step()
    torch.testing.assert_close(ps[0], ps[1], rtol=1e-5, atol=1e-6)
    return {"DeepSpeedCPUAdam (adamw_mode, 1 thread)": ds.step}


def trainer(rounds: int) -> dict:
    fused = functools.partial(OPTS["adamw"], fused=True)
    x, y = mlp_batch(32)
    trs = {u: cgdp.Trainer(mlp4x2048(), fused, ["cpu:0", "cpu:1"], chunks=2, update=u) for u in ("host", "devices")}
    try:
        for _ in range(2):
            for tr in trs.values():
                tr.step(x, y, F.cross_entropy)
        a, b = (trs[u].replicas[0].state_dict() for u in ("host", "devices"))
        assert all(torch.equal(v, b[k]) for k, v in a.items()), "update='host' differs from update='devices'"
        for _ in range(2):
            for tr in trs.values():
                tr.step(x, y, F.cross_entropy)
        wall = {u: [] for u in trs}
        cpu = {u: [] for u in trs}
        for _ in range(rounds):
            for u, tr in trs.items():
                c0, t0 = time.process_time(), time.perf_counter()
                tr.step(x, y, F.cross_entropy)
                wall[u].append(time.perf_counter() - t0)
                cpu[u].append(time.process_time() - c0)
        w = {u: median(v) for u, v in wall.items()}
        c = {u: median(v) for u, v in cpu.items()}
        cores = len(os.sched_getaffinity(0))
        return {"wall": w, "cpu": c, "cores": cores, "wall_ratio": w["host"] / w["devices"],
                "cpu_ratio": c["host"] / c["devices"], "least_ratio": c["host"] / cores / w["devices"],
                "host_update_s": trs["host"].stats.get("host_update_s", float("nan"))}
    finally:
        for tr in trs.values():
            tr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--elements", type=int, default=37748736)
    ap.add_argument("--md")
    ap.add_argument("--json")
    args = ap.parse_args()
    info = machine()
    ks = kernels(args.elements if not args.quick else 1 << 22, 3 if args.quick else 9)
    tr = trainer(5 if args.quick else 21)
    md = [f"# update='host': how far AdamW on the host can go here\n\n{machine_md(info)}\n\nCommand: `{command_line()}`\n",
          f"## 1. One AdamW step, one thread, {ks[0]['elements']} float32 elements, step {STEP + 1}\n",
          table(["step", "M elem/s", "÷ DeepSpeedCPUAdam"],
                [[r["what"], fmt(r["melem_s"], 0), fmt(r["of_deepspeed"], 2)] for r in ks]),
          "\nChecked before timing: the first four bitwise torch's fused AdamW after one step from the same state; "
          "DeepSpeed's within rtol 1e-5 (its arithmetic differs: one division per element, torch's two).\n",
          "\n## 2. Trainer, G = 2 emulated devices, 4x2048 MLP, fused AdamW, per step (median)\n",
          table(["update", "wall ms", "process CPU ms"],
                [[u, fmt(tr["wall"][u] * 1e3, 1), fmt(tr["cpu"][u] * 1e3, 1)] for u in ("host", "devices")]),
          f"\nhost ÷ devices: wall {tr['wall_ratio']:.2f}, CPU {tr['cpu_ratio']:.2f}; host optimizer "
          f"{tr['host_update_s'] * 1e3:.1f} ms. The least wall ratio {tr['cores']} cores allow: CPU(host) / "
          f"{tr['cores']} / wall(devices) = **{tr['least_ratio']:.2f}**.\n"]
    write_results("\n".join(md), {"kernels": ks, "trainer": tr}, info, command_line(), args.md, args.json)


if __name__ == "__main__":
    main()
