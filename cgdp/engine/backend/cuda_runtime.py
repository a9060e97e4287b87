"""The CUDA runtime: :class:`TorchCuda`, the one object through which cgdp calls ``torch.cuda``.

Part of the CUDA backend, beneath the devices of :mod:`cgdp.engine.backend.cuda`, and the only module of cgdp that
touches ``torch.cuda`` (and libcudart, for the calls ``torch.cuda.cudart()`` lacks). Every method of ``TorchCuda`` is
one ``torch.cuda`` call (or two): streams, events, stream contexts, asynchronous copies, page-locked host memory,
coalesced reduce and broadcast, the devices' random generators. ``cgdp.testing``'s simulated runtime sits *beneath*
``TorchCuda`` (fakes of ``torch.cuda`` with torch's signatures, passed as ``torch_module``), so CI runs every line of
this module; :func:`use_runtime` sets the runtime that devices created inside use (the simulated one,
``cgdp.testing.null_cuda``'s, or a wrapper of the real one).

* A stream context makes the stream's device current first (a device guard): a thread that never chose a device creates
  no context on GPU 0. Host memory is registered with the current device's context, so callers register inside such a
  guard (``CudaDevice.host_empty`` does).
* Host memory is an ordinary allocation registered with ``cudaHostRegister`` on pages of its own (the host's page size:
  64 KiB on some arm64 hosts), exactly the bytes needed, unlike the caching host allocator, which rounds
  ``pin_memory=True`` up to a power of two and keeps it. A failed registration or unregistration raises a clear error
  and clears the thread's last CUDA error, so that no later kernel launch reports it as its own.
"""
from __future__ import annotations

import contextlib
import importlib
import mmap
import os
from typing import Any, Callable, Iterator, Sequence

import torch


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
    """The libcudart this process already loaded (for ``cudaGetLastError``, which ``torch.cuda.cudart()`` does not
    expose), or None."""
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
    """The CUDA runtime, as cgdp uses it. Every method is one ``torch.cuda`` call (or two).

    ``torch_module`` is ``torch`` on a GPU; ``cgdp.testing.simulated_cuda`` passes :mod:`cgdp.testing.fake_cuda`'s
    namespaces (torch 2.13's signatures over a simulated runtime), so that this class's own code runs in CI. ``native``
    loads libcudart for the calls ``torch.cuda.cudart()`` lacks; ``page_size`` is the host's."""

    simulated = False

    def __init__(self, torch_module: Any = torch, native: Callable[[], Any] = _load_cudart,
                 page_size: int | None = None):
        if torch_module is torch:  # submodules torch.cuda does not import itself
            importlib.import_module("torch.cuda.comm")
            importlib.import_module("torch.cuda.nccl")
        self.torch = torch_module
        self.cuda = torch_module.cuda
        self._native = native
        self.page_size = page_size or host_page_size()

    def device_count(self) -> int:
        return self.cuda.device_count() if self.cuda.is_available() else 0

    def torch_device(self, index: int) -> torch.device:
        return self.torch.device("cuda", index)

    def is_device(self, device: Any) -> bool:
        """Whether ``device`` (a ``torch.device``) is one of this runtime's devices."""
        if not isinstance(device, torch.device) or device.index is None:
            return False
        return device.type == self.torch_device(device.index).type

    def Stream(self, index: int) -> Any:  # noqa: N802 (mirrors torch.cuda.Stream)
        with self.cuda.device(index):
            return self.cuda.Stream(index)

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> Any:  # noqa: N802
        return self.cuda.Event(enable_timing=enable_timing, blocking=blocking)

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        # the stream's device is made current first (a device guard: restored lazily, without cudaSetDevice on a device
        # that has no context). A bare torch.cuda.stream(s) on a thread that never chose a device would leave through
        # set_stream(device 0's stream), i.e. cudaSetDevice(0): a CUDA context on GPU 0 for a process that uses another
        # GPU.
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
        """An asynchronous copy (or cast) on the current stream."""
        dst.copy_(src, non_blocking=True)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory of exactly ``numel`` elements, on pages of its own (the registration pins whole
        pages: one shared with another allocation would make that one's registration fail). Register under a guard of
        the device whose context should own it."""
        page = self.page_size
        itemsize = torch.tensor([], dtype=dtype).element_size()
        nbytes = max(numel, 1) * itemsize
        span = -(-nbytes // page) * page
        raw = self.torch.empty(span + page, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % page
        buf = raw[skip:skip + nbytes]
        err = int(self.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0))
        if err != 0:
            self._clear_last_error()
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**20:.1f} MiB of host memory failed "
                               f"(CUDA error {err}: {_CUDA_ERRORS.get(err, 'see cudaError_t')})")
        return buf.view(dtype)[:numel]  # a view of ``raw``'s storage, which it keeps alive

    def host_free(self, t: torch.Tensor) -> None:
        err = int(self.cuda.cudart().cudaHostUnregister(t.data_ptr()))
        if err != 0:
            self._clear_last_error()
            raise RuntimeError(f"cudaHostUnregister of cgdp's host rows failed (CUDA error {err}: "
                               f"{_CUDA_ERRORS.get(err, 'see cudaError_t')})")

    def _clear_last_error(self) -> None:
        """A failed runtime call leaves the thread's last error set, and the next kernel launch on this thread would
        raise it as its own (``C10_CUDA_KERNEL_LAUNCH_CHECK``): clear it."""
        lib = self._native()
        if lib is not None:
            lib.cudaGetLastError()

    def reduce_into_first(self, tensors: Sequence[torch.Tensor]) -> None:
        """``tensors[0]`` += the others, one tensor per distinct device: one in-place NCCL reduce where NCCL is
        available (what ``torch.cuda.comm.reduce_add`` does, without its new output tensor), else copies to the first
        device and adds in device order."""
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
    """``t.to(device, non_blocking=True)``, staged through page-locked memory when ``t`` is pageable host memory and
    ``device`` a CUDA device: from pageable memory CUDA stages the copy itself and returns only once it is staged, a
    host wait per tensor. ``pin_memory()`` takes the block from torch's caching host allocator, which records the copy's
    stream and reuses the block only after the copy has read it, so the staging copy may be dropped at once."""
    rt = _runtime
    if t.device.type == "cpu" and not t.is_sparse and t.numel() and rt.is_device(device) \
            and not rt.torch.Tensor.is_pinned(t):
        t = rt.torch.Tensor.pin_memory(t)
    return t.to(device, non_blocking=True)


_REAL = TorchCuda()
_runtime: Any = _REAL


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

