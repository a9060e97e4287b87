"""A short bandwidth probe: the two limits of CGDP, measured on this machine.

* host memcpy bandwidth (NumPy ``copyto``, one thread): on emulated devices every D2H and H2D
  "PCIe" copy is such a memcpy;
* host streaming-add bandwidth (NumPy ``add``, one thread, counted as 2 reads + 1 write): what one
  accumulation thread moves;
* pinned D2H and H2D copy bandwidth per GPU, when ``torch.cuda`` is available.

Each figure is the best of ``repeats`` timed runs after a warm-up (the best, not the median: the
probe asks what the hardware can do; contention is the simulator's business). Takes well under a
second on the default size. Reads nothing of the engine.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class ProbeResult:
    """Measured bandwidths of this machine (GB/s = 1e9 bytes per second)."""

    memcpy_gbps: float
    """Host memcpy, bytes copied per second, one thread."""
    add_gbps: float
    """Host ``out = a + b``, bytes read and written per second, one thread."""
    cores: int
    """CPU cores this process may run on."""
    d2h_gbps: list[float] | None = None
    """Pinned device-to-host copy per GPU (``None`` without CUDA)."""
    h2d_gbps: list[float] | None = None
    """Pinned host-to-device copy per GPU."""
    nbytes: int = 0
    """Buffer size used."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ProbeResult":
        return cls(**d)


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, caches
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def probe(nbytes: int = 32 << 20, repeats: int = 5, cuda: bool | None = None) -> ProbeResult:
    """Measure host memcpy and add bandwidth, and pinned copy bandwidth per GPU if CUDA is there."""
    n = max(nbytes // 4, 1)
    a = np.ones(n, np.float32)
    b = np.ones(n, np.float32)
    out = np.empty(n, np.float32)
    t_copy = _best(lambda: np.copyto(out, a), repeats)
    t_add = _best(lambda: np.add(a, b, out=out), repeats)
    res = ProbeResult(memcpy_gbps=n * 4 / t_copy / 1e9, add_gbps=3 * n * 4 / t_add / 1e9,
                      cores=_cores(), nbytes=n * 4)
    if cuda is None:
        cuda = _cuda_available()
    if cuda:
        res.d2h_gbps, res.h2d_gbps = _probe_cuda(n, repeats)
    return res


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _probe_cuda(n: int, repeats: int) -> tuple[list[float], list[float]]:
    import torch

    d2h, h2d = [], []
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    for i in range(torch.cuda.device_count()):
        dev = torch.empty(n, dtype=torch.float32, device=f"cuda:{i}")

        def timed(dst, src) -> float:
            def run():
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize(i)  # note: host waits for the copy (that is what we time)
            return _best(run, repeats)
        d2h.append(n * 4 / timed(host, dev) / 1e9)
        h2d.append(n * 4 / timed(dev, host) / 1e9)
    return d2h, h2d
