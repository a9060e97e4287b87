"""``update="host"`` against ``update="devices"``: step time, the host optimizer's bandwidth, overlap.

    python bench/bench_host_update.py                  # ~2-3 min on 2 cores
    python bench/bench_host_update.py --quick          # fewer rounds (smoke test)

Three measurements, each checked before it is timed:

1. **The host optimizer against memcpy**: one AdamW / SGD(momentum) step over one float32 tensor
   of N elements on the host, ``fused=True`` against not, as GB/s of the DRAM traffic it implies
   (AdamW 28 B/elem, SGD with momentum 20 B/elem: :mod:`cgdp.planning.host_update`), next to the
   same machine's memcpy (``dst.copy_(src)``: 8 B/elem). Checked: fused and unfused agree (rtol 1e-5).
2. **Step time** of ``Trainer(update="host")`` against ``update="devices"`` on emulated devices
   (G = 2, 4; the 4x2048 MLP and the GPT-2-small structure at width 32; AdamW and SGD with
   momentum): the median over interleaved rounds, their ratio, the host optimizer's own time
   (``stats["host_update_s"]``) and whether it ran with backward (chunk by chunk) or after it.
   Checked: after two steps, update='host' holds bitwise the parameters of update='devices' stepping the same
   (fused) kernel; the timed devices side runs torch's default kernel.
3. The cost model's rate, learned from measurement 1 (:class:`HostUpdateCost.observe`).

``--flat`` measures instead the overlapped host AdamW before and after its moments went flat in two sides
(:mod:`cgdp.engine.core.host_adam`): one thread, ``--elements`` float32 parameters in tensors of the 4x2048 MLP's
shapes; torch's fused step alone, cgdp's path before (the state copied aside, then torch's step) and after (one
out-of-place call), against the memory limit (28 B/elem over the streaming bandwidth measured in the same run, the
fastest of copy, add and an in-place add); then ``update="host"`` before and after against ``update="devices"``, all fused AdamW, G = 2
(``bench/results/host_update_flat.md``). Checked first: the flat step bitwise equal to torch's.

``--flat-sgd`` measures the same for SGD with momentum (:mod:`cgdp.engine.core.host_sgd`): ``update="host"`` before
(torch's fused step per chunk, the state copied aside) and after (the flat momentum) against ``update="devices"``, G = 2,
on the GPT-2 structure (default chunks) and the 4x2048 MLP (``chunks=2``) (``bench/results/host_update_flat_sgd.md``).
Checked first: before and after bitwise equal.

``--wire`` measures instead ``grad_transfer="bf16"`` with ``update="host"`` (the parameters go
back in bf16, the host reads its own bf16 sum) against float32 on the wire and against
``update="devices"`` with the bf16 wire: the 4x2048 MLP, G = 2, AdamW; step time, what is left
after backward, and the bytes each device receives back per step (``bench/results/host_update_bf16.md``).

On emulated devices the "devices" run G optimizers on the same 2 cores the host uses, so the
ratio here says what moving G optimizer steps to one host step costs in CPU, not a GPU figure.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import command_line, fmt, interleaved, machine, machine_md, median, table, write_results  # noqa: E402

import cgdp  # noqa: E402
from cgdp.planning.host_update import UPDATE_BYTES, HostUpdateCost  # noqa: E402

OPTS = {"adamw": lambda p, **kw: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **kw),
        "sgd_momentum": lambda p, **kw: torch.optim.SGD(p, lr=1e-2, momentum=0.9, **kw)}


def mlp4x2048() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def gpt2_structure() -> nn.Module:
    """GPT-2 small's layer structure (12 blocks, 148 parameter tensors) at width 32."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=12, n_head=2, bos_token_id=0, eos_token_id=0))


def mlp_batch(n: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)


def gpt2_batch(n: int):
    return {"ids": torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(1))}


def gpt2_loss(m, b):
    return m(input_ids=b["ids"], labels=b["ids"]).loss


# ---------------------------------------------------------------------------- 1. the host optimizer
def optimizer_bandwidth(n: int, rounds: int) -> list[dict]:
    src, dst = torch.randn(n), torch.empty(n)
    t = median(interleaved({"memcpy": lambda: dst.copy_(src)}, rounds)["memcpy"])
    rows = [{"what": "memcpy", "bytes_per_elem": 8, "s": t, "gbps": 8 * n / t / 1e9}]
    for name, make in OPTS.items():
        variants = {}
        for fused in (False, True):
            p = nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(2)))
            p.grad = torch.randn(n, generator=torch.Generator().manual_seed(3))
            variants[fused] = (p, make([p], fused=fused))
        for p, opt in variants.values():  # check: one step each from the same start, the same result
            opt.step()
        torch.testing.assert_close(variants[True][0], variants[False][0], rtol=1e-5, atol=1e-7)
        times = interleaved({f: v[1].step for f, v in variants.items()}, rounds)
        for fused, ts in times.items():
            t = median(ts)
            rows.append({"what": f"{name} fused={fused}", "bytes_per_elem": UPDATE_BYTES[name], "s": t,
                         "gbps": UPDATE_BYTES[name] * n / t / 1e9})
    return rows


# ---------------------------------------------------------------------------- 2. step time
def step_times(rounds: int, gs: list[int]) -> list[dict]:
    cases = {"mlp4x2048": (mlp4x2048, lambda g: mlp_batch(16 * g), F.cross_entropy),
             "gpt2-structure": (gpt2_structure, lambda g: gpt2_batch(2 * g), None)}
    rows = []
    for model_name, (build, batch, loss) in cases.items():
        for g in gs:
            devices = [f"cpu:{i}" for i in range(g)]
            for opt_name, make in OPTS.items():
                b = batch(g)
                args = (*b, loss) if loss is not None else (b, gpt2_loss)
                trainers = {u: cgdp.Trainer(build(), make, devices, update=u, chunks=2) for u in ("devices", "host")}
                # the check: update='host' steps with the fused kernel, which it picks; on the devices the same kernel
                # gives the same bits (torch's default kernel rounds otherwise, which Adam's step can amplify)
                same = None
                try:
                    same = cgdp.Trainer(build(), functools.partial(make, fused=True), devices, chunks=2)
                    for tr in (*trainers.values(), same):  # check: the same parameters after two steps
                        tr.step(*args)
                        tr.step(*args)
                    for p, q in zip(same.replicas[0].parameters(), trainers["host"].replicas[0].parameters()):
                        torch.testing.assert_close(q, p, rtol=0, atol=0)
                    same.close()
                    times = interleaved({u: (lambda tr=tr: tr.step(*args)) for u, tr in trainers.items()}, rounds,
                                        warmup=1)
                    st = trainers["host"].stats
                    n = sum(p.numel() for p in trainers["host"].replicas[0].parameters())
                    rows.append({"model": model_name, "G": g, "optimizer": opt_name, "params": n,
                                 "devices_s": median(times["devices"]), "host_s": median(times["host"]),
                                 "host_update_s": st["host_update_s"],
                                 "overlapped": bool(st["host_update_overlapped"]),
                                 "exposed_update_s": st["update_s"]})
                finally:
                    for tr in (*trainers.values(), same):
                        if tr is not None:
                            tr.close()
    return rows


def wire_times(rounds: int) -> list[dict]:
    """``--wire``: update='host' with float32 and bf16 on the wire against update='devices' like for like (the same
    wire, the fused AdamW kernel that update='host' picks), and update='devices' with torch's default kernel."""
    fused = functools.partial(OPTS["adamw"], fused=True)
    cases = {"host, float32 wire": (OPTS["adamw"], dict(update="host")),
             "devices, float32 wire, fused": (fused, dict(update="devices")),
             "host, bf16 wire": (OPTS["adamw"], dict(update="host", grad_transfer="bf16")),
             "devices, bf16 wire, fused": (fused, dict(update="devices", grad_transfer="bf16")),
             "devices, bf16 wire, default kernel": (OPTS["adamw"], dict(update="devices", grad_transfer="bf16"))}
    x, y = mlp_batch(32)
    trainers = {k: cgdp.Trainer(mlp4x2048(), opt, ["cpu:0", "cpu:1"], chunks=2, **kw)
                for k, (opt, kw) in cases.items()}
    try:
        times = interleaved({k: (lambda tr=tr: tr.step(x, y, F.cross_entropy)) for k, tr in trainers.items()},
                            rounds, warmup=2)
        n = sum(p.numel() for p in trainers["host, bf16 wire"].replicas[0].parameters())
        rows = []
        for k, tr in trainers.items():
            st = tr.stats
            wire = 2 if "bf16" in k else 4  # update='devices': the averaged gradient, in the wire's bytes
            back = int(st.get("host_update_bytes_back", wire * n))
            rows.append({"case": k, "params": n, "step_s": median(times[k]), "exposed_update_s": st["update_s"],
                         "overlapped": bool(st.get("host_update_overlapped", 0.0)), "bytes_back": back,
                         "gradient_bytes_back": 0 if "host" in k else wire * n})
        return rows
    finally:
        for tr in trainers.values():
            tr.close()


def flat_isolated(n: int, rounds: int) -> list[dict]:
    """One thread: torch's fused AdamW, cgdp's copy-then-step (before), the flat out-of-place step (after)."""
    import itertools
    from cgdp.engine.core.host_adam import FlatAdam
    from cgdp.engine.core.host_state import StateSnapshot
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shapes = [p.shape for p in mlp4x2048().parameters()]
        reps = max(1, n // sum(s.numel() for s in shapes))
        sizes = [s.numel() for s in shapes] * reps
        offs = [0, *itertools.accumulate(sizes)][:-1]
        total = sum(sizes)
        g = torch.Generator().manual_seed(0)
        row, start = torch.randn(total, generator=g), torch.randn(total, generator=g)
        made = []
        for _ in range(2):  # [0] torch's step on views of one flat (before: a snapshot first), [1] the flat moments
            flat = start.clone()
            ps = [nn.Parameter(flat[o:o + k]) for o, k in zip(offs, sizes)]
            for p, o, k in zip(ps, offs, sizes):
                p.grad = row[o:o + k]
            made.append((flat, ps, torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)))
        (f0, ps0, opt0), (f1, ps1, opt1) = made
        fa = FlatAdam(opt1, ps1, offs, f1)
        pids = list(range(len(ps1)))
        snap = StateSnapshot()

        def before():
            snap.clear()
            snap.save(opt0.state, ps0)
            opt0.step()

        def after():
            fa.sync()
            fa.step(pids, [0] * len(pids), row, offs)
            fa.commit()
        for _ in range(3):  # check: the same bits, parameters and moments
            before()
            after()
        assert torch.equal(f0, f1) and all(torch.equal(opt0.state[a]["exp_avg_sq"], opt1.state[b]["exp_avg_sq"])
                                           for a, b in zip(ps0, ps1)), "flat AdamW differs from torch's"
        src, dst, other = torch.randn(total), torch.empty(total), torch.randn(total)
        fns = {"copy": lambda: dst.copy_(src), "add": lambda: torch.add(src, other, out=dst),
               "add_": lambda: dst.add_(other),
               "torch fused AdamW": opt0.step, "cgdp before (copy aside + torch step)": before,
               "cgdp after (flat, out of place)": after}
        fns.update(_deepspeed_adam(start, row))
        t = {k: median(v) for k, v in interleaved(fns, rounds).items()}
        # elements per second at 28 B/elem; copy and add also read the lines they write (counted 8 and 12 B), add_ not
        limit = max(8 / t["copy"], 12 / t["add"], 12 / t["add_"]) * total / 28
        rows = [{"what": "memory limit (28 B/elem)", "melem_s": limit / 1e6, "of_limit": 1.0, "elements": total,
                 "tensors": len(sizes)}]
        for k in [k for k in fns if k not in ("copy", "add", "add_")]:
            rows.append({"what": k, "melem_s": total / t[k] / 1e6, "of_limit": total / t[k] / limit})
        return rows
    finally:
        torch.set_num_threads(threads)


def _deepspeed_adam(start: torch.Tensor, row: torch.Tensor) -> dict:
    """DeepSpeed's CPU Adam (AdamW mode, one OpenMP thread) over one tensor of the same size, if it builds here.
    Checked: close to torch's fused AdamW after one step (its arithmetic differs)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # its own OpenMP runtime, read when its extension loads
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        ps = [nn.Parameter(start.clone()) for _ in range(2)]
        for p in ps:
            p.grad = row.clone()
        ds = DeepSpeedCPUAdam([ps[0]], lr=1e-3, weight_decay=0.01, adamw_mode=True)
        ds.step()
    except Exception as exc:  # not installed, or its op does not build
        print(f"DeepSpeedCPUAdam skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {}
    torch.optim.AdamW([ps[1]], lr=1e-3, weight_decay=0.01, fused=True).step()
    torch.testing.assert_close(ps[0], ps[1], rtol=1e-5, atol=1e-6)
    return {"DeepSpeedCPUAdam (adamw_mode, 1 thread)": ds.step}


def flat_trainer(rounds: int, make=functools.partial(OPTS["adamw"], fused=True), model=mlp4x2048, chunks=2,
                 args: tuple = (*mlp_batch(32), F.cross_entropy)) -> list[dict]:
    """update='host' before (torch's step per chunk, the state copied aside) and after (flat), update='devices'."""
    trainers = {k: cgdp.Trainer(model(), make, ["cpu:0", "cpu:1"], chunks=chunks, update=u)
                for k, u in (("host, after (flat)", "host"), ("host, before", "host"), ("devices", "devices"))}
    trainers["host, before"]._update._flat = None
    try:
        assert trainers["host, after (flat)"]._update._flat is not None, "the flat state does not take this optimizer"
        for _ in range(2):  # check: before and after hold the same bits
            for tr in trainers.values():
                tr.step(*args)
        a, b = (trainers[k].replicas[0].state_dict() for k in ("host, after (flat)", "host, before"))
        assert all(torch.equal(v, b[k]) for k, v in a.items()), "flat update='host' differs from torch's step"
        hu: dict[str, list[float]] = {k: [] for k in trainers}  # the host optimizer's time, each timed step

        def step(k: str) -> None:
            trainers[k].step(*args)
            hu[k].append(trainers[k].stats.get("host_update_s", float("nan")))
        times = interleaved({k: functools.partial(step, k) for k in trainers}, rounds, warmup=2)
        dev = median(times["devices"])
        return [{"case": k, "step_s": median(v), "of_devices": median(v) / dev, "host_update_s": median(hu[k][2:])}
                for k, v in times.items()]
    finally:
        for tr in trainers.values():
            tr.close()


def main_flat(args: argparse.Namespace) -> None:
    info = machine()
    iso = flat_isolated(args.elements, 5 if args.quick else 9)
    steps = flat_trainer(3 if args.quick else 9)
    md = [f"# update='host': AdamW's moments flat, stepped out of place\n\n{machine_md(info)}\n\n"
          f"Command: `{command_line()}`\n",
          f"## 1. One step, one thread, {iso[0]['elements']} float32 elements in {iso[0]['tensors']} tensors (the "
          f"4x2048 MLP's, repeated)\n",
          table(["step", "M elem/s", "of the memory limit", "of torch's fused"],
                [[r["what"], fmt(r["melem_s"], 0), fmt(r["of_limit"], 2), fmt(r["melem_s"] / iso[1]["melem_s"], 2)]
                 for r in iso]),
          "\nThe memory limit: 28 B/elem over the fastest of copy, add and in-place add on one thread in the same "
          "rounds; copy and add also read the lines they write, so it is low, and the in-place kernels pass it.\n",
          "\n## 2. Trainer step, G = 2 emulated devices, 4x2048 MLP, fused AdamW\n",
          table(["case", "step ms", "÷ devices", "host optimizer ms"],
                [[r["case"], fmt(r["step_s"] * 1e3, 1), fmt(r["of_devices"], 2), fmt(r["host_update_s"] * 1e3, 1)]
                 for r in steps]),
          "\nBoth checked before timing: the flat step's parameters and moments bitwise equal to torch's fused "
          "AdamW (1), update='host' before and after bitwise equal after two steps (2).\n"]
    write_results("\n".join(md), {"isolated": iso, "trainer": steps}, info, command_line(), args.md, args.json)


def main_flat_sgd(args: argparse.Namespace) -> None:
    info = machine()
    rounds = 5 if args.quick else 15
    cases = {"GPT-2 structure (width 32), batch 16, default chunks": dict(
                 model=gpt2_structure, chunks="auto", args=(gpt2_batch(16), gpt2_loss)),
             "4x2048 MLP, batch 32, chunks=2": dict(model=mlp4x2048, chunks=2, args=(*mlp_batch(32), F.cross_entropy))}
    rows = {name: flat_trainer(rounds, OPTS["sgd_momentum"], **kw) for name, kw in cases.items()}
    md = [f"# update='host': SGD's momentum flat, stepped out of place\n\n{machine_md(info)}\n\n"
          f"Command: `{command_line()}`\n\nG = 2 emulated devices, `SGD(lr=1e-2, momentum=0.9)` (fused on the host: "
          f"cgdp sets it; torch's default kernel on the devices). 'before': torch's fused step per chunk, the chunk's "
          f"state copied aside first (cgdp's path before the flat momentum); 'after': one out-of-place call per chunk. "
          f"Checked before timing: before and after bitwise equal after two steps.\n"]
    for name, rs in rows.items():
        md += [f"\n## {name}\n",
               table(["case", "step ms", "÷ devices", "host optimizer ms per step"],
                     [[r["case"], fmt(r["step_s"] * 1e3, 1), fmt(r["of_devices"], 2),
                       fmt(r["host_update_s"] * 1e3, 2)] for r in rs])]
    write_results("\n".join(md), rows, info, command_line(), args.md, args.json)


def main_wire(args: argparse.Namespace) -> None:
    info = machine()
    rows = wire_times(3 if args.quick else 7)
    md = [f"# update='host' with grad_transfer='bf16' (emulated devices)\n\n{machine_md(info)}\n\n"
          f"Command: `{command_line()}`\n",
          table(["case", "params", "step ms", "update phase ms", "host update", "bytes back per device"],
                [[r["case"], r["params"], fmt(r["step_s"] * 1e3, 1), fmt(r["exposed_update_s"] * 1e3, 1),
                  ("with backward" if r["overlapped"] else "after backward") if "host" in r["case"] else "-",
                  r["bytes_back"]] for r in rows]),
          "\n'bytes back per device': per step, the parameters (update='host') or the averaged gradient "
          "(update='devices'); with update='host' no gradient comes back. 'update phase ms': what is left "
          "after backward (the copy back, and the device optimizers with update='devices').\n"]
    write_results("\n".join(md), {"wire": rows}, info, command_line(), args.md, args.json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--elements", type=int, default=8 << 20, help="elements for the optimizer bandwidth")
    ap.add_argument("--md")
    ap.add_argument("--json")
    ap.add_argument("--wire", action="store_true", help="only: the bf16 wire with update='host'")
    ap.add_argument("--flat", action="store_true", help="only: the host AdamW before and after its flat moments")
    ap.add_argument("--flat-sgd", action="store_true", help="only: the host SGD before and after its flat momentum")
    args = ap.parse_args()
    if args.wire:
        return main_wire(args)
    if args.flat:
        return main_flat(args)
    if args.flat_sgd:
        return main_flat_sgd(args)
    rounds = 3 if args.quick else 5
    info = machine()
    bw = optimizer_bandwidth(args.elements if not args.quick else 1 << 20, rounds)
    steps = step_times(3 if args.quick else 4, [2] if args.quick else [2, 4])
    best = {}
    for r in bw[1:]:
        name = r["what"].split()[0]
        best[name] = max(best.get(name, 0.0), r["gbps"])
    cost = HostUpdateCost("adamw")
    adamw = min((r for r in bw if r["what"].startswith("adamw")), key=lambda r: r["s"])
    cost.observe(args.elements if not args.quick else 1 << 20, adamw["s"])
    md = [f"# update='host' against update='devices' (emulated devices)\n\n{machine_md(info)}\n\n"
          f"Command: `{command_line()}`\n",
          "## 1. The host optimizer against memcpy (one step over one float32 tensor)\n",
          table(["step", "B/elem", "ms", "GB/s", "of memcpy"],
                [[r["what"], r["bytes_per_elem"], fmt(r["s"] * 1e3, 2), fmt(r["gbps"], 2),
                  fmt(r["gbps"] / bw[0]["gbps"], 2)] for r in bw]),
          f"\nThe cost model's learned rate for AdamW (the faster variant): {cost.gbps:.2f} GB/s.\n",
          "## 2. Step time, update='host' against update='devices'\n",
          table(["model", "G", "optimizer", "params", "devices ms", "host ms", "host/devices",
                 "host optimizer ms", "when", "update phase ms (host)"],
                [[r["model"], r["G"], r["optimizer"], r["params"], fmt(r["devices_s"] * 1e3, 1),
                  fmt(r["host_s"] * 1e3, 1), fmt(r["host_s"] / r["devices_s"], 2), fmt(r["host_update_s"] * 1e3, 1),
                  "with backward" if r["overlapped"] else "after backward", fmt(r["exposed_update_s"] * 1e3, 1)]
                 for r in steps]),
          "\n'update phase ms (host)': what is left after backward with update='host' (the copy of the "
          "masters to every device, and the optimizer itself when it ran after backward).\n"]
    write_results("\n".join(md), {"bandwidth": bw, "steps": steps, "learned_gbps": cost.gbps}, info,
                  command_line(), args.md, args.json)


if __name__ == "__main__":
    main()
