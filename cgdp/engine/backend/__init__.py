"""The devices: device strings → :class:`~cgdp.engine.backend.base.Device` objects, in one place. May import
``engine.sync`` only; only ``cuda_runtime.py`` touches ``torch.cuda``.

``"cpu:N"``: CPU-emulated replicas in host memory; ``"cuda:N"``: GPUs (or ``cgdp.testing.simulated_cuda``'s). One kind
per trainer. ``share=True`` lets a GPU hold several replicas (the G > 1 data path on one GPU, for tests).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from cgdp.engine.backend.base import Device

_DEVICE = re.compile(r"^(cpu|cuda):(\d+)$")


def parse_devices(devices: Sequence[str], share: bool = False) -> tuple[str, list[int]]:
    """Validate ``devices``; return (kind, indices). ``share``: a CUDA device may be listed more than once."""
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list of device strings such as ['cuda:0', 'cuda:1'] or "
                        f"['cpu:0', 'cpu:1']; got {devices!r}")
    if len(devices) == 0:
        raise ValueError("devices is empty; pass at least one device, e.g. ['cpu:0']")
    kinds, idx = set(), []
    for d in devices:
        m = _DEVICE.match(d) if isinstance(d, str) else None
        if m is None:
            raise ValueError(f"unknown device {d!r}: use 'cuda:N' for GPU N or 'cpu:N' for the N-th "
                             f"CPU-emulated device (the index is required, e.g. 'cpu:0')")
        kinds.add(m.group(1))
        idx.append(int(m.group(2)))
    if len(kinds) > 1:
        raise ValueError(f"devices mixes CPU-emulated and CUDA devices ({list(devices)}); use one kind")
    kind = kinds.pop()
    dup = sorted({d for d in devices if list(devices).count(d) > 1})
    if dup and not (share and kind == "cuda"):
        hint = ("; to run several replicas on one GPU (the G > 1 data path on a one-GPU machine), "
                "pass share_devices=True" if kind == "cuda" else
                "; CPU-emulated devices are separate replicas anyway: use 'cpu:0', 'cpu:1', ...")
        raise ValueError(f"device(s) {dup} listed more than once; each device holds one replica{hint}")
    if kind == "cuda":
        from cgdp.engine.backend.cuda import cuda_count
        n = cuda_count()
        missing = [i for i in idx if i >= n]
        if missing:
            raise ValueError(f"cuda:{missing[0]} is not there: this machine has {n} CUDA device(s) "
                             f"visible{' (torch.cuda is not available)' if n == 0 else ''}; "
                             + (f"use cuda:0..cuda:{n - 1}" if n > 1 else "use cuda:0" if n == 1
                                else "use CPU-emulated devices 'cpu:N' instead"))
    return kind, idx


def make_devices(devices: Sequence[str], fail: Callable[[BaseException], None], share: bool = False) -> list[Device]:
    kind, idx = parse_devices(devices, share)
    if kind == "cuda":
        from cgdp.engine.backend.cuda import CudaDevice
        return [CudaDevice(name, i, fail) for name, i in zip(devices, idx)]
    from cgdp.engine.backend.cpu import CpuDevice
    return [CpuDevice(name, fail) for name in devices]


def default_devices() -> list[str]:
    from cgdp.engine.backend.cuda import cuda_count
    return [f"cuda:{i}" for i in range(cuda_count())] or ["cpu:0", "cpu:1"]


def make_rng(devs: Sequence[Device]) -> Any:
    """One random stream per replica (``forward_all``, ``on_device``, ``states``)."""
    if devs[0].is_cuda:
        from cgdp.engine.backend.cuda import CudaRNG
        return CudaRNG(devs)
    from cgdp.engine.backend.rng import EmulatedRNG
    return EmulatedRNG(len(devs))


def host_threads(devs: Sequence[Device]) -> int:
    """Threads of the host sum: with GPUs, every core but one per device thread; emulated devices keep the cores busy,
    so one."""
    if devs[0].is_cuda:
        from cgdp.engine.backend.cuda import host_threads as cuda_host_threads
        return cuda_host_threads(len(devs))
    return 1
