"""The first GPU run's proofs: cgdp's stream ordering seen from every thread, and under injected delays.

    OUT=/tmp/g python bench/gpu_checks.py        # on a GPU (about 1-3 min on one H100)
    python bench/gpu_checks.py --simulate        # anywhere: the same checks on the strict simulator

Every run trains a small MLP and a small CNN with G >= 2 replicas (two on ``cuda:0``, one on every
further GPU, ``share_devices=True``), on different parts of the batch, so that a late or lost copy
back changes the result; each run is compared with single-device autograd on the whole batch
(relative 1e-5, deterministic cuDNN, no TF32).

1. ``checker``: ``Trainer`` (float32 and bf16 wire, one chunk and one chunk per layer) and
   ``DataParallel`` under :class:`cgdp.testing.stream_check.checked`: a dispatch mode on every
   thread that issues CUDA work (pushed when the thread binds its device or enters a stream
   context: device threads, autograd's device threads through them, the host-sum thread, the
   completion threads, the caller) records every kernel's bytes on its stream, and torch's GPU
   trace callbacks give the events and synchronisations. Any race, by address range, fails.
   (``TORCH_CUDA_SANITIZER=1`` pushes its mode on the importing thread only, and keys by
   ``data_ptr()``: it sees none of cgdp's threads and never compares a slice with its buffer.)
2. ``faults``: the same runs with ``torch.cuda._sleep`` on the D2H streams, the H2D streams, the
   default streams, and all three (:class:`cgdp.testing.fault_injection.Delayed`).
3. ``controls``, which must fail, run right after the first check: the update not waiting for
   the copies back (under H2D delays: a wrong result; under the checker: a reported race), and the
   D2H copy not waiting for its chunk's gradients (``ready``, recorded on the stream that
   accumulated them; under compute delays and under the checker). A check whose control passes
   cannot fail, and proves nothing.

DataParallel runs G >= 2 replicas too: on one GPU, two of them on ``cuda:0`` (``share_devices``).

Writes ``$OUT/gpu_checks.json`` and ``$OUT/gpu_checks.md`` (machine, versions, command, every check)
after every check, so a run stopped by its limit (SIGINT, or SIGTERM) keeps what it checked; such a
run is marked ``"interrupted"`` and exits 1.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from common import command_line, machine, machine_md, table  # noqa: E402
from cgdp.testing import inside


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    cnn = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, 10))
    return {"mlp": mlp, "cnn": cnn}


def batches(name: str, steps: int, n: int = 24) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (32,) if name == "mlp" else (1, 8, 8)
    return [(torch.randn(n, *shape, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(steps)]


SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731


def reference(model: nn.Module, data, device: torch.device) -> list[torch.Tensor]:
    m = copy.deepcopy(model).to(device)
    opt = SGD(m.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(m(x.to(device)), y.to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in m.parameters()]


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    den = max(float(r.abs().max()) for r in ref)
    return max(float((g.cpu() - r).abs().max()) for g, r in zip(got, ref)) / den


def run_trainer(model, data, devices, runtime, grad_transfer=None, chunks=1) -> list[torch.Tensor]:
    import cgdp
    from cgdp.engine.backend.cuda_runtime import use_runtime
    with use_runtime(runtime):
        with cgdp.Trainer(copy.deepcopy(model), SGD, devices, chunks=chunks, segment_bytes=4096,
                          share_devices=True, grad_transfer=grad_transfer) as tr:
            if hasattr(runtime, "attach"):
                runtime.attach(inside(tr).devices)
            for x, y in data:
                tr.step(x, y, F.cross_entropy)
            out = [p.detach().cpu().clone() for p in tr.replicas[0].parameters()]
    return out


def run_dataparallel(model, data, devices, runtime) -> list[torch.Tensor]:
    import cgdp
    from cgdp.engine.backend.cuda_runtime import use_runtime
    with use_runtime(runtime):
        net = copy.deepcopy(model)
        with cgdp.DataParallel(net, devices, chunks=1, share_devices=True) as dp:
            if hasattr(runtime, "attach"):
                runtime.attach(inside(dp).devices)
            opt = dp.bind(SGD(net.parameters()))
            for x, y in data:
                opt.zero_grad()
                F.cross_entropy(dp(x), y.to(dp.output_device)).backward()
                opt.step()
            return [p.detach().cpu().clone() for p in net.parameters()]


@contextlib.contextmanager
def no_update_wait():
    """The broken ordering of the controls: the update does not wait for the copies back."""
    from cgdp.engine.backend.cuda import CudaDevice
    real = CudaDevice.compute_wait
    CudaDevice.compute_wait = lambda self, marker, guard: None
    try:
        yield
    finally:
        CudaDevice.compute_wait = real


@contextlib.contextmanager
def no_ready_wait():
    """The other broken ordering of the controls: a D2H copy does not wait for its chunk's gradients
    (each ``ready`` event is never recorded, so the D2H stream's wait on it is a no-op; the record
    goes to another event, so that fault injection still puts its device sleep after it)."""
    from cgdp.engine.backend.cuda import CudaDevice
    real = CudaDevice.set_routes

    def set_routes(self, routes):
        real(self, routes)
        for ev in self._ready:  # recorded as before (a delayed runtime still sleeps after it), but
            ev.record = self.rt.Event().record  # into another event: the D2H stream waits on none

    CudaDevice.set_routes = set_routes
    try:
        yield
    finally:
        CudaDevice.set_routes = real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--simulate", action="store_true", help="run on the strict simulated CUDA runtime")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the MLP only, float32 wire, all delays at once (CI)")
    ap.add_argument("--cycles", type=int, default=None,
                    help="device sleep per injection (default 50M cycles on a GPU, ~25 ms; 2M simulated)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    real = torch.cuda.is_available() and not args.simulate
    if not real and not args.simulate:
        print("[gpu_checks] no GPU: use --simulate to run the checks on the simulated runtime")
        return 2
    from cgdp.engine.backend.cuda_runtime import TorchCuda
    from cgdp.testing import simulated_cuda
    from cgdp.testing.fault_injection import Delayed
    from cgdp.testing.stream_check import StreamRaceError, checked
    cycles = args.cycles or (50_000_000 if real else 2_000_000)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    n_gpus = torch.cuda.device_count() if real else 2
    devices = ["cuda:0"] + [f"cuda:{i}" for i in range(n_gpus)]
    results: list[dict] = []
    res = {"command": command_line(), "machine": machine(), "simulated": not real, "devices": devices,
           "cycles": cycles, "interrupted": False, "checks": results}

    def save() -> None:  # after every check: a run stopped by its limit keeps what it checked
        bad = [r for r in results if not r["ok"]]
        lines = ["# The first GPU run's ordering checks" + (" (SIMULATED: no GPU was used)" if not real else ""),
                 "", machine_md(res["machine"]), "", f"Command: `{res['command']}`", "",
                 f"Devices {devices}; injected device sleep {cycles} cycles per ordering point.", "",
                 table(["check", "outcome", "as it must", "s"],
                       [[r["check"], r["outcome"], "yes" if r["ok"] else "**NO**", r["seconds"]] for r in results]),
                 "", f"{len(results) - len(bad)}/{len(results)} as they must"
                 + (" (INTERRUPTED: the checks after these did not run)" if res["interrupted"] else "") + "."]
        for name, text in (("gpu_checks.json", json.dumps(res, indent=1, default=str)),
                           ("gpu_checks.md", "\n".join(lines) + "\n")):
            tmp = os.path.join(args.out, name + ".tmp")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(args.out, name))

    def check(name: str, fn, must_fail: bool = False, tol: float = 1e-5) -> None:
        t0 = time.perf_counter()
        entry: dict = {"check": name, "must_fail": must_fail}
        try:
            err = fn()
            entry["rel_err"] = err
            failed = not err <= tol
            entry["outcome"] = (f"wrong result (rel. err. {err:.1e} > {tol:g})" if failed else
                                f"right (rel. err. {err:.1e} <= {tol:g})")
        except StreamRaceError as exc:
            failed, entry["outcome"] = True, f"race reported: {str(exc)[:300]}"
        except Exception as exc:  # noqa: BLE001 - every failure is a result here
            failed, entry["outcome"] = True, f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        entry["ok"] = failed if must_fail else not failed
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(entry)
        save()
        print(f"[gpu_checks] {'PASS' if entry['ok'] else 'FAIL'} {name}: {entry['outcome']}", flush=True)

    @contextlib.contextmanager
    def runtime(kind: str, where=()):
        """(runtime object, the simulator or None)."""
        if real:
            rt = TorchCuda()
            wrapped = checked(rt) if kind == "checker" else Delayed(rt, where, cycles)
            try:
                yield wrapped
                torch.cuda.synchronize()
                if kind == "checker" and wrapped.checker.errors:
                    raise wrapped.checker.errors[0]
            finally:
                if kind == "checker":
                    wrapped.close()
        else:
            with simulated_cuda(n_gpus, seed=3, max_delay_s=0.001) as sim:
                yield sim.runtime if kind == "checker" else Delayed(sim.runtime, where, cycles)

    ref_dev = torch.device("cuda", 0) if real else torch.device("cpu")

    def controls() -> None:
        """The checks must be able to fail: each control drops one wait and must be caught."""
        model = models()["mlp"]
        data = batches("mlp", args.steps)
        ref = reference(model, data, ref_dev)

        def control(broken, kind, where=()):
            with broken():
                with runtime(kind, where) as rt:
                    got = run_trainer(model, data, devices, rt)
            return rel_err(got, ref)
        check("control (must fail): update does not wait for the copies back, H2D delayed",
              lambda: control(no_update_wait, "faults", ("h2d",)), must_fail=True)
        check("control (must fail): update does not wait for the copies back, under the checker",
              lambda: control(no_update_wait, "checker"), must_fail=True)
        check("control (must fail): D2H copy does not wait for the gradients, compute delayed",
              lambda: control(no_ready_wait, "faults", ("compute",)), must_fail=True)
        check("control (must fail): D2H copy does not wait for the gradients, under the checker",
              lambda: control(no_ready_wait, "checker"), must_fail=True)

    def all_checks() -> None:
        first = True
        for mname, model in models().items():
            if args.quick and mname != "mlp":
                continue
            data = batches(mname, args.steps)
            ref = reference(model, data, ref_dev)
            for wire, chunks in ((None, 1),) if args.quick else ((None, 1), (None, "layers"), ("bf16", 1)):
                if wire == "bf16" and mname == "cnn":
                    continue
                label = f"{mname} Trainer{' bf16 wire' if wire else ''} chunks={chunks}"
                with_params = [m for m in model.modules() if list(m.parameters(recurse=False))]
                ch = [[i] for i in reversed(range(len(with_params)))] if chunks == "layers" else chunks
                tol = 1e-5 if wire is None else 1e-2  # bf16 on the wire: within its error bound

                def trainer_err(kind, where=(), wire=wire, ch=ch, data=data, model=model, ref=ref):
                    with runtime(kind, where) as rt:
                        got = run_trainer(model, data, devices, rt, wire, ch)
                    return rel_err(got, ref)
                check(f"checker: {label}", lambda: trainer_err("checker"), tol=tol)
                if first:  # the controls next: what the checks are worth is known early
                    first = False
                    controls()
                points = (("d2h", "h2d", "compute"),) if args.quick else \
                    (("d2h",), ("h2d",), ("compute",), ("d2h", "h2d", "compute"))
                for where in points:
                    check(f"faults {'+'.join(where)}: {label}", lambda where=where: trainer_err("faults", where),
                          tol=tol)

            def dp_err(kind, where=(), data=data, model=model, ref=ref):
                with runtime(kind, where) as rt:
                    got = run_dataparallel(model, data, devices, rt)
                return rel_err(got, ref)
            check(f"checker: {mname} DataParallel", lambda: dp_err("checker"))
            check(f"faults d2h+h2d+compute: {mname} DataParallel",
                  lambda: dp_err("faults", ("d2h", "h2d", "compute")))

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)  # timeout's default signal: end as SIGINT does
    try:
        all_checks()
    except KeyboardInterrupt:
        res["interrupted"] = True
        print("[gpu_checks] interrupted: the checks so far are written", flush=True)
    save()
    bad = [r for r in results if not r["ok"]]
    print(f"[gpu_checks] {len(results) - len(bad)}/{len(results)} as they must"
          + (", interrupted" if res["interrupted"] else "") + f"; wrote {args.out}/gpu_checks.md")
    return 1 if bad or res["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
