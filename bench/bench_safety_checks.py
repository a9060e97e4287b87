"""What cgdp's per-step safety checks cost: the hook gates and the gradient comparison.

    python bench/bench_safety_checks.py            # bench_engine's full models, 7 interleaved rounds
    python bench/bench_safety_checks.py --quick    # small models, 3 rounds

Two checks run at every step of ``cgdp.DataParallel`` (the hook gates also in ``cgdp.Trainer``):

* **Hook gates** (:mod:`cgdp.engine.core.module_hooks`, :mod:`cgdp.engine.core.param_hooks`):
  one comparison of torch's hook-handle counter per step; the parameters' and modules' hooks are
  looked at again only when it moved. Timed alone, per step, on bench_engine's models replicated
  4 times: when nothing was registered (the usual step), and when a hook is registered at every
  step (non-reentrant ``torch.utils.checkpoint`` does that).
* **The gradient comparison** (:func:`cgdp.engine.core.dense_grads.same_bits`): before
  each ``optimizer.step()`` after a synced backward, replica 0's flat gradient buffer is compared
  bit for bit with replica 1's, to find edits through ``.data`` (one pass over two gradients).
  Timed in the user's loop on two emulated devices, with the comparison and with it replaced by
  ``True`` (the loop as it was), in interleaved rounds; the limit is one read of the two buffers
  at the host's copy bandwidth, measured here as a ``copy_`` of one buffer.

First the answer: after the timed steps, both variants' parameters must equal one device's.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import cgdp  # noqa: E402
from bench_engine import FULL, LR, QUICK, params_of, rel_err  # noqa: E402
from cgdp.engine.core.module_hooks import ModuleHooks  # noqa: E402
from cgdp.engine.core.param_hooks import ParamHooks  # noqa: E402
from cgdp.engine.core import dense_grads as dense  # noqa: E402
from common import command_line, fmt, interleaved, machine, machine_md, median, table, write_results  # noqa: E402


def gate_us(model: torch.nn.Module, replicas: int, moved: bool, n: int) -> float:
    """Microseconds per step of the two hook gates (follow, take, put back)."""
    from torch.utils.hooks import RemovableHandle
    reps = [model] + [copy.deepcopy(model) for _ in range(replicas - 1)]
    mh = ModuleHooks(reps, [list(r.parameters()) for r in reps], [torch.device("cpu")] * replicas)
    ph = ParamHooks([list(r.parameters()) for r in reps])
    t0 = time.perf_counter()
    for _ in range(n):
        if moved:
            RemovableHandle.next_id += 1  # what a hook registration does
        mh.follow()
        ph.take()
        ph.put_back()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed call")
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    ap.add_argument("--md", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cases = QUICK if args.quick else FULL
    rounds = args.rounds or (3 if args.quick else 7)
    torch.set_num_threads(1)
    results = []
    for case in cases:
        net = case.build()
        x, y = case.batch(args.batch)
        loss_fn = case.loss()
        models = {}
        for name in ("compared", "not compared"):
            m = cgdp.DataParallel(copy.deepcopy(net), ["cpu:0", "cpu:1"], chunks=1)
            models[name] = (m, m.bind(torch.optim.SGD(m.parameters(), lr=LR)))
        ref = copy.deepcopy(net)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        real = dense.same_bits

        def loop(name: str) -> None:
            m, opt = models[name]
            dense.same_bits = real if name == "compared" else (lambda a, b: True)
            try:
                for _ in range(args.steps):
                    opt.zero_grad()
                    loss_fn(m(x), y).backward()
                    opt.step()
            finally:
                dense.same_bits = real

        times = interleaved({k: (lambda k=k: loop(k)) for k in models}, rounds, warmup=1)
        calls = 1 + len(times["compared"])  # warm-up included: the reference steps as often
        for _ in range(calls * args.steps):
            ref_opt.zero_grad()
            loss_fn(ref(x), y).backward()
            ref_opt.step()
        errs = {k: rel_err(params_of(m.module), params_of(ref)) for k, (m, _) in models.items()}
        assert all(e < 1e-5 for e in errs.values()), errs
        flats = models["compared"][0]._stream.flats
        t_cmp = min(timeit_ms(lambda: real(flats[0], flats[1])) for _ in range(5))
        buf = flats[0].clone()
        t_copy = min(timeit_ms(lambda: buf.copy_(flats[0])) for _ in range(5))
        step = {k: median(v) / args.steps * 1e3 for k, v in times.items()}
        results.append({
            "case": case.name, "grad_mib": flats[0].numel() * 4 / 2**20,
            "step_ms": step, "added_ms": step["compared"] - step["not compared"],
            "compare_ms": t_cmp, "copy_ms": t_copy, "rel_err": errs,
            "gate_us_idle": gate_us(copy.deepcopy(net), 4, False, 20000),
            "gate_us_moved": gate_us(copy.deepcopy(net), 4, True, 500),
            "parameters": len(list(net.parameters())), "modules": len(list(net.modules())),
        })
        for m, _ in models.values():
            m.close()
    info = machine()
    cmd = command_line()
    rows = [[r["case"], fmt(r["grad_mib"]), fmt(r["step_ms"]["not compared"]), fmt(r["step_ms"]["compared"]),
             fmt(r["added_ms"], 2), fmt(r["compare_ms"], 2), fmt(r["copy_ms"], 2)] for r in results]
    gates = [[r["case"], r["parameters"], r["modules"], fmt(r["gate_us_idle"], 2), fmt(r["gate_us_moved"])]
             for r in results]
    md = "\n\n".join([
        "# Safety checks per step", f"`{cmd}`", machine_md(info),
        "## The gradient comparison (cgdp.DataParallel, 2 emulated devices, SGD)",
        "Step times are medians of interleaved rounds; the comparison alone and a `copy_` of one "
        "buffer (the limit: the comparison reads two) are the best of 5 after the run. Both "
        "variants' parameters equal one device's (relative error < 1e-5).",
        table(["model", "gradient MiB", "step ms, not compared", "step ms, compared", "added ms",
               "comparison ms", "copy of one buffer ms"], rows),
        "## The hook gates (per step, 4 replicas)",
        table(["model", "parameters", "modules", "µs, nothing registered", "µs, a hook registered every step"],
              gates)]) + "\n"
    write_results(md, results, info, cmd, args.md, args.json)
    return 0


def timeit_ms(fn, n: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


if __name__ == "__main__":
    sys.exit(main())
