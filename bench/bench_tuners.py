"""The chunk tuners on the engine, measured: Algorithm 1, the model-based tuner, every uniform plan.

Both tuners run live (``Trainer(chunks="paper")`` and ``chunks="auto"``) on a deep, flat model on
CPU-emulated devices, where a chunk's fixed cost (its event, its copies, its host sum) is what a
plan trades against overlap. Then the plans they chose, every uniform plan and the two extremes are
timed on one trainer in interleaved rounds (``set_plan`` between them, outside the timed steps),
after each plan's answer was checked against single-device autograd training.

    python bench/bench_tuners.py --md bench/results/tuners.md
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
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cgdp  # noqa: E402
from cgdp.planning.chunks import one_chunk_plan, paper_plan  # noqa: E402
from common import command_line, fmt, machine, machine_md, median, table  # noqa: E402

DEVICES = ["cpu:0", "cpu:1"]


def flat_mlp(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(width, 10))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def batches(n: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def check(model: nn.Module, plan, data) -> float:
    """Relative error of the plan's parameters against autograd on one device after 3 steps."""
    ref = copy.deepcopy(model)
    opt = optimizer(ref.parameters())
    with cgdp.Trainer(copy.deepcopy(model), optimizer, DEVICES, chunks=plan) as tr:
        for x, y in data[:3]:
            opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            opt.step()
            tr.step(x, y, F.cross_entropy)
        return max(((p - q).abs().max() / q.abs().max()).item()
                   for p, q in zip(tr.replicas[0].parameters(), ref.parameters()))


def run_tuner(model: nn.Module, spec: str, data, max_steps: int) -> dict:
    with cgdp.Trainer(copy.deepcopy(model), optimizer, DEVICES, chunks=spec) as tr:
        t0 = time.perf_counter()
        steps = 0
        while not tr.tuner.done and steps < max_steps:
            x, y = data[steps % len(data)]
            tr.step(x, y, F.cross_entropy)
            steps += 1
        return {"spec": spec, "steps": steps, "done": tr.tuner.done, "seconds": time.perf_counter() - t0,
                "plan": tr.tuner.plan(), "describe": tr.tuner.describe()}


def measure(model: nn.Module, plans: dict[str, list[list[int]]], data, rounds: int, steps: int) -> dict[str, float]:
    """Median step time of every plan, in interleaved rounds on one trainer."""
    times: dict[str, list[float]] = {k: [] for k in plans}
    with cgdp.Trainer(copy.deepcopy(model), optimizer, DEVICES, chunks=1) as tr:
        i = 0
        for _ in range(rounds):
            for name, plan in plans.items():
                tr.set_plan(plan)  # between steps: not timed
                x, y = data[i % len(data)]
                tr.step(x, y, F.cross_entropy)  # one warm-up step on the new layout
                for _ in range(steps):
                    x, y = data[i % len(data)]
                    i += 1
                    tr.step(x, y, F.cross_entropy)
                    times[name].append(tr.stats["step_s"])
    return {k: median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--batch", type=int, default=32, help="global batch (split over 2 devices)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per plan per round")
    ap.add_argument("--max-tuner-steps", type=int, default=400)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--md", help="write the markdown report here")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.rounds, args.steps = 8, 32, 2, 2
    torch.set_num_threads(1)  # one core per device thread
    model = flat_mlp(args.layers, args.width)
    L = len(cgdp.Trainer(copy.deepcopy(model), optimizer, ["cpu:0"], mode="single").layers)
    data = batches(16, args.batch, args.width)

    tuners = [run_tuner(model, spec, data, args.max_tuner_steps) for spec in ("paper", "auto")]
    sizes = sorted({k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if k < L} | {L - 1})
    plans = {f"uniform k={k}": paper_plan(L, k) for k in sizes}
    plans["one chunk"] = one_chunk_plan(L)
    plans["Algorithm 1's choice"] = tuners[0]["plan"]
    plans["auto tuner's choice"] = tuners[1]["plan"]
    errors = {name: check(model, plan, data) for name, plan in plans.items()}
    bad = {k: e for k, e in errors.items() if not e <= 1e-5}
    if bad:
        raise AssertionError(f"plans differ from single-device training: {bad}; not timing")
    t = measure(model, plans, data, args.rounds, args.steps)

    uniform = {k: v for k, v in t.items() if k.startswith("uniform")}
    best_name = min(uniform, key=uniform.get)
    rows = [[name, len(plans[name]), fmt(v * 1e3, 2), fmt(v / t[best_name], 3)]
            for name, v in sorted(t.items(), key=lambda kv: kv[1])]
    a1, auto = tuners
    lines = [
        "## The chunk tuners on the engine (CPU-emulated devices)", "",
        f"Command: `{command_line()}`", "", "Machine:", machine_md(machine()), "",
        f"Model: {args.layers} x Linear({args.width}, {args.width}) + tanh + a 10-way head ({L} layers), "
        f"global batch {args.batch} on {DEVICES}, SGD with momentum; torch 1 thread per device thread. "
        f"Every plan's parameters matched single-device training after 3 steps (worst relative error "
        f"{max(errors.values()):.1e}) before timing. Step time: median over {args.rounds} interleaved "
        f"rounds x {args.steps} steps.", "",
        "| tuner | steps to decide | wall s | chose |", "|---|---|---|---|",
        f"| Algorithm 1 (`chunks=\"paper\"`, step 10, range 5) | {a1['steps']}{'' if a1['done'] else ' (not done)'} "
        f"| {a1['seconds']:.1f} | {len(a1['plan'])} chunks |",
        f"| model-based (`chunks=\"auto\"`) | {auto['steps']}{'' if auto['done'] else ' (not done)'} "
        f"| {auto['seconds']:.1f} | {len(auto['plan'])} chunks |", "",
        table(["plan", "chunks", "step ms", f"vs best uniform ({best_name})"], rows), "",
        f"Algorithm 1: {a1['describe']}", "", "```", auto["describe"], "```", ""]
    md = "\n".join(lines)
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
