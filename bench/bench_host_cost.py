"""cgdp's own host cost per step: what one process pays per device, hook, chunk and segment.

    python bench/bench_host_cost.py                    # every section, ~4 min on 2 cores
    python bench/bench_host_cost.py --quick            # small G and few rounds (smoke test)
    python bench/bench_host_cost.py --engine /tmp/old  # the same measurements of another cgdp tree

cgdp drives every replica from one Python process, so whatever it adds per parameter, chunk and
segment is serialised across all devices. Measured here on a machine without GPUs:

* **On null CUDA devices** (:func:`cgdp.testing.null_cuda`: the CUDA backend's own code, every
  CUDA call a no-op, replicas computing on CPU kernels at tiny widths): cgdp's **added CPU per
  device per step** = (process CPU of a cgdp step − process CPU of the same replicas' forward,
  loss, backward and optimizer step run one after another without cgdp) / G, next to **the
  model's own CPU** (one replica's forward, backward and optimizer step: at these widths, its
  dispatch), for G = 1, 2, 4, 8 on the layer structures of GPT-2 small (148 parameter tensors),
  ResNet-50 (161) and the 4x2048 MLP of ``bench_engine.py``. Where it goes: the CPU of every
  thread of the process, by role (device threads, completion threads, host sum thread, the
  caller). Runtime calls per step: what a GPU would be asked, from the null runtime's counts.
* **Per hook, per chunk, per segment** (null CUDA): differences between runs that change one
  count only: a chain of P single-parameter layers sent as one chunk, P = 16 and 96 (per hook);
  the 96-layer chain as 96 chunks against one (per chunk, all of its costs, by thread); one
  4 MiB layer in 64 segments against one (per segment).
* **On emulated devices** (``"cpu:N"``, default settings): the same added CPU for the 96-tensor MLP
  (48 x Linear(32), one sample per replica) at G = 2 and 4, as a multiple of one replica's own
  step; voluntary context switches per step and the share of the step's CPU spent in the kernel;
  the CPU of threads Python did not start (an OpenMP pool thread spinning shows there) and the
  caller's torch intra-op count before and after (the bench sets 1: a change is a warning). The
  machine's description is gathered last: it starts Numba's threading layer, which the first
  trainer must start itself, as in a user's process.

CPU figures are process CPU time (``time.process_time``: every thread), which moves much less
than wall time when other jobs share the machine; every figure is the median over interleaved
rounds (cgdp and its baseline alternate), after warm-up. ``--engine DIR`` imports cgdp from DIR
(an older checkout), so that before and after are measured by the same script on the same
machine; the null runtime is then loaded from this tree if DIR has none.

Nothing here checks gradients (a null runtime moves nothing): the equivalence tests do that under
``cgdp.testing.simulated_cuda``. What is checked first: every configuration trains (finite loss)
and sends what its plan says (the null runtime's copy count per step).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import sys
import threading
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _engine_path(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a == "--engine" and i + 1 < len(argv):
            return os.path.abspath(argv[i + 1])
        if a.startswith("--engine="):
            return os.path.abspath(a.split("=", 1)[1])
    return ROOT


ENGINE = _engine_path(sys.argv[1:])
sys.path.insert(0, HERE)
sys.path.insert(0, ENGINE)

import torch  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cgdp  # noqa: E402
from common import command_line, fmt, machine, machine_md, median, table, write_results  # noqa: E402

try:
    from cgdp.testing import inside  # noqa: E402
except ImportError:  # an older engine (--before), from before the documented look inside
    def inside(engine):  # type: ignore[no-redef]
        from types import SimpleNamespace
        return SimpleNamespace(stream=engine._stream)


def null_runtime():
    """``cgdp.testing.null_cuda`` of the engine under test, or this tree's on an older engine."""
    try:
        from cgdp.testing.null_cuda import null_cuda
        return null_cuda
    except ImportError:
        spec = importlib.util.spec_from_file_location("cgdp_null_cuda", os.path.join(ROOT, "cgdp", "testing", "null_cuda.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.null_cuda


# ---------------------------------------------------------------------------------- the models
def gpt2_small_structure() -> nn.Module:
    """GPT-2 small's layer structure (12 blocks, tied embedding: 148 parameter tensors) at width 32."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=12, n_head=2, bos_token_id=0, eos_token_id=0))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50Structure(nn.Module):
    """ResNet-50's layer structure (bottlenecks 3-4-6-3, 161 parameter tensors) at base width 4."""

    def __init__(self, base: int = 4, classes: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(3, 2 * base, 7, 2, 3, bias=False), nn.BatchNorm2d(2 * base)
        blocks, cin = [], 2 * base
        for i, n in enumerate((3, 4, 6, 3)):
            width = base * 2 ** i
            for b in range(n):
                blocks.append(Bottleneck(cin, width, 2 if (b == 0 and i > 0) else 1))
                cin = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        return self.fc(self.blocks(x).mean((2, 3)))


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


class Chain(nn.Module):
    """P layers of one parameter each (Linear(4, 4) without bias), applied one after another."""

    def __init__(self, p: int, width: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(p))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Case:
    """A model, its per-replica batch, its loss and its optimizer."""

    def __init__(self, name: str, build: Callable[[], nn.Module], batch: Callable[[int], Any],
                 loss: Callable[[nn.Module, Any], torch.Tensor], opt: Callable[[Any], torch.optim.Optimizer]):
        self.name, self.build, self.batch, self.loss, self.opt = name, build, batch, loss, opt


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mse(width: int):
    return lambda n: (torch.randn(n, width, generator=_gen()), torch.randn(n, width, generator=_gen(2)))


CASES = {
    "gpt2": Case("GPT-2 small structure (148 tensors, width 32, 1 x 16 tokens)", gpt2_small_structure,
                 lambda n: torch.randint(0, 64, (n, 16), generator=_gen()),
                 lambda m, ids: m(input_ids=ids, labels=ids).loss,
                 lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True)),
    "resnet50": Case("ResNet-50 structure (161 tensors, width 4, 1 x 3x64x64)", ResNet50Structure,
                     lambda n: (torch.randn(n, 3, 64, 64, generator=_gen()), torch.randint(0, 10, (n,), generator=_gen())),
                     lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                     lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=True)),
    "mlp4x2048": Case("MLP 4x2048 (8 tensors, 16.8 M parameters, 16 samples)", lambda: mlp(2048, 4),
                      lambda n: _mse(2048)(16 * n), lambda m, b: F.mse_loss(m(b[0]), b[1]),
                      lambda p: torch.optim.SGD(p, lr=1e-3)),
    "mlp48x32": Case("MLP 48 x Linear(32) (96 tensors, 1 sample)", lambda: mlp(32, 48), _mse(32),
                     lambda m, b: F.mse_loss(m(b[0]), b[1]), lambda p: torch.optim.SGD(p, lr=1e-3)),
}


def chain_case(p: int) -> Case:
    return Case(f"chain of {p} x Linear(4, 4)", lambda: Chain(p), _mse(4),
                lambda m, b: F.mse_loss(m(b[0]), b[1]), lambda p_: torch.optim.SGD(p_, lr=1e-3))


def wide_case() -> Case:
    return Case("one 1024 x 1024 layer (4 MiB)", lambda: nn.Linear(1024, 1024, bias=False), _mse(1024),
                lambda m, b: F.mse_loss(m(b[0]), b[1]), lambda p: torch.optim.SGD(p, lr=1e-3))


# ---------------------------------------------------------------------------------- measuring
ROLES = (("device", "cgdp-cuda:", "cgdp-cpu:"), ("completion", "-done"), ("host", "cgdp-host"),
         ("stream workers", "-d2h", "-h2d"), ("caller", "MainThread"))


def _role(name: str) -> str:
    for role, *keys in ROLES[1:]:
        if any(k in name for k in keys):
            return role
    return "device" if name.startswith(ROLES[0][1:]) else "other"


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of every live thread of this process, summed by role."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            s = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError, AttributeError):
            continue
        r = _role(t.name)
        out[r] = out.get(r, 0.0) + s
    return out


class Run:
    """CPU time, context switches and per-role thread CPU of ``steps`` calls of ``fn``."""

    def __init__(self, fn: Callable[[], Any], steps: int):
        by0, ru0 = thread_cpu(), resource.getrusage(resource.RUSAGE_SELF)
        c0 = time.process_time()
        for _ in range(steps):
            fn()
        self.cpu = (time.process_time() - c0) / steps
        ru1, by1 = resource.getrusage(resource.RUSAGE_SELF), thread_cpu()
        self.sys = (ru1.ru_stime - ru0.ru_stime) / steps
        self.vcsw = (ru1.ru_nvcsw - ru0.ru_nvcsw) / steps
        self.by = {k: (by1.get(k, 0.0) - by0.get(k, 0.0)) / steps for k in by1}
        # threads Python did not start (OpenMP's and BLAS's pools): the process's CPU less its Python threads'
        self.by["native pools"] = self.cpu - sum(self.by.values())


def plain_replicas(case: Case, g: int):
    """G replicas without cgdp, run one after another on this thread; returns one step of all."""
    models = [case.build() for _ in range(g)]
    opts = [case.opt(m.parameters()) for m in models]
    batch = case.batch(1)

    def step() -> None:
        for m, o in zip(models, opts):
            o.zero_grad()
            case.loss(m, batch).backward()
            o.step()
    return step


def threaded_replicas(case: Case, g: int):
    """The same G replicas without cgdp, each on a thread of its own (the one-thread-per-device
    model of cgdp, with nothing else): what that model alone costs on this machine. Returns one
    step of all, and a function that stops the threads."""
    import queue
    models = [case.build() for _ in range(g)]
    opts = [case.opt(m.parameters()) for m in models]
    batch = case.batch(1)
    todo = [queue.SimpleQueue() for _ in range(g)]
    done: queue.SimpleQueue = queue.SimpleQueue()

    def serve(j: int) -> None:
        while todo[j].get():
            opts[j].zero_grad()
            case.loss(models[j], batch).backward()
            opts[j].step()
            done.put(j)
    threads = [threading.Thread(target=serve, args=(j,), daemon=True, name=f"plain-{j}") for j in range(g)]
    for t in threads:
        t.start()

    def step() -> None:
        for q in todo:
            q.put(True)
        for _ in range(g):
            done.get()

    def stop() -> None:
        for q in todo:
            q.put(False)
        for t in threads:
            t.join()
    return step, stop


def whole_batch(case: Case, g: int) -> Any:
    b = case.batch(g)
    return b  # per-replica part = case.batch(1)'s size: cgdp splits the global batch in G


def settle(tr: Any, step: Callable[[], Any], extra: int = 2, most: int = 80) -> int:
    """Warm up; with a tuner, until it has chosen its plan. Returns the steps taken."""
    n = 0
    while n < most and getattr(tr, "tuner", None) is not None and not tr.tuner.done:
        step()
        n += 1
    for _ in range(extra):
        step()
    return n + extra


def measure(case: Case, g: int, rounds: int, steps: int, *, emulated: bool = False, **trainer_kw) -> dict:
    """Added CPU per device per step of cgdp over the plain replicas, and where it goes."""
    devices = [f"cpu:{j}" for j in range(g)] if emulated else [f"cuda:{j}" for j in range(g)]
    ctx = _NoRuntime() if emulated else null_runtime()(g)
    with ctx as rt:
        plain = plain_replicas(case, g)
        one = plain_replicas(case, 1)
        threaded, stop = threaded_replicas(case, g) if g > 1 else (plain, lambda: None)
        batch = whole_batch(case, g)
        loss_fn = case.loss
        threads_before = torch.get_num_threads()
        tr = cgdp.Trainer(case.build(), case.opt, devices, **trainer_kw)
        try:
            cg = lambda: tr.step(batch, loss_fn)  # noqa: E731
            loss = cg()
            if not (loss == loss):
                raise AssertionError(f"{case.name}: the loss is not finite")
            warm = settle(tr, cg)
            plain(), one()
            lay = inside(tr).stream.layout
            chunks, segments = len(lay.plan), len(lay.segments)
            if rt is not None:
                rt.counts.clear()
                cg()
                calls = dict(rt.counts)
                if calls.get("copy", 0) < g * segments:  # every segment out (and back) on every device
                    raise AssertionError(f"{case.name}: {calls.get('copy', 0)} copies in a step of "
                                         f"{segments} segments on {g} devices")
            else:
                calls = {}
            threaded()
            runs: dict[str, list[Run]] = {"cgdp": [], "plain": [], "one": [], "threads": []}
            for _ in range(rounds):  # interleaved: every round runs each contender once
                runs["plain"].append(Run(plain, steps))
                runs["cgdp"].append(Run(cg, steps))
                runs["threads"].append(Run(threaded, steps))
                runs["one"].append(Run(one, steps))
            registered = getattr(inside(tr).stream.host, "registered_bytes", None)
            caller_threads = (threads_before, torch.get_num_threads())
            if caller_threads[0] != caller_threads[1]:  # the user's setting, which the engine must leave
                print(f"WARNING {case.name} G={g}: the caller's torch intra-op count went from {caller_threads[0]} "
                      f"to {caller_threads[1]} when the trainer was built", file=sys.stderr, flush=True)
        finally:
            tr.close()
            stop()
    med = {k: median([r.cpu for r in v]) for k, v in runs.items()}
    # paired: each round's cgdp (or threads) minus the same round's plain replicas, so that a
    # change of load between rounds cancels out
    added = median([(c.cpu - p.cpu) / g for c, p in zip(runs["cgdp"], runs["plain"])])
    threads_added = median([(t.cpu - p.cpu) / g for t, p in zip(runs["threads"], runs["plain"])])
    roles = sorted({k for r in runs["cgdp"] for k in r.by})
    by = {k: median([r.by.get(k, 0.0) for r in runs["cgdp"]]) for k in roles}
    by["device"] = by.get("device", 0.0) - med["plain"]  # the device threads' CPU beyond the replicas' own
    return {"case": case.name, "G": g, "chunks": chunks, "segments": segments, "layers": len(tr.layers),
            "params": sum(1 for _ in case.build().parameters()), "warmup_steps": warm,
            "cgdp_cpu_s": med["cgdp"], "plain_cpu_s": med["plain"], "own_s": med["one"],
            "added_per_device_s": added, "threads_added_per_device_s": threads_added,
            "load": os.getloadavg()[0],
            "by_role_s": by, "sys_s": median([r.sys for r in runs["cgdp"]]),
            "vcsw": median([r.vcsw for r in runs["cgdp"]]),
            "calls_per_step": calls, "registered_bytes": registered, "caller_threads": caller_threads}


class _NoRuntime:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def per_unit(g: int, rounds: int, steps: int) -> dict:
    """Per hook, per chunk and per segment, on null CUDA devices (see the module docstring)."""
    small, big = chain_case(16), chain_case(96)
    a = measure(small, g, rounds, steps, chunks=[list(range(15, -1, -1))])
    b = measure(big, g, rounds, steps, chunks=[list(range(95, -1, -1))])
    c = measure(big, g, rounds, steps, chunks=1)
    hook = (b["added_per_device_s"] - a["added_per_device_s"]) / (96 - 16)
    chunk = (c["added_per_device_s"] - b["added_per_device_s"]) / (c["chunks"] - b["chunks"])
    chunk_by = {k: (c["by_role_s"].get(k, 0.0) - b["by_role_s"].get(k, 0.0)) / (c["chunks"] - b["chunks"])
                for k in set(c["by_role_s"]) | set(b["by_role_s"])}
    w = wide_case()
    one = measure(w, g, rounds, steps, chunks=1, segment_bytes=4 << 20)
    many = measure(w, g, rounds, steps, chunks=1, segment_bytes=64 << 10)
    nseg = many["segments"] - one["segments"]
    seg = g * (many["added_per_device_s"] - one["added_per_device_s"]) / nseg
    seg_by = {k: (many["by_role_s"].get(k, 0.0) - one["by_role_s"].get(k, 0.0)) / nseg
              for k in set(many["by_role_s"]) | set(one["by_role_s"])}
    return {"G": g, "hook_s": hook, "chunk_s": chunk, "chunk_by_role_s": chunk_by, "segment_s": seg,
            "segment_by_role_s": seg_by, "runs": [a, b, c, one, many]}


def ring_case(g: int, rounds: int, steps: int, seg: int = 1 << 20, slots: int = 4) -> dict:
    """Host memory bounded: a model and one 4x larger, full-size slots against a ring of ``slots``
    segment slots (``host_memory`` fixed); registered bytes, bitwise results, step time."""
    budget = slots * (g + 1) * seg
    out = {"G": g, "segment_bytes": seg, "host_memory": budget, "models": []}
    for width in (512, 1024):
        build = lambda w=width: mlp(w, 8)  # noqa: E731
        x, y = _mse(width)(8 * g)
        trs, params = {}, {}
        try:
            for name, kw in (("full", {}), ("ring", {"host_memory": budget})):
                tr = cgdp.Trainer(build(), lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
                                  [f"cpu:{j}" for j in range(g)], chunks=1, segment_bytes=seg, **kw)
                for _ in range(3):
                    tr.step(x, y, F.mse_loss)
                params[name] = [p.detach().clone() for p in tr.replicas[-1].parameters()]
                trs[name] = tr
            same = all(torch.equal(a, b) for a, b in zip(params["full"], params["ring"]))
            if not same:
                raise AssertionError(f"ring and full-size slots differ for width {width}")
            times: dict[str, list[float]] = {k: [] for k in trs}
            for _ in range(rounds):
                for k, tr in trs.items():
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        tr.step(x, y, F.mse_loss)
                    times[k].append((time.perf_counter() - t0) / steps)
            out["models"].append({
                "model": f"MLP 8 x Linear({width})", "grad_bytes": trs["full"]._stream.layout.total * 4,
                "registered_full": trs["full"]._stream.host.registered_bytes,
                "registered_ring": trs["ring"]._stream.host.registered_bytes, "bitwise_equal": same,
                "slots": trs["ring"]._stream.ring, "segments": len(trs["ring"]._stream.layout.segments),
                "step_full_s": median(times["full"]), "step_ring_s": median(times["ring"]),
                "moved_bytes": trs["full"]._stream.host.traffic()["total"]})
        finally:
            for tr in trs.values():
                tr.close()
    return out


# ---------------------------------------------------------------------------------- report
def us(x: float) -> str:
    return fmt(x * 1e6, 1)


def ms(x: float) -> str:
    return fmt(x * 1e3, 2)


def report(res: dict, info: dict, cmd: str, title: str | None = "## cgdp's own host cost per step") -> str:
    out = [title, "", f"Command: `{cmd}`", "", "Machine:", machine_md(info), ""] if title else []
    out += [f"Engine measured: `{res['engine']}` ({res['engine_rev']}). torch intra-op threads: 1.", ""]
    if res["null"]:
        out += ["### Added CPU per device per step, null CUDA devices", "",
                "Added = (process CPU of a cgdp step − the same G replicas' forward, loss, backward and "
                "optimizer step run one after another without cgdp) / G. Own = one replica's own step "
                "(at these widths: dispatch). By role: each thread's CPU per step, summed per role "
                "(device threads, less the plain replicas' own steps: the hooks, sends, waits and hand-offs "
                "there; completion: the copies' completion threads; host: the host sum thread; caller: "
                "the thread calling step()), all G devices together, in ms. Threads alone: the same "
                "replicas without cgdp, each on a thread of its own, less the plain replicas: what "
                "one thread per device costs by itself on this machine (the GIL handed between the "
                "threads at every operator). Medians over interleaved rounds; added figures are "
                "medians of each round's difference (paired). Load: the 1-minute load average "
                "after the case (other jobs on the machine).", ""]
        rows = []
        for r in res["null"]:
            by = r["by_role_s"]
            rows.append([r["case"], r["setting"], r["G"], r["chunks"], r["segments"], ms(r["own_s"]),
                         ms(r["added_per_device_s"]), fmt(100 * r["added_per_device_s"] / r["own_s"], 0) + " %",
                         ms(r["threads_added_per_device_s"]),
                         " / ".join(f"{k} {ms(v)}" for k, v in sorted(by.items()) if abs(v) >= 5e-5),
                         fmt(r["vcsw"], 0), fmt(r["load"], 1)])
        out += [table(["model", "chunks=", "G", "chunks", "segments", "own step ms", "added / device ms",
                       "added / own", "threads alone: added / device ms", "CPU by role, all devices (ms)",
                       "ctx switches / step", "load"], rows), ""]
        calls = []
        for r in res["null"]:
            c = r["calls_per_step"]
            calls.append([r["case"], r["setting"], r["G"], r["chunks"],
                          ", ".join(f"{k} {v / r['G']:.4g}" for k, v in sorted(c.items()))])
        out += ["Runtime calls per step per device (the null runtime's counts; on a GPU each is a CUDA call):", "",
                table(["model", "chunks=", "G", "chunks", "calls / device / step"], calls), ""]
    if res["units"]:
        rows = []
        for u in res["units"]:
            rows.append([u["G"], us(u["hook_s"]), us(u["chunk_s"]),
                         " / ".join(f"{k} {us(v)}" for k, v in sorted(u["chunk_by_role_s"].items()) if abs(v) >= 5e-8),
                         us(u["segment_s"]),
                         " / ".join(f"{k} {us(v)}" for k, v in sorted(u["segment_by_role_s"].items()) if abs(v) >= 5e-8)])
        out += ["### Per hook, per chunk, per segment (null CUDA devices, µs)", "",
                "Per hook: added CPU per device of a 96-layer chain sent as one chunk, less that of a "
                "16-layer chain, per extra parameter. Per chunk: the 96-layer chain as 96 chunks against "
                "one chunk, per extra chunk and device (every cost of a chunk: the send on the device "
                "thread, its completion, its share of the host thread, its copies back). Per segment: "
                "one 4 MiB layer in 64 segments against one, per extra segment, all devices together. "
                "By role: the same differences per thread role (device: all G device threads' CPU per extra "
                "chunk, i.e. G sends).", "",
                table(["G", "per hook", "per chunk and device", "per chunk, by role (all devices)",
                       "per segment (all devices)", "per segment, by role"], rows), ""]
    if res["emulated"]:
        rows = []
        for r in res["emulated"]:
            rows.append([r["case"], r["setting"], r["G"], r["chunks"], ms(r["own_s"]),
                         ms(r["added_per_device_s"]), fmt(r["added_per_device_s"] / r["own_s"], 2),
                         ms(r["threads_added_per_device_s"]),
                         fmt(r["vcsw"], 0), fmt(100 * r["sys_s"] / r["cgdp_cpu_s"], 0) + " %",
                         " / ".join(f"{k} {ms(v)}" for k, v in sorted(r["by_role_s"].items()) if abs(v) >= 5e-5),
                         " → ".join(map(str, r.get("caller_threads", ("?", "?")))), fmt(r["load"], 1)])
        out += ["### Emulated devices (`cpu:N`)", "",
                "Added CPU per device per step over one replica's own step; context switches: voluntary, "
                "whole process, per step; kernel share: system CPU / process CPU of the cgdp steps; native pools: "
                "the CPU of threads Python did not start (an OpenMP pool thread spinning after each parallel "
                "region shows here); caller's torch threads: the caller's intra-op count before the trainer was "
                "built and after its steps (the bench sets 1; the engine must leave it).", "",
                table(["model", "chunks=", "G", "chunks", "own step ms", "added / device ms", "added / own",
                       "threads alone: added / device ms", "ctx switches / step", "kernel share",
                       "CPU by role, all devices (ms)", "caller's torch threads", "load"], rows), ""]
    if res.get("ring"):
        rg = res["ring"]
        rows = [[m["model"], fmt(m["grad_bytes"] / 2**20, 1), m["segments"], fmt(m["registered_full"] / 2**20, 2),
                 fmt(m["registered_ring"] / 2**20, 2), m["slots"], "yes" if m["bitwise_equal"] else "NO",
                 fmt(m["step_full_s"] * 1e3, 1), fmt(m["step_ring_s"] * 1e3, 1),
                 fmt(m["step_ring_s"] / m["step_full_s"], 3), fmt(m["moved_bytes"] / 2**20, 1)]
                for m in rg["models"]]
        out += [f"### Host memory bounded (`host_memory={rg['host_memory']}`, {rg['G']} emulated devices)", "",
                f"Full-size slots against a ring of segment slots ({rg['segment_bytes'] >> 20} MiB segments, both), "
                "3 steps of SGD with momentum then bitwise comparison of the parameters, then step times "
                "(wall, median of interleaved rounds).", "",
                table(["model", "gradient MiB", "segments", "registered, full-size (MiB)", "registered, ring (MiB)",
                       "ring slots", "bitwise equal", "step full ms", "step ring ms", "ring / full",
                       "host bytes moved per step (MiB)"], rows), ""]
    return "\n".join(out)


def compare_table(before: dict, after: dict) -> str:
    """The headline figures of two engines measured in the same run."""
    rows = []
    key = lambda r: (r["case"], r["G"], r["setting"])  # noqa: E731
    old = {key(r): r for r in before.get("null", []) + before.get("emulated", [])}
    for r in after.get("null", []) + after.get("emulated", []):
        b = old.get((r["case"], r["G"], "1")) if r["setting"] in ("1", "default") else None
        b = old.get(key(r)) or b
        if b is None:
            continue
        rows.append([r["case"].split(" (")[0] + (" (emulated)" if r in after.get("emulated", []) else ""),
                     r["G"], f"{b['setting']} → {r['setting']}", f"{b['chunks']} → {r['chunks']}",
                     ms(b["own_s"]) + " / " + ms(r["own_s"]),
                     ms(b["added_per_device_s"]), ms(r["added_per_device_s"]),
                     fmt(100 * b["added_per_device_s"] / b["own_s"], 0) + " % → "
                     + fmt(100 * r["added_per_device_s"] / r["own_s"], 0) + " %",
                     ms(r["threads_added_per_device_s"]),
                     f"{b['vcsw']:.0f} → {r['vcsw']:.0f}", f"{b['load']:.1f} / {r['load']:.1f}"])
    units = []
    ub = {u["G"]: u for u in before.get("units", [])}
    for u in after.get("units", []):
        b = ub.get(u["G"])
        if b:
            units.append([u["G"], f"{us(b['hook_s'])} → {us(u['hook_s'])}", f"{us(b['chunk_s'])} → {us(u['chunk_s'])}",
                          f"{us(b['segment_s'])} → {us(u['segment_s'])}"])
    out = [table(["model", "G", "chunks= (before → after)", "chunks", "own step ms (before / after)",
                  "added / device, before (ms)", "added / device, after (ms)", "added / own",
                  "threads alone, after (ms)", "ctx switches / step", "load (before / after)"], rows), ""]
    if units:
        out += [table(["G", "per hook (µs)", "per chunk and device (µs)", "per segment, all devices (µs)"], units), ""]
    return "\n".join(out)


def collect(args: argparse.Namespace, gs: list[int], sections: list[str]) -> dict:
    import subprocess
    rev = subprocess.run(["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True, cwd=ENGINE).stdout.strip()
    res: dict[str, Any] = {"engine": os.path.relpath(ENGINE, ROOT) if ENGINE == ROOT else ENGINE,
                           "engine_rev": rev[:60] or "?", "null": [], "units": [], "emulated": [], "ring": None}

    def settings(v: str) -> tuple[str, dict]:
        if v == "default":
            return "default", {}
        return v, {"chunks": v if v == "auto" else int(v)}

    if "null" in sections:
        for name in args.models.split(","):
            for g in gs:
                for s in args.settings.split(","):
                    label, kw = settings(s)
                    r = measure(CASES[name], g, args.rounds, args.steps, **kw)
                    r["setting"] = label
                    print(f"null {name} G={g} chunks={label}: {r['chunks']} chunks, own {ms(r['own_s'])} ms, "
                          f"added/device {ms(r['added_per_device_s'])} ms "
                          f"({100 * r['added_per_device_s'] / r['own_s']:.0f} %), threads alone "
                          f"{ms(r['threads_added_per_device_s'])} ms, load {r['load']:.2f}", flush=True)
                    res["null"].append(r)
    if "units" in sections:
        for g in gs:
            u = per_unit(g, args.rounds, args.steps)
            print(f"units G={g}: hook {us(u['hook_s'])} µs, chunk {us(u['chunk_s'])} µs, segment "
                  f"{us(u['segment_s'])} µs", flush=True)
            res["units"].append(u)
    if "emulated" in sections:
        for g in [g for g in gs if g in (2, 4)]:
            for s in args.settings.split(","):
                label, kw = settings(s)
                r = measure(CASES["mlp48x32"], g, args.rounds, args.steps, emulated=True, **kw)
                r["setting"] = label
                print(f"emulated mlp48x32 G={g} chunks={label}: {r['chunks']} chunks, own {ms(r['own_s'])} ms, "
                      f"added/device {ms(r['added_per_device_s'])} ms = {r['added_per_device_s'] / r['own_s']:.2f} x own, "
                      f"threads alone {ms(r['threads_added_per_device_s'])} ms, {r['vcsw']:.0f} ctx switches, "
                      f"native pools {ms(r['by_role_s'].get('native pools', 0.0))} ms, caller's torch threads "
                      f"{'→'.join(map(str, r['caller_threads']))}, load {r['load']:.2f}", flush=True)
                res["emulated"].append(r)
    if "ring" in sections and 2 in gs:
        res["ring"] = ring_case(2, args.rounds, args.steps)
        for m in res["ring"]["models"]:
            print(f"ring {m['model']}: registered full {m['registered_full'] >> 20} MiB, ring {m['registered_ring'] >> 20} "
                  f"MiB, bitwise {m['bitwise_equal']}, ring/full step {m['step_ring_s'] / m['step_full_s']:.3f}", flush=True)
    return res


def compare(args: argparse.Namespace, argv: list[str], gs: list[int], sections: list[str]) -> dict:
    """Run the measurements on ``--before`` and on this tree, alternating per section and G in
    separate processes (one cgdp per process), so that both see the same load."""
    import json
    import subprocess
    import tempfile
    keep = []
    skip = False
    for a in argv:  # the options to pass on, without the ones set per run
        if skip:
            skip = False
            continue
        per_run = ("--before", "--md", "--json", "--devices", "--sections", "--engine", "--settings", "--repeat")
        if a in per_run:
            skip = True
            continue
        if a.split("=")[0] in per_run:
            continue
        keep.append(a)
    merged = {"before": {"null": [], "units": [], "emulated": []}, "after": {"null": [], "units": [], "emulated": []}}
    with tempfile.TemporaryDirectory() as tmp:
        for section in sections:
            for g in gs:
                runs: dict[str, list[dict]] = {"before": [], "after": []}
                for rep in range(args.repeat):
                    for side, engine, setting in (("before", args.before, "1"), ("after", ENGINE, args.settings)):
                        if section == "ring" and (side == "before" or g != 2 or rep):
                            continue
                        if section == "emulated" and g not in (2, 4):
                            continue
                        out = os.path.join(tmp, f"{side}-{section}-{g}-{rep}.json")
                        subprocess.run([sys.executable, os.path.abspath(__file__), *keep, "--engine", engine,
                                        "--sections", section, "--devices", str(g), "--settings", setting,
                                        "--json", out, "--md", os.devnull], check=True)
                        with open(out) as f:
                            runs[side].append(json.load(f)["results"])
                for side, got_all in runs.items():
                    if not got_all:
                        continue
                    m = merged[side]
                    for k in ("null", "units", "emulated"):
                        m[k] += _median_runs([got[k] for got in got_all], "hook_s" if k == "units" else "added_per_device_s")
                    if got_all[0].get("ring"):
                        m["ring"] = got_all[0]["ring"]
                    m["engine"], m["engine_rev"] = got_all[0]["engine"], got_all[0]["engine_rev"]
                    m["repeat"] = len(got_all)
    return merged


def _median_runs(runs: list[list[dict]], key: str) -> list[dict]:
    """Of the same configurations measured in several processes, each configuration's run with the
    median ``key`` (a process whose device threads fell into handing the GIL over at every
    operator shows as one outlier, not as the figure); ``runs_<key>`` lists all of them."""
    out = []
    for rows in zip(*runs):
        ranked = sorted(rows, key=lambda r: r[key])
        pick = dict(ranked[(len(ranked) - 1) // 2])
        pick["runs_" + key] = [r[key] for r in rows]
        out.append(pick)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default=ROOT, help="the cgdp tree to measure (default: this one)")
    ap.add_argument("--quick", action="store_true", help="G = 1, 2; 2 rounds of 2 steps (smoke test)")
    ap.add_argument("--before", help="another cgdp tree (an older checkout) to measure in the same run, "
                                     "alternating with this one; the page then compares them")
    ap.add_argument("--repeat", type=int, default=1, help="with --before: processes per configuration "
                                                            "and side (each figure: the median process)")
    ap.add_argument("--sections", default="null,units,emulated,ring")
    ap.add_argument("--models", default="gpt2,resnet50,mlp4x2048")
    ap.add_argument("--devices", default="1,2,4,8")
    ap.add_argument("--settings", default="1,default", help="chunks= values: an int, 'auto', 'default'")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--md")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.quick:  # small: but a G or models given explicitly stay (the --before runs pass them)
        given = " ".join(sys.argv[1:] if argv is None else argv)
        args.rounds, args.steps = 2, 2
        args.devices = args.devices if "--devices" in given else "1,2"
        args.models = args.models if "--models" in given else "gpt2"
    torch.set_num_threads(1)
    gs = [int(v) for v in args.devices.split(",")]
    sections = args.sections.split(",")
    cmd, load = command_line(), " ".join(f"{x:.2f}" for x in os.getloadavg())

    def machine_info() -> dict:
        # after the measurements: machine() runs a Numba parallel kernel, which starts Numba's threading layer (once per
        # process), and starting it sets the OpenMP count of the thread that starts it; here first, it would spare the
        # engine that start, and the caller's count the emulated section reports would say nothing
        info = machine()
        info["load average at start"] = load
        return info

    if args.before:
        both = compare(args, list(sys.argv[1:] if argv is None else argv), gs, sections)
        info = machine_info()
        md = "\n".join([
            "## cgdp's own host cost per step: before and after, same machine, same run", "",
            f"Command: `{cmd}`", "", "Machine:", machine_md(info), "",
            f"Before: `{both['before'].get('engine')}` ({both['before'].get('engine_rev')}); after: "
            f"`{both['after'].get('engine')}` ({both['after'].get('engine_rev')}). Each section and G ran "
            f"in its own process, before and after one right after the other, {args.repeat} time(s); "
            "each figure is from the process with the median added CPU (per hook: the median per-hook "
            "figure), so that a process whose device threads fell into handing the GIL over at every "
            "operator (the 'threads alone' column and the context switches show it) is one run among "
            "several, not the figure.", "",
            compare_table(both["before"], both["after"]), "",
            "## After, in detail", "", report(both["after"], info, cmd, title=None), "",
            "## Before, in detail", "", report(both["before"], info, cmd, title=None)])
        write_results(md, both, info, cmd, args.md, args.json)
        return 0
    res = collect(args, gs, sections)
    info = machine_info()
    write_results(report(res, info, cmd), res, info, cmd, args.md, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
