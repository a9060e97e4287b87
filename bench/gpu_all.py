"""Every GPU measurement of the paper's §5, in one call, written under $OUT (default ./out).

    OUT=/tmp/gpu python bench/gpu_all.py              # on a machine with a GPU: everything (~30 min)
    OUT=/tmp/a python bench/gpu_all.py --parts bandwidth,networks --models alexnet,googlenet
    OUT=/tmp/b python bench/gpu_all.py --parts sweep  # ... in calls of < 10 min: bench/results/gpu_README.md
    python bench/gpu_all.py --quick                   # no GPU needed: small models, simulated CUDA
    python bench/gpu_all.py --report A/gpu.json [B/gpu.json ...]   # results page only, merged

On ``cuda:0`` (or, without a GPU, on a simulated ``cuda:0`` (``cgdp.testing.simulated_cuda``: the
CUDA backend's own code over host memory) so that the script is tested; ``--emulate``: ``cpu:0``):

1. Pinned copy bandwidth: D2H alone, H2D alone, both directions at once (the PCIe limits).
2. The paper's four networks at its per-GPU batches (AlexNet 256, GoogLeNet 64, VGG-16 32,
   ResNet-152 12; Table 1): step time in ``single``, ``cgdp`` and ``typical``, each checked first
   (parameters after two steps equal across modes to 1e-5 relative), cgdp's overhead over single,
   the phase breakdown (Table 3), per-layer D2H / accumulate / H2D (Table 4, on ``alexnet_caffe``
   too, whose layers are the paper's), and peak GPU memory of cgdp vs typical (Table 5).
3. The chunk-size sweep for ResNet-152 (Figure 2) and a run of Algorithm 1 (Figure 5).
4. With one GPU, cgdp runs G = 1: the full host round trip (D2H, host accumulate, H2D on real
   streams) with nothing to average. Multi-GPU figures are *simulator predictions*
   (cgdp.planning.calibrate fitted on the G = 1 profiles, cgdp.planning.simulator for G = 2, 4), labelled so.
5. G = 2 and 4 replicas on the one GPU (``share_devices=True``, part ``replicas``): the G > 1 data
   path with real copies and a real host sum, cgdp (float32 and bf16 on the wire) checked against
   typical first; the replicas share the GPU's compute, so these are not multi-GPU step times.

Inputs stay on the device (one upload before timing), as a training loop with a prefetching
loader would have them; phase times come from profiled steps (device events). The first GPU run
starts with ``bench/gpu_checks.py`` (the ordering checks); this script measures.

Writes ``$OUT/gpu.json`` (every figure, with machine, versions and command) and ``$OUT/gpu.md`` (the
results page, the paper's numbers beside ours). ``--report`` rebuilds the page from one or more
json files (runs of different ``--parts``, merged in the order given).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from common import command_line, fmt, machine, machine_md, median, table  # noqa: E402

# ---------------------------------------------------------------------------------- the paper
PAPER = {
    "batch": {"alexnet": 256, "googlenet": 64, "vgg16": 32, "resnet152": 12},
    # Table 2: ms per iteration, 1 / 2 / 4 GPUs
    "table2": {"alexnet": {"BVLC": [157.2, 174.3, 202.7], "TRL": [157.4, 163.6, 167.1]},
               "googlenet": {"BVLC": [140.0, 151.7, 163.4], "TRL": [140.9, 151.9, 156.7]},
               "vgg16": {"BVLC": [345.6, 383.7, 445.6], "TRL": [345.2, 361.5, 369.1]}},
    # Table 3: AlexNet, 4 GPUs, ms
    "table3": {"BVLC (typical)": {"broadcast": 20, "forward": 50.6, "backward": 104, "tail": None,
                                  "grad-acc": 23, "update": 5.1, "total": 202.7},
               "TRL (cgdp)": {"broadcast": None, "forward": 51.0, "backward": 111, "tail": 0.0218,
                              "grad-acc": None, "update": 5.1, "total": 167.1}},
    # Table 4: AlexNet, 4 GPUs, layers 8..1 (backward order), ms
    "table4": {"params_m": [4, 16.8, 37.8, 0.4, 0.7, 0.9, 0.3, 0.03],
               "d2h": [0.760, 3.156, 12.146, 0.133, 0.174, 0.275, 0.066, 0.014],
               "acc": [1.263, 4.441, 13.074, 0.285, 0.465, 0.578, 0.155, 0.018],
               "h2d": [1.786, 2.568, 5.538, 0.064, 0.095, 0.123, 0.041, 0.007]},
    # Table 5: MB per GPU
    "table5": {"alexnet": {"BVLC": 6863, "TRL": 6359}, "googlenet": {"BVLC": 6095, "TRL": 5991},
               "vgg16": {"BVLC": 7274, "TRL": 6191}},
    "figure5": "ResNet-152, 12 per GPU, 4 GPUs: best chunks 3, 6, 9 (step 10, range 5) and 20 "
               "(range 10); the search stops within ~150 iterations; cgdp with chunks about 1.07x "
               "faster than typical; chunk size 1 slower than typical",
}

FULL_MODELS = ["alexnet", "googlenet", "vgg16", "resnet152"]
QUICK_MODELS = {"mlp": 16, "digits_cnn": 16}
"""--quick stand-ins (name → batch): small registry models, so the script runs anywhere in seconds."""


# ---------------------------------------------------------------------------------- devices
class Dev:
    """The device under test: ``cuda:0`` (real or simulated) or the CPU-emulated ``cpu:0``."""

    def __init__(self, emulate: bool, simulate: bool = False):
        self.cuda = torch.cuda.is_available() and not emulate and not simulate
        self.simulate = simulate and not emulate
        self.sim = None
        self.name = "cuda:0" if self.cuda or self.simulate else "cpu:0"
        self.torch = torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def runtime(self):
        """Where the trainers run: the simulated runtime (``self.sim`` inside), or nothing to change."""
        import contextlib
        if not self.simulate:
            return contextlib.nullcontext()
        from cgdp.testing import simulated_cuda

        @contextlib.contextmanager
        def sim():
            with simulated_cuda(1, max_delay_s=0.0002) as self.sim:
                yield
        return sim()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # note: host waits for the GPU (end of a timed region)
        elif self.sim is not None:
            self.sim.cuda.synchronize(0)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_mib(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**20 if self.cuda else math.nan


# ---------------------------------------------------------------------------------- 1. bandwidth
def bandwidth(dev: Dev, mib: int, reps: int) -> dict:
    n = mib * 2**20 // 4
    if dev.cuda:
        h_src = torch.empty(n, pin_memory=True).uniform_()
        h_dst = torch.empty(n, pin_memory=True)
        d_src = torch.empty(n, device=dev.torch).uniform_()
        d_dst = torch.empty(n, device=dev.torch)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def timed(copies: list) -> float:
            """Seconds from a common start event to the last copy's end event."""
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            ends = []
            for stream, dst, src in copies:
                stream.wait_event(start)
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(stream)
                    ends.append(end)
            torch.cuda.synchronize()  # note: host waits for the copies
            return max(start.elapsed_time(e) for e in ends) / 1e3
        d2h = [(s1, h_dst, d_src)]
        h2d = [(s2, d_dst, h_src)]
        for fn in (d2h, h2d, d2h + h2d):
            timed(fn)
        t = {"D2H": [timed(d2h) for _ in range(reps)], "H2D": [timed(h2d) for _ in range(reps)],
             "both": [timed(d2h + h2d) for _ in range(reps)]}
        assert torch.equal(h_dst, d_src.cpu()) and torch.equal(d_dst.cpu(), h_src)
        how = "pinned host memory, CUDA events, separate streams"
    else:
        src1, dst1 = torch.rand(n), torch.empty(n)
        src2, dst2 = torch.rand(n), torch.empty(n)

        def both() -> None:
            th = threading.Thread(target=dst2.copy_, args=(src2,))
            th.start()
            dst1.copy_(src1)
            th.join()

        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        one = lambda: dst1.copy_(src1)  # noqa: E731
        for fn in (one, both):
            fn()
        t = {"D2H": [timed(one) for _ in range(reps)], "H2D": [timed(one) for _ in range(reps)],
             "both": [timed(both) for _ in range(reps)]}
        assert torch.equal(dst1, src1) and torch.equal(dst2, src2)
        how = "emulated: host memcpy (Tensor.copy_), the two directions on two threads"
    nbytes = n * 4
    return {"mib": mib, "how": how,
            "gbps": {"D2H": nbytes / median(t["D2H"]) / 1e9, "H2D": nbytes / median(t["H2D"]) / 1e9,
                     "both (each direction)": nbytes / median(t["both"]) / 1e9,
                     "both (sum)": 2 * nbytes / median(t["both"]) / 1e9}}


# ---------------------------------------------------------------------------------- 2. networks
def build(name: str) -> tuple[nn.Module, tuple[int, ...], int]:
    from cgdp.models import build_model, get_spec
    spec = get_spec(name)
    torch.manual_seed(0)
    return build_model(name), spec.input_shape, spec.num_classes


def batch_for(name: str, n: int, shape: tuple[int, ...], classes: int, device: torch.device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x.to(device), y.to(device)


def make_trainer(model: nn.Module, dev: Dev, mode: str, chunks=1, replicas: int = 1):
    """``mode`` "cgdp_bf16": cgdp with ``grad_transfer="bf16"``."""
    import cgdp
    bf16 = mode == "cgdp_bf16"
    return cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9), [dev.name] * replicas,
                        mode="cgdp" if bf16 else mode, chunks=chunks, share_devices=replicas > 1,
                        grad_transfer="bf16" if bf16 else None)


def timed_steps(tr, dev: Dev, x, y, loss_fn, n: int, profiled: bool = False) -> tuple[list[float], list[dict]]:
    """``n`` steps, each between two synchronisations; ``profiled``: phase times from device events."""
    times, stats = [], []
    for _ in range(n):
        if profiled:
            tr.profile_next()
        dev.sync()
        t0 = time.perf_counter()
        tr.step(x, y, loss_fn)
        dev.sync()
        times.append(time.perf_counter() - t0)
        stats.append(dict(tr.stats))
    return times, stats


def check_modes(name: str, dev: Dev, batch: int, steps: int = 2, replicas: int = 1,
                modes: tuple[str, ...] = ("single", "cgdp", "typical")) -> dict[str, float]:
    """Parameters after ``steps`` steps: each of ``modes[1:]`` (on ``replicas`` replicas) against
    ``modes[0]`` (same init, data, seed)."""
    model, shape, classes = build(name)
    x, y = batch_for(name, batch * replicas, shape, classes, dev.torch)
    loss_fn = nn.CrossEntropyLoss()
    out = {}
    det = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True  # the check compares runs bit for bit where it can
    try:
        for mode in modes:
            torch.manual_seed(2)  # dropout draws the same masks in every mode
            tr = make_trainer(copy.deepcopy(model), dev, mode,  # each mode from the same start
                              replicas=1 if mode == "single" else replicas)
            try:
                for _ in range(steps):
                    tr.step(x, y, loss_fn)
                out[mode] = [p.detach().cpu().clone() for p in tr.replicas[0].parameters()]
            finally:
                tr.close()
    finally:
        torch.backends.cudnn.deterministic = det
    ref = out.pop(modes[0])
    den = max(float(p.abs().max()) for p in ref)
    return {m: max(float((a - b).abs().max()) for a, b in zip(ps, ref)) / den for m, ps in out.items()}


def network(name: str, batch: int, dev: Dev, steps: int, warmup: int) -> dict:
    errs = check_modes(name, dev, batch)
    bad = {m: e for m, e in errs.items() if not e <= 1e-5}
    res: dict = {"model": name, "batch": batch, "check_rel_err": errs}
    if bad:
        res["error"] = f"answer check failed {bad}; not timed"
        return res
    loss_fn = nn.CrossEntropyLoss()
    modes: dict = {}
    profiles = []
    for mode in ("single", "cgdp", "typical"):
        model, shape, classes = build(name)
        x, y = batch_for(name, batch, shape, classes, dev.torch)  # uploaded once, as a loader would
        dev.reset_peak()
        tr = make_trainer(model, dev, mode)
        try:
            timed_steps(tr, dev, x, y, loss_fn, warmup)
            times, _ = timed_steps(tr, dev, x, y, loss_fn, steps)
            _, stats = timed_steps(tr, dev, x, y, loss_fn, max(3, steps // 4), profiled=True)
            entry = {"step_ms": 1e3 * median(times), "peak_mib": dev.peak_mib(),
                     "phases_ms": {k: 1e3 * median([s[k] for s in stats]) for k in
                                   ("forward_s", "backward_s", "exposed_comm_s", "update_s", "step_s")}}
            if mode == "cgdp":  # Table 4: one profiled step, one layer per chunk
                tr.profile_next()
                tr.step(x, y, loss_fn)
                p = tr.last_profile
                profiles.append(p)
                entry["per_layer"] = [
                    {"chunk": c.index, "layers": c.layers,
                     "names": [tr.layer_names[i] for i in c.layers],
                     "params_m": c.bytes / 4 / 1e6, "d2h_ms": 1e3 * c.d2h_s, "acc_ms": 1e3 * c.acc_s,
                     "h2d_ms": 1e3 * c.h2d_s} for c in p.chunks]
                # a second profile under a coarser plan, so the simulator can separate sync from compute
                tr.set_plan(max(2, len(tr.layers) // 8))
                timed_steps(tr, dev, x, y, loss_fn, 1)
                tr.profile_next()
                tr.step(x, y, loss_fn)
                profiles.append(tr.last_profile)
            modes[mode] = entry
        finally:
            tr.close()
            del tr, model
    res["modes"] = modes
    res["cgdp_over_single"] = modes["cgdp"]["step_ms"] / modes["single"]["step_ms"]
    res["cgdp_over_typical"] = modes["cgdp"]["step_ms"] / modes["typical"]["step_ms"]
    res["predicted"] = predict(profiles)
    return res


def predict(profiles) -> dict:
    """Simulator predictions for G = 2, 4 from the G = 1 profiles (labelled as predictions)."""
    try:
        from cgdp.planning.calibrate import calibrate
        from cgdp.planning.costs import Linear
        from cgdp.planning.simulator import simulate
        cal = calibrate(profiles)
        plan = profiles[0].plan
        out = {}
        for g in (1, 2, 4):
            acc = cal.costs.acc
            # the host reads G parts and writes one: (G + 1) / 2 times the G = 1 bytes per element
            costs = dataclasses.replace(cal.costs, devices=g,
                                        acc=Linear(acc.latency_s, acc.per_byte_s * (g + 1) / 2))
            out[str(g)] = {m: 1e3 * simulate(cal.model, costs, plan, m).step_s for m in ("cgdp", "typical")}
        return out
    except Exception as exc:  # predictions are extra; a failure is recorded, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


REPLICA_MODES = ("typical", "cgdp", "cgdp_bf16")
"""The reference first: with G replicas, dropout masks are drawn per replica and BatchNorm normalises
per replica, so single-device training on the global batch is not the reference; ``typical`` (sum
on the device, then broadcast) is, and ``cgdp`` must equal it to 1e-5 after two steps (bf16 on the
wire: 1e-3 after one)."""


def replicas_on_one(name: str, batch: int, dev: Dev, gs: list[int], steps: int, warmup: int) -> dict:
    """G replicas on the one device (``share_devices``): cgdp (float32 and bf16 on the wire) checked
    against typical on the same global batch, then all three timed at ``batch`` per replica."""
    out: dict = {"model": name, "batch_per_replica": batch, "runs": {}}
    loss_fn = nn.CrossEntropyLoss()
    for g in gs:
        errs = check_modes(name, dev, batch, replicas=g, modes=("typical", "cgdp"))
        # bf16 after one step: a second step carries the first one's rounding through the model, which
        # at ResNet-152's first steps is chaotic (an H200 run: 5e-4 after one step, 0.12 after two;
        # bench/gpu_bf16_bound.py shows the first within the wire's bound)
        errs.update(check_modes(name, dev, batch, steps=1, replicas=g, modes=("typical", "cgdp_bf16")))
        run: dict = {"check_rel_err": errs}
        out["runs"][str(g)] = run
        if not (errs["cgdp"] <= 1e-5 and errs["cgdp_bf16"] <= 1e-3):
            run["error"] = f"answer check failed {errs}; not timed"
            continue
        for mode in REPLICA_MODES:
            model, shape, classes = build(name)
            x, y = batch_for(name, batch * g, shape, classes, dev.torch)
            tr = make_trainer(model, dev, mode, replicas=g)
            try:
                timed_steps(tr, dev, x, y, loss_fn, warmup)
                times, _ = timed_steps(tr, dev, x, y, loss_fn, steps)
                run[f"{mode}_ms"] = 1e3 * median(times)
            finally:
                tr.close()
    return out


# ---------------------------------------------------------------------------------- 3. chunks
def chunk_sweep(name: str, batch: int, dev: Dev, sizes: list[int], iters: int) -> dict:
    model, shape, classes = build(name)
    x, y = batch_for(name, batch, shape, classes, dev.torch)
    loss_fn = nn.CrossEntropyLoss()
    tr = make_trainer(model, dev, "cgdp")
    out = {"model": name, "batch": batch, "layers": len(tr.layers), "iters": iters, "sizes": {}}
    try:
        timed_steps(tr, dev, x, y, loss_fn, 2)
        for k in sizes:
            if k > len(tr.layers):
                continue
            tr.set_plan(k)
            timed_steps(tr, dev, x, y, loss_fn, 1)
            times, _ = timed_steps(tr, dev, x, y, loss_fn, iters)
            out["sizes"][str(k)] = {"total_ms": 1e3 * sum(times), "median_ms": 1e3 * median(times),
                                    "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)}
    finally:
        tr.close()
    return out


def algorithm1(name: str, batch: int, dev: Dev, configs: list[tuple[int, int]], interval: int,
               max_iters: int) -> list[dict]:
    """Algorithm 1 driven step by step: chunk from the search, one timed iteration, observe."""
    import cgdp
    runs = []
    for step, rng in configs:
        model, shape, classes = build(name)
        x, y = batch_for(name, batch, shape, classes, dev.torch)
        loss_fn = nn.CrossEntropyLoss()
        tr = make_trainer(model, dev, "cgdp")
        search = cgdp.PaperChunkSearch(step, rng, interval)
        its = []
        try:
            timed_steps(tr, dev, x, y, loss_fn, 2)
            for it in range(max_iters):
                k = min(search.chunk, len(tr.layers))
                if [list(c) for c in tr.plan] != cgdp.paper_plan(len(tr.layers), k):
                    tr.set_plan(k)
                times, _ = timed_steps(tr, dev, x, y, loss_fn, 1)
                its.append({"iter": it + 1, "chunk": k, "ms": 1e3 * times[0]})
                search.observe(times[0])
                if search.done and it + 1 >= (search.stop_iteration or 0) + interval:
                    break
        finally:
            tr.close()
        runs.append({"step": step, "range": rng, "interval": interval, "best_chunk": search.best_chunk,
                     "stop_iteration": search.stop_iteration, "done": search.done, "iterations": its})
    return runs


# ---------------------------------------------------------------------------------- the page
def page(res: dict) -> str:
    lines = ["# cgdp on a GPU: the paper's §5 measurements", "",
             f"Command: `{res['command']}`", "", "Machine:", machine_md(res["machine"]), "",
             f"Device under test: `{res['device']}`."]
    if not res["cuda"]:
        how = ("on a simulated CUDA runtime (cgdp.testing: the CUDA backend's code over host memory)"
               if res.get("simulated") else "CPU-emulated")
        lines += ["", f"**No GPU was used: this run is {how} (it tests the script; its figures are "
                  "not GPU figures).**"]
    lines += ["", "With one GPU, cgdp runs on G = 1 (the whole host round trip on real streams, nothing "
              "to average). Figures for 2 and 4 devices are **simulator predictions** (cgdp.planning.calibrate "
              "on this run's profiles → cgdp.planning.simulator), never measurements.", ""]
    bw = res.get("bandwidth")
    if bw:
        lines += ["## Copy bandwidth (the PCIe limits)", "", f"{bw['mib']} MiB, {bw['how']}.", "",
                  table(["direction", "GB/s"], [[k, fmt(v, 2)] for k, v in bw["gbps"].items()]), ""]
    nets = [n for n in res.get("networks", [])]
    if nets:
        rows = []
        for n in nets:
            if "error" in n:
                rows.append([n["model"], n["batch"], n["error"], "", "", "", "", "", "", ""])
                continue
            m = n["modes"]
            p2 = PAPER["table2"].get(n["model"])
            paper = (f"BVLC {p2['BVLC'][0]} / TRL {p2['TRL'][0]} (1 GPU); TRL {p2['TRL'][2]} vs "
                     f"BVLC {p2['BVLC'][2]} (4 GPUs)") if p2 else \
                ("Figure 5: cgdp ~1.07x faster than typical (4 GPUs)" if n["model"] == "resnet152" else "")
            pred = n.get("predicted", {})
            pr = " / ".join(f"G={g}: cgdp {fmt(v['cgdp'])} typ {fmt(v['typical'])}"
                            for g, v in pred.items() if g != "1" and isinstance(v, dict)) or \
                pred.get("error", "")
            rows.append([n["model"], n["batch"], fmt(m["single"]["step_ms"]), fmt(m["cgdp"]["step_ms"]),
                         fmt(m["typical"]["step_ms"]), fmt(n["cgdp_over_single"], 3),
                         fmt(n["cgdp_over_typical"], 3), " / ".join(f"{k} {v:.0e}" for k, v in
                                                                     n["check_rel_err"].items()),
                         pr, paper])
        lines += ["## Step time (Table 2) — measured at G = 1", "",
                  table(["network", "batch", "single ms", "cgdp ms", "typical ms", "cgdp / single",
                         "cgdp / typical", "check (rel. err. vs single)",
                         "PREDICTED ms (simulator)", "paper, ms"], rows), ""]
        rows = []
        for n in nets:
            for mode in ("cgdp", "typical"):
                if "modes" not in n:
                    continue
                ph = n["modes"][mode]["phases_ms"]
                rows.append([n["model"], mode, fmt(ph["forward_s"]), fmt(ph["backward_s"]),
                             fmt(ph["exposed_comm_s"], 3), fmt(ph["update_s"]), fmt(ph["step_s"])])
        t3 = PAPER["table3"]
        for k, v in t3.items():
            rows.append(["paper AlexNet 4 GPUs", k, v["forward"], v["backward"],
                         v["tail"] if v["tail"] is not None else f"{v['grad-acc']} (grad-acc) + "
                         f"{v['broadcast']} (broadcast)", v["update"], v["total"]])
        lines += ["## Phases (Table 3), ms", "", table(["network", "mode", "forward", "backward",
                                                         "exposed comm after backward", "update", "step"],
                                                        rows), ""]
        rows = []
        for n in nets:
            if "modes" not in n:
                continue
            t5 = PAPER["table5"].get(n["model"])
            rows.append([n["model"], fmt(n["modes"]["cgdp"]["peak_mib"], 0),
                         fmt(n["modes"]["typical"]["peak_mib"], 0),
                         fmt(n["modes"]["single"]["peak_mib"], 0),
                         f"TRL {t5['TRL']} / BVLC {t5['BVLC']}" if t5 else ""])
        lines += ["## Peak GPU memory (Table 5), MiB", "",
                  "At G = 1 typical keeps no gather buffer for other devices, so the Table 5 gap "
                  "(BVLC's per-GPU gradient buffers) cannot show; the figures show what each mode "
                  "allocates on the device.", "",
                  table(["network", "cgdp", "typical", "single", "paper (4 GPUs)"], rows), ""]
        for n in nets:
            if "modes" not in n:
                continue
            rows = [[c["chunk"], ",".join(c["names"]), fmt(c["params_m"], 3), fmt(c["d2h_ms"], 3),
                     fmt(c["acc_ms"], 3), fmt(c["h2d_ms"], 3)] for c in n["modes"]["cgdp"]["per_layer"]]
            lines += [f"## Per layer, backward order (Table 4): {n['model']}", "",
                      table(["chunk", "layer", "params (M)", "D2H ms", "accumulate ms", "H2D ms"], rows), ""]
        t4 = PAPER["table4"]
        lines += ["Paper, AlexNet on 4 GPUs, layers 8 → 1:", "",
                  table(["", *[f"layer {8 - i}" for i in range(8)]],
                        [["params (M)", *t4["params_m"]], ["D2H ms", *t4["d2h"]],
                         ["accumulate ms", *t4["acc"]], ["H2D ms", *t4["h2d"]]]), ""]
    reps = res.get("replicas", [])
    if reps:
        rows = []
        for r in reps:
            for g, run in r["runs"].items():
                rows.append([r["model"], g, r["batch_per_replica"], fmt(run.get("cgdp_ms")),
                             fmt(run.get("cgdp_bf16_ms")), fmt(run.get("typical_ms")),
                             run.get("error", "") or " / ".join(
                                 f"{k} {v:.0e}" for k, v in run["check_rel_err"].items())])
        lines += ["## G replicas on one GPU (measured)", "",
                  "The G > 1 data path on the one GPU (`share_devices=True`): real copies each way per "
                  "replica and a real host sum of G parts; the replicas share the GPU's compute, so this "
                  "shows the cost of the path, not multi-GPU scaling.", "",
                  table(["network", "G", "batch per replica", "cgdp ms", "cgdp bf16 wire ms", "typical ms",
                         "check (rel. err. vs typical)"], rows), ""]
    sw = res.get("chunk_sweep")
    if sw:
        rows = [[k, fmt(v["total_ms"]), fmt(v["median_ms"]), fmt(v["min_ms"]), fmt(v["max_ms"])]
                for k, v in sw["sizes"].items()]
        ref = {n["model"]: n for n in nets if "modes" in n}.get(sw["model"])
        if ref:
            for mode in ("single", "typical"):
                ms = ref["modes"][mode]["step_ms"]
                rows.append([mode, fmt(ms * sw["iters"]), fmt(ms), "", ""])
        lines += [f"## Chunk-size sweep (Figure 2): {sw['model']}, batch {sw['batch']}, {sw['layers']} layers, "
                  f"{sw['iters']} iterations per size", "",
                  table(["chunk size", f"{sw['iters']} iterations ms", "median ms", "min ms", "max ms"], rows),
                  "", "Paper (Figure 2, 4 GPUs, batch 16): chunk 1 slower than typical; 2-8 improve; "
                  "large chunks worse again.", ""]
    for run in res.get("algorithm1", []):
        its = run["iterations"]
        by = {}
        for it in its:
            by.setdefault(it["chunk"], []).append(it["ms"])
        rows = [[k, len(v), fmt(sum(v))] for k, v in by.items()]
        lines += [f"## Algorithm 1 (Figure 5): step {run['step']}, range {run['range']}, interval "
                  f"{run['interval']}", "",
                  f"best chunk {run['best_chunk']}, stopped at iteration {run['stop_iteration']} "
                  f"({'done' if run['done'] else 'not finished within the iteration cap'}).", "",
                  table(["chunk", "iterations", "total ms"], rows), ""]
    if res.get("algorithm1"):
        lines += [f"Paper: {PAPER['figure5']}.", ""]
    if res.get("errors"):
        lines += ["## Errors", "", *[f"- {e}" for e in res["errors"]], ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main
PARTS = ("bandwidth", "networks", "replicas", "sweep", "alg1")


def merge(runs: list[dict]) -> dict:
    """One result from runs of different ``--parts`` (later runs win where both measured a part)."""
    if len({(r["device"], r["cuda"]) for r in runs}) > 1:
        raise SystemExit("--report: these runs used different devices; merge runs of one machine only")
    out = dict(runs[0], networks=[], replicas=[], errors=[])
    out["command"] = " ; ".join(r["command"] for r in runs)
    for r in runs:
        for key in ("bandwidth", "chunk_sweep", "algorithm1"):
            if r.get(key):
                out[key] = r[key]
        out["networks"] += r.get("networks", [])
        out["replicas"] += r.get("replicas", [])
        out["errors"] += r.get("errors", [])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small stand-in models, few iterations (runs on a simulated cuda:0 anywhere)")
    ap.add_argument("--emulate", action="store_true", help="use cpu:0 even when a GPU is there")
    ap.add_argument("--simulate", action="store_true",
                    help="use a simulated cuda:0 (cgdp.testing) even when a GPU is there")
    ap.add_argument("--replicas", default="2,4", help="G for the part 'replicas' (G replicas on cuda:0)")
    ap.add_argument("--models", default=None,
                    help="comma-separated registry names (default: the paper's four; with --quick, its stand-ins)")
    ap.add_argument("--batch", type=int, default=None, help="override every per-device batch")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sweep-model", default="resnet152")
    ap.add_argument("--sweep", default="1,2,4,6,8,10,15,20,30,50,100")
    ap.add_argument("--sweep-iters", type=int, default=10)
    ap.add_argument("--alg1", default="10:5,10:10,5:5", help="step:range pairs for Algorithm 1")
    ap.add_argument("--alg1-interval", type=int, default=10)
    ap.add_argument("--alg1-max-iters", type=int, default=250)
    ap.add_argument("--bw-mib", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder (default $OUT or ./out)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"which parts to run, comma-separated from {','.join(PARTS)} (default: all)")
    ap.add_argument("--report", metavar="JSON", nargs="+",
                    help="only write the results page from finished runs (merged in the order given)")
    args = ap.parse_args(argv)
    if args.report:
        runs = []
        for path in args.report:
            with open(path) as f:
                runs.append(json.load(f))
        sys.stdout.write(page(merge(runs)))
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        ap.error(f"--parts: unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    if args.quick:
        models = ({n: QUICK_MODELS.get(n, 16) for n in args.models.split(",")} if args.models
                  else dict(QUICK_MODELS))
        args.steps, args.warmup, args.sweep_model, args.sweep, args.sweep_iters = 3, 1, "mlp", "1,2,3", 2
        args.alg1, args.alg1_interval, args.alg1_max_iters, args.bw_mib = "2:1", 2, 12, 8
        args.simulate = not args.emulate
    else:
        names = args.models.split(",") if args.models else FULL_MODELS
        models = {n: PAPER["batch"].get(n, 16) for n in names}
    if args.batch:
        models = {k: args.batch for k in models}
    os.makedirs(args.out, exist_ok=True)
    dev = Dev(args.emulate, args.simulate)
    if not dev.cuda:
        torch.set_num_threads(max(1, torch.get_num_threads()))
    res: dict = {"command": command_line(), "machine": machine(), "device": dev.name, "cuda": dev.cuda,
                 "simulated": dev.simulate, "networks": [], "replicas": [], "errors": []}
    with dev.runtime():
        run_parts(args, parts, models, dev, res)
    print(f"[gpu_all] wrote {os.path.join(args.out, 'gpu.json')} and gpu.md"
          + (f"; {len(res['errors'])} part(s) failed" if res["errors"] else ""))
    return 1 if res["errors"] else 0


def run_parts(args, parts: list[str], models: dict[str, int], dev: Dev, res: dict) -> None:

    def save() -> None:  # after every part: a run cut short still leaves what it measured
        with open(os.path.join(args.out, "gpu.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(args.out, "gpu.md"), "w") as f:
            f.write(page(res))

    def part(what: str, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
            print(f"[gpu_all] {what}: done in {time.perf_counter() - t0:.1f} s", flush=True)
            return out
        except Exception as exc:
            res["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            return None
        finally:
            save()

    if "bandwidth" in parts:
        res["bandwidth"] = part("bandwidth", lambda: bandwidth(dev, args.bw_mib, 5 if args.quick else 20))
    if "networks" in parts:
        for name, batch in models.items():
            r = part(f"network {name}", lambda: network(name, batch, dev, args.steps, args.warmup))
            if r is not None:
                res["networks"].append(r)
    if "replicas" in parts:
        gs = [int(g) for g in args.replicas.split(",") if g.strip()]
        for name, batch in models.items():
            r = part(f"{name} with G = {gs} replicas on {dev.name}",
                     lambda: replicas_on_one(name, batch, dev, gs, args.steps, args.warmup))
            if r is not None:
                res["replicas"].append(r)
    sweep_batch = models.get(args.sweep_model, args.batch or PAPER["batch"].get(args.sweep_model, 16))
    if "sweep" in parts:
        sizes = [int(s) for s in args.sweep.split(",")]
        res["chunk_sweep"] = part("chunk sweep", lambda: chunk_sweep(args.sweep_model, sweep_batch, dev, sizes,
                                                                     args.sweep_iters))
    if "alg1" in parts:
        configs = [tuple(int(v) for v in c.split(":")) for c in args.alg1.split(",")]
        res["algorithm1"] = part("algorithm 1", lambda: algorithm1(args.sweep_model, sweep_batch, dev, configs,
                                                                   args.alg1_interval, args.alg1_max_iters)) or []
    save()


if __name__ == "__main__":
    sys.exit(main())
