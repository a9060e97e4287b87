"""Every blocking wait of the host on a simulated device, counted by thread and kind.

Part of :mod:`cgdp.testing.cuda_sim`. On a GPU the host blocks in four ways, and each costs a
step its overlap: the simulator counts each under the name of the thread that waited
(``SimulatedCuda.host_syncs()``, a ``collections.Counter`` of ``(thread name, kind)``):

* ``"synchronize"``: ``Event.synchronize`` (except an arrival, below), ``Stream.synchronize``,
  ``torch.cuda.synchronize``, and a blocking host-to-device copy from page-locked memory.
* ``"read"``: the host reads device data: ``.item()``, ``float()``/``int()``/``bool()``,
  ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")`` without ``non_blocking``, ``torch.equal``,
  a copy into pageable host memory (``copy_``, and one per tensor of a ``_foreach_copy_``), a
  blocking copy to the host, ``torch.tensor(..., device=cuda)``, and every operator whose CUDA
  kernel reads the device (``nonzero``, boolean masks, ``unique``…:
  :func:`cgdp.testing.sim_kernels.host_waits`). A read counted by name counts once, whatever
  operators it runs; a dtype cast that names no other device stays on its device and reads nothing.
* ``"pageable"``: a host-to-device copy from pageable host memory: CUDA stages it through a
  page-locked buffer of its own and returns only when the data has been staged, even with
  ``non_blocking=True``.
* ``"arrival"``: the host waits on an event recorded on one of cgdp's copy streams (the host sum
  waiting for a chunk's copy, or for a copy back to have read a ring slot): the one wait the
  design needs.

To tell device data from host data, simulated device memory is tracked by storage: a simulated
device's ``torch.device`` is ``torch.device("cpu", index)`` (its tensors live in host memory, and
report that device as theirs, as a CUDA tensor reports ``cuda:N``, except to torch's own Python
code, to which they are the host tensors they are), a
torch function mode on every thread that uses the runtime marks what is created on, or moved
to, such a device, and the dispatch mode marks whatever an operator computes from device data.
A mark lasts as long as its storage holds those bytes: when the storage is freed, its address
goes back to the host's allocator, and a host tensor made there by a call the modes do not see
as an allocation (``torch.tensor(0)``, as BatchNorm makes ``num_batches_tracked``;
``torch.from_numpy``) is host memory, not the freed device storage.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections import Counter
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["HostSyncs", "KINDS"]

KINDS = ("synchronize", "read", "pageable", "arrival")

T = torch.Tensor
_DEVICE = T.device
_READS = {T.item, T.__float__, T.__int__, T.__bool__, T.__index__, T.__complex__, T.tolist, T.numpy,
          T.__array__, T.__format__, T.__repr__, T.equal, T.allclose, torch.equal, torch.allclose}
"""Torch calls that hand device data to the host (each waits for it on a GPU)."""
_UPLOADS = {torch.tensor, torch.as_tensor, T.new_tensor}
_GROUPED_BY_DEVICE = {"torch.nn.utils.clip_grad"}
"""torch modules whose moves go to devices from ``_group_tensors_by_device_and_dtype`` (C++, so ``cpu`` here)."""
_SEEN: dict[int, torch.device] = {}
"""Per simulated device, the ``cpu`` device object torch's own code reads from its tensors' ``.device``."""
_SEEN_INDEX: dict[int, int] = {}
"""``id`` of each object of :data:`_SEEN` → its simulated device (the objects live as long as the module)."""


def _seen_by_torch(index: int) -> torch.device:
    """``cpu``, as torch's code must see it, but one object per simulated device: a device torch's code read from a
    tensor and passes on (``norm.to(first_device)``) names that device, as ``cuda:N`` would on a GPU."""
    view = _SEEN.get(index)
    if view is None:
        view = _SEEN[index] = torch.device("cpu")
        _SEEN_INDEX[id(view)] = index
    return view
"""Creation from host data with ``device=``: a blocking copy from pageable memory."""


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() if not t.is_sparse else None
    except (RuntimeError, NotImplementedError):
        return None


class HostSyncs:
    """The counts, which storages are simulated device memory, and which are page-locked."""

    def __init__(self, pinned_range: Any, freed: Any = None):
        """``pinned_range(ptr)``: the registered range holding ``ptr``, if any; ``freed(lo, hi)``:
        page-locked bytes of :meth:`pin_memory` went back to the allocator."""
        self.counts: Counter = Counter()
        self._device: dict[int, tuple[int, Any]] = {}
        """Storage data pointer → the simulated device it lives on, and a weak reference to the
        storage that was placed there (the mark ends with it: :meth:`device_of`)."""
        self.pinned: set[int] = set()
        """Storage data pointers of page-locked staging memory (``pin_memory()``)."""
        self._pinned_range = pinned_range
        self._freed = freed
        self.backwards: set = set()
        self.run_backward: Any = None
        self.synced: Any = None
        """``synced(device)``: the host waited for the device's current stream (a blocking copy)."""
        """Runs ``backward`` / ``autograd.grad`` (the simulator's autograd device threads)."""
        self._lock = threading.Lock()
        self._here = threading.local()
        """Per thread: ``reading`` (inside a read counted here, whose operators count nothing more)
        and ``to_host`` (inside a move to the host: its ``_to_copy`` leaves the device)."""
        self.mode = SyncMode(self)

    def count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.counts[(threading.current_thread().name, kind)] += n

    def reading(self) -> bool:
        """Whether this thread is inside a read already counted (``.item()``, ``repr``, ``.cpu()``):
        the operators it runs are that read, not waits of their own."""
        return getattr(self._here, "reading", False)

    def moving_to_host(self) -> bool:
        """Whether this thread is inside a move of device data to the host (``.cpu()``,
        ``.to("cpu")``): any other ``_to_copy`` that names no other device stays on its device."""
        return getattr(self._here, "to_host", False)

    @contextlib.contextmanager
    def within(self, **flags: bool) -> Iterator[None]:
        """This thread's calls inside run with ``flags`` (``reading``, ``to_host``) set."""
        here = self._here
        before = {k: getattr(here, k, False) for k in flags}
        for k, v in flags.items():
            setattr(here, k, v)
        try:
            yield
        finally:
            for k, v in before.items():
                setattr(here, k, v)

    @staticmethod
    def index(device: Any) -> int | None:
        """The simulated device a ``device=`` argument names (None: the host, or not a device)."""
        if isinstance(device, torch.device) and device.type == "cpu":
            return _SEEN_INDEX.get(id(device), device.index)
        return None

    def device_of(self, t: Any) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        key = _storage(t)
        entry = None if key is None else self._device.get(key)
        if entry is None:
            return None
        index, ref = entry
        if ref is not None and ((st := ref()) is None or st.data_ptr() != key):
            return None  # that storage was freed (or moved its bytes): the address is the host's now
        return index

    def place(self, out: Any, index: int | None) -> None:
        """Every tensor of ``out`` lives on simulated device ``index`` (None: in host memory), for
        as long as its storage holds those bytes."""
        for t in pytree.tree_leaves(out):
            key = _storage(t) if isinstance(t, torch.Tensor) else None
            if key is None:
                continue
            with self._lock:
                if index is None:
                    self._device.pop(key, None)
                else:
                    self._device[key] = (index, self._watch(t.untyped_storage(), key))
                    self.pinned.discard(key)

    def _watch(self, storage: Any, key: int) -> Any:
        """A weak reference to the storage at ``key`` whose death ends its mark (None for an
        empty storage: every one of them is at address 0, and none has bytes to reuse)."""
        if key == 0:
            return None
        marks = self._device

        def freed(ref: Any) -> None:  # (no lock: it may run inside a locked section, at a collection)
            if marks.get(key, (None, None))[1] is ref:
                marks.pop(key, None)
        return weakref.ref(storage, freed)

    def is_pinned(self, t: torch.Tensor) -> bool:
        """As torch computes it: whether the storage's first byte is page-locked host memory."""
        if self.device_of(t) is not None:
            return False
        key = _storage(t)
        if key is None:
            return False
        return key in self.pinned or self._pinned_range(key) is not None

    def locked(self, t: torch.Tensor) -> bool:
        """Whether a copy of ``t`` reads or writes page-locked bytes (CUDA asks about the address
        the copy uses, unlike :meth:`is_pinned`)."""
        if self.device_of(t) is not None or _storage(t) is None:
            return False  # (a sparse tensor has no storage of its own to be page-locked)
        return _storage(t) in self.pinned or (t.numel() > 0 and self._pinned_range(t.data_ptr()) is not None)

    def computed(self, inputs: list[torch.Tensor], fresh: list[torch.Tensor], dest: int | None = None) -> None:
        """An operator made ``fresh`` from ``inputs``: on ``dest`` (a copy's ``device=``), else on
        the device of its first device input."""
        index = dest if dest is not None else next((i for t in inputs if (i := self.device_of(t)) is not None), None)
        self.place(fresh, index)

    def pin_memory(self, t: torch.Tensor) -> torch.Tensor:
        """``Tensor.pin_memory()`` (torch's caching host allocator): a page-locked copy."""
        if self.device_of(t) is not None:
            return t  # (torch refuses a CUDA tensor; the backend asks only of host tensors)
        out = aligned_as(t, t.clone())  # (differentiable, as torch's pin_memory)
        self.place(out, None)
        return self.mark_pinned(out)

    def mark_pinned(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` is a block of torch's caching host allocator (page-locked)."""
        key = _storage(out)
        self.pinned.add(key)
        # freed when the last tensor of it goes (a queued copy holds its operands: torch's caching
        # host allocator reuses a block only after the copies recorded on it ran); the address may
        # then be pageable memory
        weakref.finalize(out, self._unpin, key, out.untyped_storage().nbytes())
        return out

    def _unpin(self, key: int, nbytes: int) -> None:
        with self._lock:
            self.pinned.discard(key)
        if self._freed is not None:
            self._freed(key, key + nbytes)


def aligned_as(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (a fresh copy of ``src``) at the same address modulo 64 as ``src``: CPU kernels
    (oneDNN, MKL) may take other paths for other alignments, and a copy that moved a slice of a
    batch to an aligned address would differ from the reference on the slice in the last bit."""
    if _storage(src) is None or _storage(out) is None or out.numel() == 0 \
            or not (src.is_contiguous() and out.is_contiguous()):
        return out
    size = out.element_size()
    shift = (src.data_ptr() - out.data_ptr()) % 64
    if shift == 0 or shift % size:
        return out
    raw = torch.empty(out.numel() + 64 // size, dtype=out.dtype)
    k = ((src.data_ptr() - raw.data_ptr()) % 64) // size
    moved = raw[k:k + out.numel()].view(out.shape)
    moved.copy_(out)  # (recorded by autograd where ``out`` requires grad: the copy stays in the graph)
    return moved


def _from_torch(frame: Any) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name == "torch" or name.startswith("torch.")


def _on_host(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``Tensor.to``'s arguments with a named device replaced by the host: torch's own answer to a
    move that stays on its device (the tensor itself, unless a dtype, layout or copy asks more)."""
    def host(a: Any) -> Any:
        return torch.device("cpu") if isinstance(a, (torch.device, str)) else a
    return tuple(host(a) for a in args), {k: host(v) if k == "device" else v for k, v in kwargs.items()}


def _to_args(args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """``Tensor.to``'s target device (None: unchanged) and ``non_blocking``."""
    device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    return device, bool(non_blocking)


class SyncMode(TorchFunctionMode):
    """Marks device memory and counts the host's reads and uploads, on one thread's torch calls."""

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs
        self.enabled = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.enabled:
            return func(*args, **kwargs)
        s = self.syncs
        if getattr(func, "__self__", None) is _DEVICE and func.__name__ == "__get__":
            # a simulated device's tensor reports its device, ``cpu:N``, as a CUDA tensor reports
            # ``cuda:N`` (so ``x.to(t.device)`` stays on the device, and ``out.device`` equals
            # ``model.output_device``); to torch's own Python code, "cpu": its functions compare
            # and make tensors in the host memory the tensor really lives in
            index = s.device_of(args[0])
            if index is None:
                return func(*args, **kwargs)
            return _seen_by_torch(index) if _from_torch(sys._getframe(1)) else torch.device("cpu", index)
        if func in s.backwards and s.run_backward is not None:
            return s.run_backward(func, args, kwargs)
        if func in _READS:
            devices = [d for a in args[:2] if (d := s.device_of(a)) is not None]
            if devices and not s.reading():
                s.count("read")
                for d in dict.fromkeys(devices):
                    if s.synced is not None:
                        s.synced(d)  # the host waits for the data (``.tolist()``: a blocking copy on a GPU)
            with s.within(reading=True):  # (``repr`` indexes with a mask, ``allclose`` reads: one read)
                return func(*args, **kwargs)
        if func is T.to or func is T.cpu:
            device, non_blocking = (_to_args(args, kwargs) if func is T.to else (torch.device("cpu"), False))
            if device is None:
                return func(*args, **kwargs)
            named = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, torch.device)]
            target = s.index(named[0] if named else device)
            if func is T.to and len(args) > 1 and isinstance(args[1], torch.Tensor):
                target = s.device_of(args[1])  # ``x.to(other)``: other's device and dtype
            if (named and target is None and named[0].type == "cpu" and id(named[0]) not in _SEEN_INDEX
                    and sys._getframe(1).f_globals.get("__name__") in _GROUPED_BY_DEVICE):
                # torch's clipping moves each norm and the coefficient to the devices its C++ grouped the
                # gradients by, which it sees as "cpu": a move there keeps a tensor on its device, as
                # .to(cuda:N) does on a GPU. Anywhere else (Module.to, AveragedModel, a name) it reads
                target = s.device_of(args[0])
            if s.device_of(args[0]) == target:  # no move: torch's answer (``x.to(x.device) is x``)
                host_args, host_kwargs = _on_host(args, kwargs)
                out = func(*host_args, **host_kwargs)
                if out is not args[0]:
                    s.place(out, target)
                return out
            if target is None and s.device_of(args[0]) is not None:
                with s.within(to_host=True):  # (the one ``_to_copy`` that leaves the device)
                    out = func(*args, **kwargs)
            else:
                out = func(*args, **kwargs)
            return self._move(args[0], target, non_blocking, out)
        if func is T.copy_:
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            self._copy(s.device_of(src), s.device_of(dst), src, dst, non_blocking)
            return func(*args, **kwargs)
        if func is torch._foreach_copy_:
            # between the host and a device torch runs one ``copy_`` per tensor (the lists share no
            # device: ForeachBinaryOpList.cu's slow path), each blocking one a memcpy_and_sync
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            for dst, src in zip(args[0], args[1]):
                self._copy(s.device_of(src), s.device_of(dst), src, dst, non_blocking)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        index = s.index(kwargs.get("device"))
        if index is not None:
            if func in _UPLOADS:
                s.count("read")
            s.place(out, index)
        return out

    def _copy(self, src_dev: int | None, dst_dev: int | None, src: torch.Tensor, dst: torch.Tensor,
              non_blocking: bool) -> None:
        s = self.syncs
        if src_dev is not None and dst_dev is None and not (non_blocking and s.locked(dst)):
            s.count("read")  # into pageable memory, or a blocking copy: the host waits for the data
        elif src_dev is None and dst_dev is not None:
            if not s.locked(src):
                s.count("pageable")
            elif not non_blocking:
                s.count("synchronize")

    def _move(self, t: torch.Tensor, target: int | None, non_blocking: bool, out: Any) -> Any:
        s = self.syncs
        source = s.device_of(t)
        if target is None:
            if not non_blocking:  # (non_blocking: torch copies into page-locked memory it allocates)
                s.count("read")
        else:
            self._copy(source, target, t, t, non_blocking)
        if isinstance(out, torch.Tensor) and _storage(out) is not None and _storage(out) == _storage(t):
            out = out.clone()  # on a GPU a move is a copy (differentiable, as torch's): the host
            # data and the device data differ
        if isinstance(out, torch.Tensor):
            out = aligned_as(t, out)
        s.place(out, target)
        if target is None and isinstance(out, torch.Tensor):
            if non_blocking:
                s.mark_pinned(out)  # torch's move to the host, non_blocking: into page-locked memory
            elif s.synced is not None:
                s.synced(source)  # a blocking copy: the host waited for the device's stream
        return out
