"""Page-locked host memory and the thread's last error, as the simulated CUDA runtime keeps them.

What cgdp's CUDA backend asks of libcudart directly (through ``torch.cuda.cudart()`` and ctypes):
``cudaHostRegister``, ``cudaHostUnregister``, ``cudaGetErrorString`` and ``cudaGetLastError``.
:class:`PageLockedMemory` answers those calls for :class:`cgdp.testing.cuda_sim.SimulatedCuda` (a
mixin: the runtime calls :meth:`~PageLockedMemory._init_page_locked` from its constructor), at least
as strictly as CUDA:

* ``cudaHostRegister`` pins whole pages of ``page_size`` bytes; a range that shares a page with a
  registered one is refused (``cudaErrorHostMemoryAlreadyRegistered``, 712), a size of 0 or less
  is invalid (1), and registering beyond ``lockable_bytes`` (``ulimit -l``) is out of memory (2).
* ``cudaHostUnregister`` takes only the base of a registered range (else 713); it tells the
  ordering checker that the range is released and poisons its bytes (0xFF: NaN in floats).
* A failed call sets the calling thread's last error: ``cudaGetLastError`` returns and clears it,
  and the thread's next kernel launch raises it if still set (:meth:`_launch_check`, as
  ``C10_CUDA_KERNEL_LAUNCH_CHECK`` does). After a sticky error every call fails with 700.
* An asynchronous copy notes the registered ranges it uses when issued; if one is no longer
  registered when it runs, it fails with an illegal-address error and poisons its destination
  (:meth:`_check_registered`).

From the runtime it uses ``errors`` (the sticky errors), ``need_context``, ``_tls()`` (whose
``last_error`` is the thread's last error), ``_lock``, ``counts`` and ``checker``.
"""
from __future__ import annotations

import ctypes
import types

import torch

from cgdp.testing.stream_check import tensor_bytes

ERRORS = {1: "invalid argument", 2: "out of memory", 700: "an illegal memory access was encountered",
          712: "part or all of the requested memory range is already mapped",
          713: "pointer does not correspond to a registered memory region"}
"""The cudaError_t codes the simulator returns, with CUDA's messages."""


class PageLockedMemory:
    """The simulated runtime's page-locked host memory, its libcudart calls and last errors."""

    def _init_page_locked(self, page_size: int, lockable_bytes: int | None) -> None:
        self.page_size = page_size
        self.lockable_bytes = lockable_bytes
        """Limit of page-locked bytes (``ulimit -l``); None: no limit."""
        self.registered: dict[int, int] = {}
        """Page-locked host ranges: address → bytes."""
        self._pages: set[int] = set()
        self.cudart = types.SimpleNamespace(
            cudaHostRegister=self._host_register, cudaHostUnregister=self._host_unregister,
            cudaGetErrorString=lambda error: ERRORS.get(int(error), f"error {int(error)}"),
            cudaError=types.SimpleNamespace(success=0))
        self.native = types.SimpleNamespace(cudaGetLastError=self._get_last_error)
        """What the backend loads from libcudart with ctypes."""

    def _error(self, code: int) -> int:
        self._tls().last_error = code
        return code

    def _get_last_error(self) -> int:
        t = self._tls()
        code, t.last_error = t.last_error, 0
        return code

    def _launch_check(self) -> None:
        """C10_CUDA_KERNEL_LAUNCH_CHECK: cudaGetLastError after each launch."""
        t = self._tls()
        if t.last_error:
            code, t.last_error = t.last_error, 0
            raise RuntimeError(f"CUDA error: {ERRORS.get(code, code)} (simulated: left set by an "
                               f"earlier call on this thread)")

    def _host_register(self, ptr: int, size: int, flags: int) -> int:
        if self.errors:
            return self._error(700)
        self.need_context(None, "cudaHostRegister")
        if size <= 0:
            return self._error(1)
        p = self.page_size
        pages = set(range(ptr // p, (ptr + size - 1) // p + 1))
        with self._lock:
            if pages & self._pages:
                return self._error(712)
            if self.lockable_bytes is not None and sum(self.registered.values()) + size > self.lockable_bytes:
                return self._error(2)
            self._pages |= pages
            self.registered[ptr] = size
            self.counts["host_register"] += 1
        return 0

    def _host_unregister(self, ptr: int) -> int:
        if self.errors:
            return self._error(700)
        self.need_context(None, "cudaHostUnregister")
        with self._lock:
            size = self.registered.pop(ptr, None)
            if size is None:
                return self._error(713)
            p = self.page_size
            self._pages -= set(range(ptr // p, (ptr + size - 1) // p + 1))
            self.counts["host_unregister"] += 1
        self.checker.host_release(ptr, ptr + size, "cudaHostUnregister of page-locked host memory")
        ctypes.memset(ptr, 0xFF, size)  # poisoned: a copy still using it reads NaN
        return 0

    def _registered_range(self, t: torch.Tensor) -> tuple[int, int] | None:
        rng = tensor_bytes(t)
        if rng is None:
            return None
        for a, n in list(self.registered.items()):
            if a <= rng[0] < a + n:
                return a, n
        return None

    def _check_registered(self, host: list[tuple[int, int] | None], dst: torch.Tensor, stream: str) -> None:
        """When a copy on ``stream`` runs: the ranges it used when issued (:meth:`_registered_range`
        of each operand) must still be registered, else it fails and poisons ``dst``."""
        for rng in host:
            if rng is not None and self.registered.get(rng[0]) != rng[1]:
                _poison(dst)
                raise RuntimeError(f"{ERRORS[700]} (simulated: a copy on {stream} used page-locked "
                                   f"host memory after cudaHostUnregister)")


def _poison(t: torch.Tensor) -> None:
    rng = tensor_bytes(t)
    if rng is not None and t.is_contiguous():
        ctypes.memset(rng[0], 0xFF, rng[1] - rng[0])
