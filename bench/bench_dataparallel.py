"""DataParallel: the user's own loop under cgdp.DataParallel, torch.nn.DataParallel and DDP.

    python bench/bench_dataparallel.py            # both models, 5 interleaved rounds of 8 steps
    python bench/bench_dataparallel.py --quick    # small models, 2 rounds of 3 steps

The loop is the same for every contender (``opt.zero_grad(); loss_fn(model(x), y).backward();
opt.step()``, SGD), with the models, batches and conventions of ``bench_engine.py``:

* ``cgdp.DataParallel``: one process, two CPU-emulated devices, the user's loop;
* ``cgdp.Trainer``: the same engine behind ``trainer.step`` (the other face), for reference;
* ``nn.DataParallel``: PyTorch's one-process data parallelism. Without a GPU it has no device to
  replicate to and runs the module once on the whole global batch: it measures one replica doing
  the work of two, with two intra-op threads (both cores), which is what a user of it gets here;
* ``DDP``: ``DistributedDataParallel`` over gloo, two processes (``bench_engine.DDPPool``);
* ``single``: one replica, per-replica batch, one thread: the compute floor.

One torch intra-op thread per device thread and per process (two for nn.DataParallel, which has
one thread of its own). On emulated devices autograd runs the backward of every replica of
``cgdp.DataParallel`` on the one thread that calls ``backward()`` (on GPUs it runs one thread per
device), so its backward is serial here, where the Trainer's two device threads run theirs at
once. First the answer: after ``--check-steps`` steps every contender's parameters must equal
single-device training on the global batch to 1e-5 relative; then all are timed in interleaved
rounds, medians of per-step wall times.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench_engine import FULL, LR, QUICK, Case, DDPPool, add_case_args, params_of, rel_err  # noqa: E402
from common import command_line, fmt, machine, machine_md, median, table, write_results  # noqa: E402

NAMES = ("single", "cgdp.DataParallel", "cgdp.Trainer", "nn.DataParallel", "DDP")
THREADS = {"nn.DataParallel": 2}
"""torch intra-op threads per contender (1 unless named)."""


def user_loop(model: nn.Module, opt: torch.optim.Optimizer, x, y, loss_fn) -> None:
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()


def run_case(case: Case, per_replica: int, rounds: int, steps: int, check_steps: int) -> dict:
    import cgdp
    world = 2
    x, y = case.batch(per_replica * world)
    xs, ys = x[:per_replica], y[:per_replica]
    loss_fn = case.loss()
    sgd = lambda p: torch.optim.SGD(p, lr=LR)  # noqa: E731
    devices = [f"cpu:{j}" for j in range(world)]

    ref = case.build()
    ref_opt = sgd(ref.parameters())
    for _ in range(check_steps):
        user_loop(ref, ref_opt, x, y, loss_fn)
    ref_p = params_of(ref)

    pool = DDPPool(case, per_replica, world)
    dp = tr = None
    try:
        dp = cgdp.DataParallel(case.build(), devices)  # default settings (chunks="auto")
        tr = cgdp.Trainer(case.build(), sgd, devices)
        torch_dp = nn.DataParallel(case.build())
        single = case.build()
        opts = {"cgdp.DataParallel": dp.bind(sgd(dp.parameters())), "nn.DataParallel": sgd(torch_dp.parameters()),
                "single": sgd(single.parameters())}
        steps_of = {
            "single": lambda: user_loop(single, opts["single"], xs, ys, loss_fn),
            "cgdp.DataParallel": lambda: user_loop(dp, opts["cgdp.DataParallel"], x, y, loss_fn),
            "cgdp.Trainer": lambda: tr.step(x, y, loss_fn),
            "nn.DataParallel": lambda: user_loop(torch_dp, opts["nn.DataParallel"], x, y, loss_fn),
        }
        # 1. the answer
        errs = {}
        for name, model in (("cgdp.DataParallel", dp.replicas[-1]), ("cgdp.Trainer", tr.replicas[-1]),
                            ("nn.DataParallel", torch_dp.module)):
            for _ in range(check_steps):
                steps_of[name]()
            errs[name] = rel_err(params_of(model), ref_p)
        errs["DDP"] = rel_err(pool.run("check", check_steps), ref_p)
        for name, e in errs.items():
            if not e <= 1e-5:
                raise AssertionError(f"{case.name}: {name}'s parameters after {check_steps} steps differ "
                                     f"from single-device training by {e:.2e} (relative); not timing")
        # 2. the figures: every contender once per round, S steps each
        times: dict[str, list[float]] = {k: [] for k in NAMES}
        for name, fn in steps_of.items():  # warm-up (the first steps allocate; chunks="auto" tunes)
            with threads(THREADS.get(name, 1)):
                fn(), fn()
                for _ in range(80):
                    if not (dp.tuning or (tr.tuner is not None and not tr.tuner.done)):
                        break
                    fn()
        pool.run("time", 2)
        for _ in range(rounds):
            for name, fn in steps_of.items():
                with threads(THREADS.get(name, 1)):
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
            times["DDP"] += pool.run("time", steps)[0]
    finally:
        for obj in (dp, tr):
            if obj is not None:
                obj.close()
        pool.close()
    return {"case": case.name, "per_replica": per_replica, "devices": world,
            "params": sum(p.numel() for p in ref_p), "rounds": rounds, "steps": steps,
            "check_steps": check_steps, "rel_err": errs,
            "step_s": {k: median(v) for k, v in times.items()}}


class threads:
    """torch's intra-op thread count for one contender's steps."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)


def report(results: list[dict], info: dict[str, str], cmd: str) -> str:
    rows = []
    for r in results:
        s = r["step_s"]
        rows.append([r["case"], f"{r['params'] / 1e6:.3g} M", r["per_replica"],
                     *[fmt(s[k] * 1e3) for k in NAMES],
                     fmt(s["cgdp.DataParallel"] / s["DDP"], 2),
                     fmt(s["cgdp.DataParallel"] / s["nn.DataParallel"], 2),
                     fmt(s["cgdp.DataParallel"] / s["cgdp.Trainer"], 2),
                     " / ".join(f"{k} {v:.0e}" for k, v in r["rel_err"].items())])
    head = ["model", "params", "batch / replica", *[f"{k} ms" for k in NAMES],
            "cgdp.DP / DDP", "cgdp.DP / nn.DP", "cgdp.DP / Trainer", "check (rel. err. vs single-device)"]
    r0 = results[0]
    return "\n".join([
        "## DataParallel: the user's loop under cgdp.DataParallel, nn.DataParallel and DDP", "",
        f"Command: `{cmd}`", "", "Machine:", machine_md(info), "",
        f"Setup: {r0['devices']} replicas, the same loop for every contender (zero_grad, forward, "
        f"loss, backward, SGD step, lr {LR}); cgdp.DataParallel and cgdp.Trainer (default settings: "
        f"chunks=\"auto\", tuned during warm-up) in one "
        f"process on CPU-emulated devices ['cpu:0', 'cpu:1'], one torch thread per device thread; "
        f"DDP as {r0['devices']} processes over gloo, one thread each; nn.DataParallel without a GPU "
        f"runs the module once on the global batch (it has no device to replicate to), with 2 "
        f"threads; single = one replica on its own batch, one thread (the compute floor). "
        f"Parameters checked against single-device training on the global batch after "
        f"{r0['check_steps']} steps before timing. Step times: median over {r0['rounds']} "
        f"interleaved rounds x {r0['steps']} steps, wall time of the whole step.", "",
        table(head, rows), "",
        "Reading it: on emulated devices autograd runs every replica's backward of "
        "cgdp.DataParallel on the thread that calls backward() (on GPUs, autograd runs one thread "
        "per device), so its backward is serial on one core here while cgdp.Trainer runs its two "
        "device threads' backwards at once: cgdp.DP / Trainer is the price of that on this "
        "machine, not of the face. nn.DataParallel's column is one replica doing the whole batch "
        "on both cores, not data parallelism: without GPUs it is the plain module on one device, "
        "which is what a user without GPUs would otherwise run (or DDP over gloo, to rehearse a "
        "multi-device job). On a quiet machine it is the fastest of all here, since the replicas of "
        "the data-parallel runs share the same two cores and cgdp's emulated copies take CPU that a "
        "GPU's copy engines would not; under load its two intra-op threads wait for each other and "
        "it falls behind (compare the load average above).", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_case_args(ap)
    ap.add_argument("--md", help="write the markdown report here")
    ap.add_argument("--json", help="write the raw figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.check_steps = 2, 3, 2
    torch.set_num_threads(1)
    cases = [c for c in (QUICK if args.quick else FULL) if c.kind in args.models.split(",")]
    info, cmd = machine(), command_line()
    results = []
    for case in cases:
        r = run_case(case, args.per_replica, args.rounds, args.steps, args.check_steps)
        print(f"{case.name}: " + " | ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["step_s"].items())
              + f" | check {r['rel_err']}", flush=True)
        results.append(r)
    write_results(report(results, info, cmd), results, info, cmd, args.md, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
