"""Engine: step time of cgdp against ``typical``, one replica alone, and PyTorch DDP over gloo.

    python bench/bench_engine.py            # both models, 5 interleaved rounds of 8 steps
    python bench/bench_engine.py --quick    # small models, 2 rounds of 3 steps (CI smoke test)

Same machine, same models, same per-replica batch, same initial weights and data:

* ``cgdp``: one process, ``Trainer(mode="cgdp")`` on two CPU-emulated devices (two device
  threads); ``typical``: the same with ``mode="typical"``;
* ``DDP``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, one process per replica,
  ``init_method`` a file on localhost, processes kept alive between rounds;
* ``single``: one replica on one device with one thread, the compute floor: with one core per
  replica, no data-parallel step can beat it.

torch runs one intra-op thread per device thread (cgdp, typical) and per process (DDP, single),
so every contender gets one core per replica; cgdp's host accumulator runs on Numba threads
(``--acc-threads``) that share those cores. First the answer: after ``--check-steps`` SGD steps
from the same start, cgdp's, typical's and DDP's parameters must equal those of single-device
training on the global batch to 1e-5 relative; only then are steps timed, all four contenders in
interleaved rounds, medians of per-step wall times.

Models: ``mlp`` (communication-heavy: 4 x Linear(2048, 2048) + ReLU, 16.8 M parameters, 64 MiB of
gradient per replica per step) and ``cnn`` (compute-heavy: four 3x3 convolutions on 32x32 images,
65 k parameters).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from common import command_line, fmt, machine, machine_md, median, table, write_results  # noqa: E402

LR = 0.01
OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
"""``--optimizer``: each at its defaults but the learning rate, on every contender alike."""


# ---------------------------------------------------------------------------------- the models
def mlp(width: int = 2048, depth: int = 4) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def cnn(channels: int = 32) -> nn.Module:
    c = channels
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10))


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    """"mlp" or "cnn"."""
    size: int
    """MLP width or CNN channels."""
    image: int = 32
    """CNN input side."""

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        return mlp(self.size) if self.kind == "mlp" else cnn(self.size)

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        if self.kind == "mlp":
            return torch.randn(n, self.size, generator=g), torch.randn(n, self.size, generator=g)
        return (torch.randn(n, 3, self.image, self.image, generator=g),
                torch.randint(0, 10, (n,), generator=g))

    def loss(self) -> nn.Module:
        return nn.MSELoss() if self.kind == "mlp" else nn.CrossEntropyLoss()


FULL = [Case("mlp 4x2048 (communication-heavy)", "mlp", 2048),
        Case("cnn 4 conv 32x32 (compute-heavy)", "cnn", 32)]
QUICK = [Case("mlp 4x256", "mlp", 256), Case("cnn 4 conv 8x8", "cnn", 8, image=8)]


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max |a - b| / max |b| over all parameters."""
    num = max(float((x - y).abs().max()) for x, y in zip(a, b))
    den = max(float(y.abs().max()) for y in b)
    return num / max(den, 1e-30)


# ---------------------------------------------------------------------------------- DDP over gloo
def ddp_worker(rank: int, world: int, init: str, case: Case, per_replica: int, cmds, results,
               optimizer: str = "sgd") -> None:
    """One DDP process: builds the replica, then runs what the parent asks, one command at a time."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = case.build()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = OPTIMIZERS[optimizer](ddp.parameters(), lr=LR)
        x, y = case.batch(per_replica * world)
        xs, ys = x[rank * per_replica:(rank + 1) * per_replica], y[rank * per_replica:(rank + 1) * per_replica]
        loss_fn = case.loss()
        while True:
            cmd, n = cmds.get()  # idle between rounds: blocked here, no CPU used
            if cmd == "stop":
                break
            times = []
            dist.barrier()
            c0 = time.process_time()
            for _ in range(n):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=False)
                loss_fn(ddp(xs), ys).backward()  # waits for the gradient allreduce
                opt.step()
                times.append(time.perf_counter() - t0)
            cpu = time.process_time() - c0  # every thread of this process, gloo's included
            results.put((rank, params_of(model) if cmd == "check" else (times, cpu)))
    finally:
        dist.destroy_process_group()


class DDPPool:
    def __init__(self, case: Case, per_replica: int, world: int = 2, optimizer: str = "sgd"):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="cgdp-bench-ddp-")
        init = "file://" + os.path.join(self._dir, "rendezvous")
        self.results = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=ddp_worker, daemon=True,
                                  args=(r, world, init, case, per_replica, self.cmds[r], self.results, optimizer))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, cmd: str, n: int, timeout: float = 600.0):
        """Rank 0's parameters ("check"), or (rank 0's step times, CPU seconds of all ranks)."""
        for q in self.cmds:
            q.put((cmd, n))
        got = dict(self.results.get(timeout=timeout) for _ in self.cmds)  # note: waits for every rank
        if cmd == "check":
            return got[0]
        return got[0][0], sum(cpu for _, cpu in got.values())

    def close(self) -> None:
        for q in self.cmds:
            q.put(("stop", 0))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        try:
            for f in os.listdir(self._dir):
                os.remove(os.path.join(self._dir, f))
            os.rmdir(self._dir)
        except OSError:
            pass


def tail_after_backward(trace: list[dict]) -> float:
    """Seconds from the end of the last device's backward to the last copy back."""
    bw = max(e["end"] for e in trace if e["stream"] == "compute" and e["name"] == "backward")
    back = max((e["end"] for e in trace if e["stream"] == "h2d"), default=bw)
    return max(back - bw, 0.0)


# ---------------------------------------------------------------------------------- the floor
def copies_s(nbytes: int, world: int, rounds: int = 5) -> float:
    """CPU seconds of the copies one cgdp step makes on emulated devices, made one after another
    on this thread: every device's gradient to the host, the host sum, the sum back to every
    device (float32). On a GPU the copy engines make them; here they share the cores with compute."""
    import numpy as np
    from cgdp import accumulate
    n = nbytes // 4
    flats = [np.ones(n, np.float32) for _ in range(world)]
    slots = [np.empty(n, np.float32) for _ in range(world)]
    out = np.empty(n, np.float32)

    def once() -> None:
        for f, s in zip(flats, slots):
            np.copyto(s, f)
        accumulate(out, slots)
        for f in flats:
            np.copyto(f, out)
    once()
    best = []
    for _ in range(rounds):
        c0 = time.process_time()
        once()
        best.append(time.process_time() - c0)
    return median(best)


# ---------------------------------------------------------------------------------- one case
def run_case(case: Case, per_replica: int, rounds: int, steps: int, check_steps: int,
             acc_threads: int, segment_bytes: int | None = None, optimizer: str = "sgd") -> dict:

    import cgdp
    world = 2
    x, y = case.batch(per_replica * world)
    loss_fn = case.loss()
    opt = lambda p: OPTIMIZERS[optimizer](p, lr=LR)  # noqa: E731
    devices = [f"cpu:{j}" for j in range(world)]

    # reference: single-device training on the global batch
    ref = case.build()
    ref_opt = opt(ref.parameters())
    for _ in range(check_steps):
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_opt.step()
    ref_p = params_of(ref)

    pool = DDPPool(case, per_replica, world, optimizer)
    trainers = {}
    try:
        seg = {} if segment_bytes is None else {"segment_bytes": segment_bytes}
        trainers["cgdp"] = cgdp.Trainer(case.build(), opt, devices, mode="cgdp", **seg)
        trainers["typical"] = cgdp.Trainer(case.build(), opt, devices, mode="typical")
        trainers["single"] = cgdp.Trainer(case.build(), opt, ["cpu:0"], mode="single")
        xs, ys = x[:per_replica], y[:per_replica]
        # 1. the answer
        errs = {}
        ddp_p = pool.run("check", check_steps)
        # AdamW's first steps divide by |g|: a gradient's last-bit difference (two halves summed, as every
        # data-parallel trainer sums, against one device's whole-batch sum) moves a near-zero one by up to lr. So
        # with AdamW the answer checked is DDP's (the same sum of halves), and one device's error is reported
        check_p = ref_p if optimizer == "sgd" else ddp_p
        for name in ("cgdp", "typical"):
            for _ in range(check_steps):
                trainers[name].step(x, y, loss_fn)
            errs[name] = rel_err(params_of(trainers[name].replicas[-1]), check_p)
        ddp_vs_one = rel_err(ddp_p, ref_p)
        against = "single-device training"
        if optimizer == "sgd":
            errs["DDP"] = ddp_vs_one
        else:
            against = "DDP"
            print(f"{case.name}: DDP and one device differ by {ddp_vs_one:.2e} (relative) after "
                  f"{check_steps} {OPTIMIZERS[optimizer].__name__} steps; cgdp and typical are checked against DDP")
        for name, e in errs.items():
            if not e <= 1e-5:
                raise AssertionError(f"{case.name}: {name}'s parameters after {check_steps} steps differ "
                                     f"from {against} by {e:.2e} (relative); not timing")
        # 2. the figures: every contender once per round, S steps each
        times: dict[str, list[float]] = {k: [] for k in ("single", "cgdp", "typical", "DDP")}
        cpu: dict[str, list[float]] = {k: [] for k in times}  # CPU seconds per step, all threads
        stats: dict[str, list[dict]] = {"cgdp": [], "typical": []}
        for name in ("single", "cgdp", "typical"):  # warm-up (the first steps allocate; chunks="auto" tunes)
            tr = trainers[name]
            for k in range(80):
                if k >= 2 and (tr.tuner is None or tr.tuner.done):
                    break
                tr.step(xs if name == "single" else x, ys if name == "single" else y, loss_fn)
        tr = trainers["cgdp"]
        cgdp_plan = f"chunks={tr.tuner.name if tr.tuner else 'given'}: {len(tr.plan)} chunks"
        # what each device thread runs with: cgdp's choice on emulated devices, else torch's count
        device_threads = getattr(cgdp.testing.inside(tr).threads, "intra_op", None) or torch.get_num_threads()
        pool.run("time", 2)
        for _ in range(rounds):
            for name in ("single", "cgdp", "typical"):
                tr = trainers[name]
                bx, by = (xs, ys) if name == "single" else (x, y)
                c0 = time.process_time()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    tr.step(bx, by, loss_fn)
                    times[name].append(time.perf_counter() - t0)
                    if name in stats:
                        stats[name].append(dict(tr.stats))
                cpu[name].append((time.process_time() - c0) / steps)
            t_ddp, c_ddp = pool.run("time", steps)
            times["DDP"] += t_ddp
            cpu["DDP"].append(c_ddp / steps)
        # traced cgdp steps: the tail after the *last* device's backward (the engine's
        # exposed_comm_s is per device, so it also counts waiting for the slower replica)
        tails = []
        for _ in range(max(3, steps // 2)):
            trainers["cgdp"].trace_next()
            trainers["cgdp"].step(x, y, loss_fn)
            tails.append(tail_after_backward(trainers["cgdp"].last_trace) / trainers["cgdp"].stats["step_s"])
        # one profiled cgdp step: where the host time goes
        trainers["cgdp"].profile_next()
        trainers["cgdp"].step(x, y, loss_fn)
        prof = trainers["cgdp"].last_profile
    finally:
        for tr in trainers.values():
            tr.close()
        pool.close()
    med = {k: median(v) for k, v in times.items()}
    copy_cpu = copies_s(sum(p.numel() for p in ref_p) * 4, world)
    cg = stats["cgdp"]
    exposed = median([s["exposed_comm_s"] for s in cg])
    return {
        "case": case.name, "per_replica": per_replica, "devices": world, "optimizer": OPTIMIZERS[optimizer].__name__,
        "params": sum(p.numel() for p in ref_p),
        "grad_mib": sum(p.numel() for p in ref_p) * 4 / 2**20,
        "rounds": rounds, "steps": steps, "check_steps": check_steps, "rel_err": errs, "ddp_vs_one_device": ddp_vs_one,
        "step_s": med, "cpu_s": {k: median(v) for k, v in cpu.items()},
        "exposed_s": exposed, "tail_frac": median(tails), "exposed_frac": median([s["exposed_comm_s"] / s["step_s"] for s in cg]),
        "cgdp_phase_s": {k: median([s[k] for s in cg]) for k in
                         ("forward_s", "backward_s", "exposed_comm_s", "update_s", "step_s")},
        "typical_phase_s": {k: median([s[k] for s in stats["typical"]]) for k in
                            ("forward_s", "backward_s", "update_s", "step_s")},
        "profile": None if prof is None else [
            {"chunk": c.index, "layers": c.layers, "mib": c.bytes / 2**20, "d2h_ms": c.d2h_s * 1e3,
             "acc_ms": c.acc_s * 1e3, "h2d_ms": c.h2d_s * 1e3, "back_ms": c.back_s * 1e3}
            for c in prof.chunks],
        "profile_backward_ms": None if prof is None else prof.backward_s * 1e3,
        "copies_cpu_s": copy_cpu,
        "floor_s": med["single"] + copy_cpu / 2,
        "cgdp_plan": cgdp_plan,
        "kernel": "cgdp.engine.core.accumulate" + ("" if segment_bytes is None else f", segment_bytes {segment_bytes >> 10} KiB"),
        "threads": f"torch {device_threads} per device thread (cgdp, typical), {torch.get_num_threads()} in the "
                   f"calling thread, 1 per DDP process; Numba {acc_threads} for cgdp's accumulator",
    }


def report(results: list[dict], info: dict[str, str], cmd: str) -> str:
    rows, phase_rows, prof_rows = [], [], []
    for r in results:
        s = r["step_s"]
        rows.append([r["case"], f"{r['params'] / 1e6:.3g} M", r["per_replica"],
                     fmt(s["single"] * 1e3), fmt(s["cgdp"] * 1e3), fmt(s["typical"] * 1e3),
                     fmt(s["DDP"] * 1e3), fmt(s["cgdp"] / s["DDP"], 2), fmt(s["cgdp"] / s["typical"], 2),
                     fmt(s["cgdp"] / s["single"], 2), fmt(s["DDP"] / s["single"], 2),
                     f"{100 * r['exposed_frac']:.1f} %", f"{100 * r['tail_frac']:.1f} %",
                     " / ".join(f"{k} {v:.0e}" for k, v in r["rel_err"].items()),
                     fmt(r["floor_s"] * 1e3), fmt(s["cgdp"] / r["floor_s"], 2)])
        p = r["cgdp_phase_s"]
        phase_rows.append([r["case"], fmt(p["forward_s"] * 1e3), fmt(p["backward_s"] * 1e3),
                           fmt(p["exposed_comm_s"] * 1e3), fmt(p["update_s"] * 1e3), fmt(p["step_s"] * 1e3)])
        for c in r["profile"] or []:
            prof_rows.append([r["case"], c["chunk"], c["layers"], fmt(c["mib"], 2), fmt(c["d2h_ms"], 2),
                              fmt(c["acc_ms"], 2), fmt(c["h2d_ms"], 2), fmt(c["back_ms"], 1)])
    cpu_rows = []
    for r in results:
        c = r["cpu_s"]
        cpu_rows.append([r["case"], fmt(c["single"] * 1e3), fmt(c["cgdp"] * 1e3), fmt(c["typical"] * 1e3),
                         fmt(c["DDP"] * 1e3), fmt(c["cgdp"] / c["DDP"], 2), fmt(c["cgdp"] / (2 * c["single"]), 2),
                         fmt(c["DDP"] / (2 * c["single"]), 2)])
    against = "single-device" if results[0].get("optimizer", "SGD") == "SGD" else "DDP"
    head = ["model", "params", "batch / replica", "single ms", "cgdp ms", "typical ms", "DDP gloo ms",
            "cgdp / DDP", "cgdp / typical", "cgdp / single", "DDP / single", "exposed comm / step",
            "tail after last backward / step",
            f"check (rel. err. vs {against})", "two-core floor ms", "cgdp / floor"]
    verdicts = []
    for r in results:
        if r["case"].startswith("mlp 4x2048"):
            ratio = r["step_s"]["cgdp"] / r["step_s"]["DDP"]
            verdicts.append(f"- {r['case']}: cgdp / DDP = {ratio:.2f} (target <= 0.75: "
                            f"{'met' if ratio <= 0.75 else 'NOT met'}); exposed communication "
                            f"{100 * r['exposed_frac']:.1f} % of the step (target < 5 %: "
                            f"{'met' if r['exposed_frac'] < 0.05 else 'NOT met'}); tail after the last device's "
                            f"backward {100 * r['tail_frac']:.1f} %")
    r0 = results[0]
    return "\n".join([
        "## Engine: cgdp vs typical vs PyTorch DDP (gloo) vs one replica alone", "",
        f"Command: `{cmd}`", "", "Machine:", machine_md(info), "",
        f"Setup: {r0['devices']} replicas; cgdp and typical in one process on CPU-emulated devices "
        f"{['cpu:0', 'cpu:1']}, DDP as {r0['devices']} processes over gloo (file rendezvous); "
        f"single = one replica, one thread (the compute floor). Threads: {r0['threads']}. Host kernel: {r0['kernel']}. cgdp at default settings ("
        + ", ".join(f"{r['case'].split(' (')[0]}: {r['cgdp_plan']}" for r in results) + f", tuned during warm-up). "
        f"{r0.get('optimizer', 'SGD')} at its defaults, lr {LR}. Parameters checked against "
        f"{'single-device training on the global batch' if r0.get('optimizer', 'SGD') == 'SGD' else 'DDP (AdamW divides by |g|: the same sum of two halves is compared)'} after "
        f"{r0['check_steps']} steps before timing. Step times: median over {r0['rounds']} "
        f"interleaved rounds x {r0['steps']} steps, wall time of the whole step as the user sees "
        f"it; exposed comm = trainer.stats['exposed_comm_s'] / trainer.stats['step_s'] (median; from "
        f"the end of the last device's backward to the last copy back); tail "
        f"after last backward = from the end of the last device's backward to the last copy back, "
        f"from traced steps (median).", "",
        table(head, rows), "", *verdicts, "",
        "CPU time per step (all threads of all processes, ms; median over rounds). Less sensitive "
        "to the other jobs on the machine than wall time: on 2 free cores a step cannot take less "
        "than half of it. 2 x single is the compute of two replicas with no communication at all.", "",
        "Two-core floor: one replica's step (single: each core runs one replica) plus half the CPU of "
        "the copies a cgdp step makes on emulated devices (every gradient to the host, the host sum, the "
        "sum back to every device, timed on one thread; on a GPU the copy engines make them): "
        + "; ".join(f"{r['case']}: {r['copies_cpu_s'] * 1e3:.1f} ms of copies" for r in results) + ".", "",
        table(["model", "single", "cgdp", "typical", "DDP", "cgdp / DDP", "cgdp / (2 x single)",
               "DDP / (2 x single)"], cpu_rows), "",
        "cgdp phases (median ms, from trainer.stats):", "",
        table(["model", "forward", "backward", "exposed comm", "update", "step"], phase_rows), "",
        "One profiled cgdp step (chunk = one layer; per-chunk means over devices):", "",
        table(["model", "chunk", "layers", "MiB", "D2H ms", "accumulate ms", "H2D ms",
               "back on all devices at ms"], prof_rows), ""])


def add_case_args(ap: argparse.ArgumentParser) -> None:
    """The options every benchmark over these cases takes (also bench_dataparallel's)."""
    ap.add_argument("--quick", action="store_true", help="small models, 2 rounds of 3 steps")
    ap.add_argument("--models", default="mlp,cnn", help="which cases: mlp, cnn")
    ap.add_argument("--per-replica", type=int, default=16, help="samples per replica")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="steps per contender per round")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd",
                    help="every contender's optimizer, at torch's defaults but lr (the same kernel everywhere)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_case_args(ap)
    ap.add_argument("--segment-kib", type=int, default=None,
                    help="cgdp's segment_bytes in KiB (default: the Trainer's)")
    ap.add_argument("--md", help="write the markdown report here")
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--torch-threads", choices=("one", "default"), default="one",
                    help="torch's intra-op threads in this process: one (one core per device thread, as "
                         "each DDP process gets under torchrun) or default (left as torch and cgdp choose: "
                         "what a user who sets nothing gets)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.check_steps = 2, 3, 2
    # the engine's host sum runs one Numba thread on emulated devices (cgdp.engine.backend.host_threads)
    acc_threads = 1
    if args.torch_threads == "one":
        torch.set_num_threads(1)  # one core per device thread, as each DDP process gets
    cases = QUICK if args.quick else FULL
    wanted = args.models.split(",")
    cases = [c for c in cases if c.kind in wanted]
    info, cmd = machine(), command_line()
    results = []
    for case in cases:
        r = run_case(case, args.per_replica, args.rounds, args.steps, args.check_steps, acc_threads,
                     None if args.segment_kib is None else args.segment_kib * 1024, args.optimizer)
        s = r["step_s"]
        print(f"{case.name}: single {s['single'] * 1e3:.1f} ms | cgdp {s['cgdp'] * 1e3:.1f} | typical "
              f"{s['typical'] * 1e3:.1f} | DDP {s['DDP'] * 1e3:.1f} | cgdp/DDP {s['cgdp'] / s['DDP']:.2f} "
              f"cgdp/single {s['cgdp'] / s['single']:.2f} | floor {r['floor_s'] * 1e3:.1f} ms, cgdp/floor "
              f"{s['cgdp'] / r['floor_s']:.2f} | CPU ms cgdp {1e3 * r['cpu_s']['cgdp']:.0f} "
              f"DDP {1e3 * r['cpu_s']['DDP']:.0f} 2xsingle {2e3 * r['cpu_s']['single']:.0f} | exposed {100 * r['exposed_frac']:.1f} % "
              f"| check {r['rel_err']}", flush=True)
        results.append(r)
    write_results(report(results, info, cmd), results, info, cmd, args.md, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
