"""What a run needs in memory, against what the machine has: refused before training, with numbers.

A run that does not fit must not be found out by the kernel's out-of-memory killer minutes in
(exit 137, no message). :func:`estimate` adds up what a run holds at its peak:

* per replica (G of them): the parameters P, the gradients (the flat buffer, P), the optimizer
  state (k x P, k counted from one step of a probe optimizer of the run's class:
  :func:`cgdp.engine.trainer.state.probe_state`; SGD with momentum 1, Adam 2);
* on the host: the pinned slots and the accumulator, (G + 1) x P in mode ``cgdp`` (G x P gathered
  in ``typical``);
* per device, during a step: the activations autograd saves for backward, measured by running
  the model on one sample on the ``meta`` device (shapes only: no memory, no arithmetic) with
  saved-tensor hooks counting the bytes kept, times the samples per device; plus backward's
  working memory, twice the largest saved tensor times the samples;
* the data: the global batch of inputs, ``prefetch`` + 2 times (queued, in use, being made), and
  the evaluation batch (its inputs and the largest activation, twice, without autograd).

On CPU-emulated devices every part is host memory; on GPUs the per-device parts are each GPU's.
The host has what ``psutil`` says is available (or less, when a cgroup limit is lower); a GPU
what ``torch.cuda.mem_get_info`` says is free. :func:`check` returns the refusal, with the
parts, the total, what is available and what would fit (a smaller ``--batch``, fewer devices);
``python -m cgdp.train`` exits with 2 before building anything; :func:`warning` notes a run that
needs more than :data:`TIGHT` of what is there. It is an estimate that leaves out allocator slack
and the work buffers of torch's CPU kernels (im2col of convolutions): against the peak RSS of
3-step runs on 2 emulated devices it was 9% under for AlexNet (batch 32), 10% under for
ResNet-152 (batch 4) and 38% under for GoogLeNet (batch 8), whose many parallel convolutions need
the most work memory. So it refuses what cannot fit; a run close to the limit gets a warning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

GIB = float(2 ** 30)
TIGHT = 0.7
"""A run estimated to need more than this share of the available memory gets a warning."""


@dataclass
class Estimate:
    devices: int
    emulated: bool
    replica: dict[str, float] = field(default_factory=dict)
    """Bytes per replica: parameters, gradients, optimizer state."""
    host: dict[str, float] = field(default_factory=dict)
    """Bytes on the host whatever the devices: host buffers, data, evaluation."""
    per_sample: float = 0.0
    """Bytes per sample on its device during a step (saved activations and backward's working memory)."""
    batch: int = 1
    """Samples per device."""

    def device_bytes(self, batch: int | None = None) -> float:
        """One device's need at its peak."""
        return sum(self.replica.values()) + self.per_sample * (self.batch if batch is None else batch)

    def host_bytes(self, batch: int | None = None) -> float:
        """The host's need: everything on emulated devices, the host's own part on GPUs."""
        scale = (self.batch if batch is None else batch) / self.batch
        own = self.host["host buffers"] + scale * (self.host["data"] + self.host.get("evaluation", 0.0))
        return own + (self.devices * self.device_bytes(batch) if self.emulated else 0.0)


def measure(build: Callable[[], nn.Module], sample_shape: tuple[int, ...],
            optimizer: Callable[..., torch.optim.Optimizer]) -> tuple[int, float, float, int]:
    """``(parameter bytes, saved bytes per sample, largest saved tensor per sample, optimizer
    state tensors per parameter)`` of the model that ``build()`` makes, on the meta device."""
    with torch.device("meta"):
        model = build()
    params = list(model.parameters())
    p_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    own = {p.untyped_storage()._cdata for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in own:
            saved[st._cdata] = st.nbytes()
        return t

    n = 2  # two samples: BatchNorm in training mode needs more than one
    x = torch.empty((n, *sample_shape), device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
        act, top = sum(saved.values()) / n, max(saved.values(), default=0) / n
    except Exception:  # noqa: BLE001 - an operation without a meta kernel: no activation figure
        act = top = math.nan
    from cgdp.engine.trainer.state import probe_state
    opt = optimizer([p for p in params if p.requires_grad] or [nn.Parameter(torch.zeros(1, device="meta"))])
    probe = probe_state(opt, 0) or {}
    return p_bytes, act, top, sum(1 for v in probe.values() if v == "param")


def estimate(measured: tuple[int, float, float, int], *, devices: int, emulated: bool, mode: str, batch: int,
             input_bytes: int, global_batch: int, prefetch: int, eval_samples: int) -> Estimate:
    """The need of a run (see the module docstring); ``input_bytes``: one sample's input."""
    p, act, top, k = measured
    est = Estimate(devices, emulated, batch=batch)
    est.replica = {"parameters": p, "gradients": p, "optimizer state": k * p}
    act, top = (0.0, 0.0) if math.isnan(act) else (act, top)
    est.per_sample = act + 2 * top
    copies = {"cgdp": devices + 1, "typical": devices, "single": 0}[mode]
    est.host = {"host buffers": copies * p,
                "data": (prefetch + 2) * global_batch * input_bytes,
                "evaluation": eval_samples * (input_bytes + 2 * top)}
    return est


def available_host() -> float | None:
    """Bytes of memory this process can still get: psutil's available, or less under a cgroup."""
    try:
        import psutil
        have = float(psutil.virtual_memory().available)
    except (ImportError, OSError):
        return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                used = float(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and float(limit) < 2 ** 60:
            have = min(have, float(limit) - used)
        break
    return have


def check(est: Estimate, host: float | None, gpu_free: list[float] | None = None,
          device_flag: str = "") -> str | None:
    """Why the run cannot fit (None if it can): the parts, the total, what is there, what to do."""
    over: list[str] = []
    if host is not None and est.host_bytes() > host:
        over.append(f"about {est.host_bytes() / GIB:.1f} GiB of host memory, and {host / GIB:.1f} GiB is available")
    if gpu_free and not est.emulated and est.device_bytes() > min(gpu_free):
        over.append(f"about {est.device_bytes() / GIB:.1f} GiB per GPU, and the fullest GPU has "
                    f"{min(gpu_free) / GIB:.1f} GiB free")
    if not over:
        return None
    r = est.replica
    parts = (f"{est.devices} replica(s) x ({r['parameters'] / GIB:.2f} GiB parameters + {r['gradients'] / GIB:.2f} "
             f"GiB gradients + {r['optimizer state'] / GIB:.2f} GiB optimizer state); activations "
             f"{est.per_sample / 2**20:.0f} MiB per sample x {est.batch} sample(s) per device"
             + ("" if not est.emulated else f" x {est.devices} device(s)")
             + f"; host buffers {est.host['host buffers'] / GIB:.2f} GiB; data and evaluation "
             f"{(est.host['data'] + est.host['evaluation']) / GIB:.2f} GiB")
    fit = _largest_batch(est, host, gpu_free)
    fix = (f"lower --batch to {fit} or less" if fit else
           "use fewer devices (the replicas alone do not fit)" if est.devices > 1 else "use a smaller model")
    note = ""
    if est.emulated and device_flag.isdigit():
        n = int(device_flag)
        note = (f". No GPU was found, so --devices {n} means {n} CPU-emulated device(s), each holding a "
                f"full replica in host memory")
    return f"this run needs {' and '.join(over)} ({parts}); {fix}{note}"


def warning(est: Estimate, host: float | None) -> str | None:
    """A note for a run that fits, but tightly (the estimate leaves out some work memory)."""
    if host is None or est.host_bytes() <= TIGHT * host:
        return None
    fit = _largest_batch(est, TIGHT * host, None)
    return (f"note: this run needs about {est.host_bytes() / GIB:.1f} GiB of the {host / GIB:.1f} GiB of host memory "
            f"available (an estimate that leaves out some work memory of torch's kernels); if it is killed, "
            f"lower --batch" + (f" (to {fit}, say)" if fit else ""))


LARGE_ON_CPU = 1_000_000
"""Parameters from which a model is sized for GPUs (the paper's networks: 6.6 M to 138 M; the
bundled digits models: under 40 k)."""


def time_note(name: str, params: int, devices: list[str], batch: int, global_batch: int, steps: int) -> str | None:
    """A note for a GPU-sized model on CPU-emulated devices, where a step takes minutes: said before
    the run starts, with what makes it short (what the user has not already done); the first step's
    line gives the ETA."""
    if devices[0].startswith("cuda") or params < LARGE_ON_CPU:
        return None
    quick = [f for f, short in (("--steps 3", steps <= 3), ("--batch 2", batch <= 2)) if not short]
    note = (f"note: {name} ({params / 1e6:.1f} M parameters, {global_batch} samples a step) is sized for GPUs; on "
            f"{len(devices)} CPU-emulated device(s) one step can take minutes")
    if steps > 3:
        note += f" and {steps} steps hours"
    note += " (the ETA follows the first step)"
    return note + (f". For a quick look, pass {' '.join(quick)}" if quick else "")


def _largest_batch(est: Estimate, host: float | None, gpu_free: list[float] | None) -> int:
    """The largest per-device batch that fits (0 if none does)."""
    def fits(b: int) -> bool:
        return ((host is None or est.host_bytes(b) <= host)
                and (not gpu_free or est.emulated or est.device_bytes(b) <= min(gpu_free)))
    lo, hi = 0, est.batch
    while lo < hi:  # fits() is monotone in the batch
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def gpu_free(devices: list[str]) -> list[float] | None:
    """Free bytes on each GPU of ``devices`` (None for CPU-emulated devices)."""
    if not devices or not devices[0].startswith("cuda"):
        return None
    try:
        return [float(torch.cuda.mem_get_info(int(d.partition(":")[2] or 0))[0]) for d in sorted(set(devices))]
    except (RuntimeError, AssertionError, ValueError):
        return None


def input_bytes(sample_shape: tuple[int, ...]) -> int:
    """Bytes of one float32 input sample."""
    return 4 * int(math.prod(sample_shape))
