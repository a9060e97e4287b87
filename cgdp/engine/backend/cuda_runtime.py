"""The CUDA runtime: :class:`TorchCuda`, the one object through which cgdp calls ``torch.cuda`` (and libcudart for what
``torch.cuda.cudart()`` lacks). ``cgdp.testing``'s simulated runtime sits beneath it, so CI runs every line;
:func:`use_runtime` sets the runtime that devices created inside use.

* A stream context makes its device current first: a thread that never chose a device creates no context on GPU 0. Host
  memory is registered with the current device's context, so callers register inside such a guard.
* Host memory is registered with ``cudaHostRegister`` on pages of its own, exactly the bytes needed (the caching
  allocator rounds up to a power of two). A failed (un)registration raises a clear error and clears the thread's last
  CUDA error, so no later kernel launch reports it.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.cuda.comm  # noqa: F401 (submodules torch.cuda does not import itself)
import torch.cuda.nccl  # noqa: F401


def host_page_size() -> int:
    """The host's page size (4 KiB on most x86 hosts, 64 KiB on some arm64 ones, e.g. GH200)."""
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return mmap.PAGESIZE


_CUDA_ERRORS = {2: "out of memory: raise the locked-memory limit (ulimit -l) or free host memory",
                712: "part of the range is already page-locked (it shares a page with another "
                     "registration)",
                713: "the memory is not registered"}


def _load_cudart() -> Any:
    """The libcudart this process already loaded (for ``cudaGetLastError``), or None."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:  # pragma: no cover - not Linux
        paths = set()
    for path in sorted(paths) + ["libcudart.so.12", "libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None  # pragma: no cover - cudart linked statically


class TorchCuda:
    """The CUDA runtime, as cgdp uses it: every method is one ``torch.cuda`` call (or two). ``torch_module``: ``torch``,
    or the simulated namespaces of :mod:`cgdp.testing.fake_cuda`."""

    def __init__(self, torch_module: Any = torch, native: Callable[[], Any] = _load_cudart,
                 page_size: int | None = None):
        self.torch = torch_module
        self.cuda = torch_module.cuda
        self._native = native
        self.page_size = page_size or host_page_size()

    def device_count(self) -> int:
        return self.cuda.device_count() if self.cuda.is_available() else 0

    def torch_device(self, index: int) -> torch.device:
        return self.torch.device("cuda", index)

    def is_device(self, device: Any) -> bool:
        return (isinstance(device, torch.device) and device.index is not None
                and device.type == self.torch_device(device.index).type)

    def Stream(self, index: int) -> Any:  # noqa: N802 (mirrors torch.cuda.Stream)
        with self.cuda.device(index):
            return self.cuda.Stream(index)

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> Any:  # noqa: N802
        return self.cuda.Event(enable_timing=enable_timing, blocking=blocking)

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        # the stream's device is made current first (a device guard: restored lazily, without cudaSetDevice on a device
        # that has no context). A bare torch.cuda.stream(s) on a thread that never chose a device would leave through
        # set_stream(device 0's stream), i.e. cudaSetDevice(0): a context on GPU 0 for a process that uses another GPU.
        with self.cuda.device(s.device_index), self.cuda.stream(s):
            yield

    def current_stream(self, index: int) -> Any:
        return self.cuda.current_stream(index)

    def default_stream(self, index: int) -> Any:
        return self.cuda.default_stream(index)

    def set_device(self, index: int) -> None:
        self.cuda.set_device(index)

    def synchronize(self, index: int) -> None:
        self.cuda.synchronize(index)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory of exactly ``numel`` elements on pages of its own (a shared page would fail another
        registration); register under a guard of the owning device."""
        page = self.page_size
        nbytes = max(numel, 1) * dtype.itemsize
        span = -(-nbytes // page) * page
        raw = self.torch.empty(span + page, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % page
        buf = raw[skip:skip + nbytes]
        err = int(self.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
        if err != 0:
            self._failed(err, f"cudaHostRegister of {nbytes / 2**20:.1f} MiB of host memory")
        return buf.view(dtype)[:numel]  # a view of ``raw``'s storage, which it keeps alive

    def host_free(self, t: torch.Tensor) -> None:
        err = int(self.cuda.cudart().cudaHostUnregister(t.data_ptr()))
        if err != 0:
            self._failed(err, "cudaHostUnregister of cgdp's host rows")

    def _failed(self, err: int, what: str) -> None:
        """Clear the thread's last error, which the next kernel launch would otherwise raise as its own, and raise."""
        lib = self._native()
        if lib is not None:
            lib.cudaGetLastError()
        raise RuntimeError(f"{what} failed (CUDA error {err}: {_CUDA_ERRORS.get(err, 'see cudaError_t')})")

    def reduce_into_first(self, tensors: Sequence[torch.Tensor]) -> None:
        """``tensors[0]`` += the others (one per device): an in-place NCCL reduce where available, else copies and adds
        in order."""
        nccl = self.cuda.nccl
        if nccl.is_available(list(tensors)):
            nccl.reduce(list(tensors), output=tensors[0], root=0)
            return
        for t in tensors[1:]:
            tensors[0].add_(t.to(tensors[0].device, non_blocking=True))

    def broadcast(self, tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> list[list[torch.Tensor]]:
        """Copies of ``tensors`` on every device of ``indices`` (distinct), in buckets."""
        return self.cuda.comm.broadcast_coalesced(list(tensors), list(indices))

    def rng_key(self, index: int) -> Any:
        """Replicas with the same key share one generator (the generator of their device)."""
        return self.cuda.default_generators[index]

    def get_rng_state(self, index: int) -> torch.Tensor:
        return self.cuda.get_rng_state(index)

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        self.cuda.set_rng_state(state, index)

    def new_rng_state(self, index: int, seed: int) -> torch.Tensor:
        return self.torch.Generator(device=self.torch_device(index)).manual_seed(seed).get_state()


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device, non_blocking=True)``, staged through pinned memory for pageable host tensors (CUDA would otherwise
    wait per tensor); the caching host allocator keeps the block until the copy has read it."""
    rt = _runtime
    if t.device.type == "cpu" and not t.is_sparse and t.numel() and rt.is_device(device) \
            and not rt.torch.Tensor.is_pinned(t):
        t = rt.torch.Tensor.pin_memory(t)
    return t.to(device, non_blocking=True)


_runtime: Any = TorchCuda()


def runtime() -> Any:
    """The CUDA runtime in use: the real one, or a simulated one inside ``cgdp.testing.simulated_cuda``."""
    return _runtime


@contextlib.contextmanager
def use_runtime(rt: Any):
    """Devices created inside use ``rt`` (for ``cgdp.testing``)."""
    global _runtime
    old, _runtime = _runtime, rt
    try:
        yield rt
    finally:
        _runtime = old

