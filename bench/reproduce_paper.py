"""Reproduce the paper's numbers from its own measurements, with the cost model and the simulator.

    python bench/reproduce_paper.py [--out bench/results/paper_reproduction.md] [--no-engine]

1. Table 3 / Table 4 (AlexNet, 4 GPUs): Definitions 3.3/3.4, the overheads T_O, T'_O and the §3.2
   condition, and the simulator, against the measured phase times.
2. Table 2 (AlexNet, GoogLeNet-v1, VGGNet-16 on 1, 2, 4 GPUs): simulator against measured.
3. Figure 2 (ResNet-152, minibatch 16, 4 GPUs): time of ten iterations against chunk size.
4. Figure 5 (ResNet-152, minibatch 12): Algorithm 1 for several (step, range) on the simulated
   machine, and the model-based tuner on the same machine.
5. This machine: the simulator against the engine on CPU-emulated devices (skipped with --no-engine).

Per-layer inputs the paper does not publish are derived as stated in cgdp/paper_profiles.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cgdp.planning.calibrate import synthetic_profile  # noqa: E402
from cgdp.planning.chunks import paper_plan  # noqa: E402
from cgdp.planning.costmodel import (cgdp_backward_time, cgdp_overhead, cgdp_wins, paper_win_condition,  # noqa: E402
                            typical_backward_time, typical_overhead)
from cgdp.planning.hardware import preset, stage_costs  # noqa: E402
from cgdp.planning.paper_profiles import ALEXNET_TABLE3_MS, ALEXNET_TABLE4_MS, TABLE2_MS, paper_model  # noqa: E402
from cgdp.planning.planner import best_uniform, choose_plan  # noqa: E402
from cgdp.planning.simulator import predict_step, simulate  # noqa: E402
from cgdp.planning.tuner import AutoTuner, PaperTuner  # noqa: E402

T_AS_MS = (ALEXNET_TABLE3_MS["TRL"]["backward"] - ALEXNET_TABLE3_MS["BVLC"]["backward"]) / 8


def table3(out: list[str]) -> None:
    m = paper_model("alexnet")
    bwd = [t * 1e3 for t in reversed(m.backward_s)]  # backward order: layer 8 first
    t4 = {k: list(reversed(v)) for k, v in ALEXNET_TABLE4_MS.items()}
    t_aa = [a + b for a, b in zip(t4["d2h"], t4["acc"])]  # step B-4-2: send, then accumulate
    t_bc, t_as = t4["h2d"], [T_AS_MS] * 8
    T = cgdp_backward_time(bwd, t_as, t_aa, t_bc)
    Tp = typical_backward_time(bwd, t_aa, t_bc)
    fwd, upd = 50.6, 5.1
    sim = {mode: simulate(m, stage_costs(preset("paper-p100")), paper_plan(8, 1), mode) for mode in ("cgdp", "typical")}
    out += ["## 1. Table 3 from Table 4 (AlexNet, 4 GPUs)", "",
            "Inputs: Table 4's per-layer copy and accumulation times; t_bp = Table 3's 104 ms backward split "
            "by multiply-accumulates; t_as = (111 − 104)/8 = %.3f ms per layer (Table 3: CGDP's backward is "
            "7 ms longer). t_aa = D2H copy + host accumulation (step B-4-2), t_bc = H2D copy. In typical "
            "training the model uses the same t_aa, t_bc (§3.2's assumption)." % T_AS_MS, "",
            "| quantity | model | paper (measured) |", "|---|---:|---:|",
            f"| T (Def. 3.3), CGDP backward | {T:.2f} ms | 111 ms + 0.0218 ms |",
            f"| T' (Def. 3.4), typical backward + comm | {Tp:.2f} ms | 104 + 23 + 20 = 147 ms |",
            f"| T_O = Σt_as + t_aa¹ + t_bc¹ | {cgdp_overhead(t_as, t_aa, t_bc):.3f} ms | 7 ms + 0.0218 ms |",
            f"| T'_O = Σ(t_aa + t_bc) | {typical_overhead(t_aa, t_bc):.2f} ms | 43 ms |",
            f"| CGDP wins (T_O < T'_O) / §3.2 condition | {cgdp_wins(t_as, t_aa, t_bc)} / "
            f"{paper_win_condition(t_as, t_aa, t_bc)} | yes |",
            f"| iteration, CGDP: fwd + T + update | {fwd + T + upd:.1f} ms | 167.1 ms |",
            f"| iteration, typical: fwd + T' + update | {fwd + Tp + upd:.1f} ms | 202.7 ms |",
            f"| simulator, CGDP (k=1) | {sim['cgdp'].step_s * 1e3:.1f} ms, limit {sim['cgdp'].binding} | 167.1 ms |",
            f"| simulator, typical (tree via host) | {sim['typical'].step_s * 1e3:.1f} ms, limit "
            f"{sim['typical'].binding} | 202.7 ms |", "",
            "The exposed CGDP tail is layer 1's send, accumulate and copy back: the model gives "
            f"{t_aa[-1] + t_bc[-1] * 1:.3f} ms (Table 4: 0.014 + 0.018 + 0.007), the paper measured 21.8 µs for "
            "the copy back alone (0.007 ms in Table 4 — its 21.8 µs includes the final wait). The typical "
            "baseline is where the model is least faithful: Definition 3.4 prices the gather and broadcast "
            "with the host path's per-layer times, and the simulator's tree through the host overestimates "
            "BVLC/Caffe's P2P tree; both put CGDP ahead, as measured.", ""]


def table2(out: list[str]) -> None:
    out += ["## 2. Table 2: one iteration (ms), simulator against measured", "",
            "Hardware: preset `paper-p100` (rates from Table 4), G GPUs; models from cgdp/paper_profiles.py "
            "(single-GPU time = Table 2's one-GPU BVLC figure by construction). CGDP uses the planner's plan.", "",
            "| network | G | typical: sim | BVLC measured | CGDP: sim | TRL measured | sim speedup | measured speedup |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, key in (("AlexNet", "alexnet"), ("GoogLeNet-v1", "googlenet"), ("VGGNet-16", "vgg16")):
        m = paper_model(key)
        for gi, G in enumerate((1, 2, 4)):
            hw = preset("paper-p100")
            hw.gpus = G
            c = stage_costs(hw)
            if G == 1:
                t_typ = t_cg = m.forward_s + sum(m.backward_s) + m.update_s
            else:
                t_typ = simulate(m, c, [], "typical").step_s
                t_cg = choose_plan(m, c).predicted_s
            b, t = TABLE2_MS[name]["BVLC"][gi], TABLE2_MS[name]["TRL"][gi]
            out.append(f"| {name} | {G} | {t_typ * 1e3:.1f} | {b} | {t_cg * 1e3:.1f} | {t} | "
                       f"{t_typ / t_cg:.2f} | {b / t:.2f} |")
    out += ["", "The simulator reproduces CGDP's near-flat scaling (communication hidden behind backward "
            "plus the syncs); it overestimates the typical baseline at 4 GPUs because its tree stages every "
            "hop through the host, where BVLC/Caffe used NVLink P2P within each GPU pair.", ""]


def figure2(out: list[str]) -> None:
    m = paper_model("resnet152", minibatch=16)
    c = stage_costs(preset("paper-p100"))
    L = m.num_layers
    ks = list(range(1, 101))
    t = {k: predict_step(m, c, paper_plan(L, k)) for k in ks}
    typ = simulate(m, c, [], "typical").step_s
    single = m.forward_s + sum(m.backward_s) + m.update_s
    best_k = min(t, key=t.get)
    choice = choose_plan(m, c)
    out += ["## 3. Figure 2: ResNet-152 (minibatch 16, 4 GPUs), time of ten iterations vs chunk size", "",
            f"Simulator, preset `paper-p100`, {L} layers, t_as = {T_AS_MS:.3f} ms per chunk. Typical: "
            f"{10 * typ:.2f} s; single GPU: {10 * single:.2f} s. The paper's figure: chunk size 1 slower than "
            "typical, improving through 2, 4, 6, 8, worse again for large chunks.", "",
            "| chunk size k | chunks | 10 iterations (s) |", "|---:|---:|---:|"]
    for k in (1, 2, 4, 6, 8, 10, 12, 16, 20, 30, 40, 50, 60, 80, 100):
        out.append(f"| {k} | {len(paper_plan(L, k))} | {10 * t[k]:.3f} |")
    out += ["", f"Best uniform: k = {best_k} ({10 * t[best_k]:.3f} s); k = 1 is "
            f"{'slower' if t[1] > typ else 'faster'} than typical ({10 * t[1]:.3f} s vs {10 * typ:.3f} s). "
            f"The planner's plan ({choice.method}, {len(choice.plan)} chunks): {10 * choice.predicted_s:.3f} s.",
            "Why large k gets worse under the paper's plan shape: l mod k layers are sent alone, "
            "so the number of syncs, floor(l/k) + (l mod k), grows again (k = 100: 1 + 56 chunks).", ""]


def figure5(out: list[str]) -> None:
    m = paper_model("resnet152", minibatch=12)
    c = stage_costs(preset("paper-p100"))
    rng = np.random.default_rng(0)
    out += ["## 4. Figure 5: Algorithm 1 and the model-based tuner (ResNet-152, minibatch 12)", "",
            "Each iteration's time is the simulator's prediction with ±1% uniform noise (seeded).", "",
            "| tuner | best chunk / plan | stopped at iteration | predicted step (ms) |", "|---|---|---:|---:|"]
    k_best, _, t_best = best_uniform(m, c)
    for step, rng_ in ((3, 5), (6, 5), (10, 5), (10, 10)):
        tu = PaperTuner(m.num_layers, step=step, range=rng_)
        while not tu.done:
            tu.observe(predict_step(m, c, tu.plan()) * (1 + 0.01 * rng.uniform(-1, 1)))
        out.append(f"| Algorithm 1, step {step}, range {rng_} | k = {tu.search.best_chunk} | "
                   f"{tu.search.stop_iteration} | {predict_step(m, c, tu.plan()) * 1e3:.2f} |")
    auto = AutoTuner(m.layer_bytes, 4)
    steps = 0
    while not auto.done:
        p = auto.plan()
        prof = synthetic_profile(m, c, p) if auto.wants_profile else None
        auto.observe(predict_step(m, c, p) * (1 + 0.01 * rng.uniform(-1, 1)), prof)
        steps += 1
    out += [f"| model-based (`chunks=\"auto\"`) | {auto.chosen_name}, {len(auto.plan())} chunks | {steps} | "
            f"{predict_step(m, c, auto.plan()) * 1e3:.2f} |",
            f"| (reference) best uniform on the simulator | k = {k_best} | — | {t_best * 1e3:.2f} |",
            f"| (reference) typical | — | — | {simulate(m, c, [], 'typical').step_s * 1e3:.2f} |", "",
            "As in the paper, different (step, range) settle on different chunk sizes with nearly the same "
            "time, all faster than typical training; the search takes 10·(number of sizes tried + 1) "
            "iterations. The model-based tuner reaches an equal or better plan in a fraction of the steps.", ""]


def engine_section(out: list[str]) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import cgdp
    from cgdp.planning.calibrate import calibrate, profile_and_time
    from cgdp.planning.chunks import one_chunk_plan

    torch.manual_seed(0)
    width, depth = 256, 12
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
    with cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=1e-3), ["cpu:0", "cpu:1"], chunks=1) as tr:
        L = len(tr.layers)
        for _ in range(3):
            tr.step(x, y, F.cross_entropy)
        plans = {f"k={k}": paper_plan(L, k) for k in (1, 2, 4, 8)}
        plans["one chunk"] = one_chunk_plan(L)
        profiles, times = profile_and_time(tr, plans, 15, lambda: tr.step(x, y, F.cross_entropy))
    cal = calibrate(profiles)
    shared = dataclasses.replace(cal.costs, shared_cores=float(os.cpu_count() or 2), acc_threads=1.0)
    out += ["## 5. This machine: simulator against the engine (CPU-emulated devices)", "",
            f"MLP {depth}×{width} + head ({L} layers), batch 64, devices cpu:0, cpu:1. Calibrated on 30 profiled "
            "steps (plans k=1 and one chunk), interleaved with the measured steps; measured = median of 15 "
            "unprofiled steps. Two simulator variants: stage costs as fitted, and the same with the "
            f"emulation's shared cores ({os.cpu_count()}) modelled as processor sharing.", "",
            f"Fitted: t_as = {cal.costs.sync_s * 1e6:.1f} µs per chunk; D2H {1e-9 / max(cal.costs.d2h.per_byte_s, 1e-30):.2f} GB/s; "
            f"accumulation {1e-9 / max(cal.costs.acc.per_byte_s, 1e-30):.2f} GB/s of chunk; H2D "
            f"{1e-9 / max(cal.costs.h2d.per_byte_s, 1e-30):.2f} GB/s.", "",
            "| plan | measured (ms) | predicted (ms) | error | predicted, shared cores | error |",
            "|---|---:|---:|---:|---:|---:|"]
    errs, errs2 = [], []
    for name, plan in plans.items():
        meas = statistics.median(times[name])
        a, b = predict_step(cal.model, cal.costs, plan), predict_step(cal.model, shared, plan)
        errs.append(abs(a - meas) / meas)
        errs2.append(abs(b - meas) / meas)
        out.append(f"| {name} | {meas * 1e3:.2f} | {a * 1e3:.2f} | {(a - meas) / meas:+.1%} | {b * 1e3:.2f} | "
                   f"{(b - meas) / meas:+.1%} |")
    out += ["", f"Mean absolute error: {statistics.mean(errs):.1%} (fitted), {statistics.mean(errs2):.1%} "
            "(shared cores). Other processes on the machine move these numbers run to run; "
            "tests/test_tuner_engine.py asserts ≤ 30% per plan and ≤ 20% on average (fitted variant, the one the auto tuner uses). The shared-cores variant double-counts: the fitted t_as already absorbs the contention of host work with compute.", ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "paper_reproduction.md"))
    ap.add_argument("--no-engine", action="store_true", help="skip section 5 (needs the engine, ~20 s)")
    args = ap.parse_args()
    t0 = time.time()
    out = ["# Reproducing the paper's cost model and results", "",
           f"Command: `python bench/reproduce_paper.py{' --no-engine' if args.no_engine else ''}`  ",
           f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; Python "
           f"{platform.python_version()}, NumPy {np.__version__}", ""]
    table3(out)
    table2(out)
    figure2(out)
    figure5(out)
    if not args.no_engine:
        import torch
        out[3] = out[3] + f", torch {torch.__version__}"
        engine_section(out)
    out.append(f"_Generated in {time.time() - t0:.1f} s._")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
