"""A strict simulated CUDA runtime beneath cgdp's CUDA backend, so CI runs that backend without a GPU.

Inside ``with cgdp.testing.simulated_cuda(2) as sim:``, ``"cuda:0"`` and ``"cuda:1"`` are CUDA
devices: the engine builds :class:`cgdp.engine.backend.cuda.CudaDevice` objects over the real
:class:`~cgdp.engine.backend.cuda_runtime.TorchCuda`, whose ``torch.cuda`` is
:mod:`cgdp.testing.fake_cuda` (torch 2.13's signatures) over this runtime. It is at least as strict as CUDA wherever a
difference could hide a defect:

* **Asynchrony.** Every stream is an in-order worker thread that sleeps a random (seeded) time
  before each item, so completions on different streams and devices come in varying orders. A
  ``copy_(..., non_blocking=True)`` issued on a side stream runs on that stream's worker, later:
  a copy that is not ordered reads or writes at the wrong time and the result is wrong. So does
  a ``non_blocking`` copy between page-locked host memory and a device on a *default* stream
  (``copy_``, or a move ``.to(device, non_blocking=True)`` from page-locked memory): the host runs
  ahead of it, and writing its source or reading its destination before a synchronisation is
  wrong as on a GPU. The host's own kernels on page-locked memory are checked as a stream of
  their own (``stream_check.HOST``), ordered only by what the host waited for (a synchronize, an
  event's synchronize, a query that returned True).
* **The compute stream.** PyTorch's CPU kernels run when issued (an infinitely fast GPU), after
  the copies queued before them on that stream (a physical hold, no knowledge); events
  recorded on a default stream complete on its worker after a random lag, and :meth:`busy` or
  ``torch.cuda._sleep`` put device time there. A default stream's ``wait_event`` must hold the
  issuing thread until the event completes (the kernels after it run on the host at once); that
  hold gives the host no knowledge: every check below treats the wait as device-side, as CUDA does.
* **Ordering checks** (:mod:`cgdp.testing.stream_check`): the fakes fire torch's own GPU trace
  callbacks, and a dispatch mode records every kernel's bytes on the stream it runs on
  (:mod:`cgdp.testing.sim_kernels`: the issuing thread's current stream of its tensors' device;
  copies between devices with Copy.cu's two barriers; blocking copies and host reads synchronise
  their stream), on every thread: the modes are pushed on each thread started while the simulator
  is active (``threading.setprofile``) and on any other that calls ``torch.cuda``, so a thread
  that never chose a device (the caller's buffer zeroing and relays, a user's optimizer step) is
  checked too. Streams are keyed by (device, handle): every default stream is handle 0. A race
  between streams, a block of the caching allocator reused while
  another stream may still use it, or page-locked memory unregistered while a copy may still use
  it, is a :class:`~cgdp.testing.stream_check.StreamRaceError`, raised at the next host
  synchronisation (or when the ``with`` block ends): a wrong order fails even when the random
  delays happen to hide it.
* **Page-locked memory** (:mod:`cgdp.testing.page_locked`, a mixin of :class:`SimulatedCuda`):
  ``cudaHostRegister`` pins whole pages (``page_size``: the OS's, or 4 KiB / 64 KiB as asked) and
  refuses a range sharing a page with a registered one (712), setting the thread's last error,
  which its next kernel launch raises unless cleared; ``cudaHostUnregister`` poisons the bytes,
  and a copy that runs after it fails with an illegal-address error.
* **Autograd's device threads** (:mod:`cgdp.testing.sim_autograd`). A backward whose roots live
  on one simulated device runs, hooks included, on that device's thread (``pt_autograd_d``), with
  its own thread-locals and current device, while the caller waits: two devices' backwards run
  their hooks at once. (A graph spanning devices runs on the thread of its roots' device.)
* **Devices and contexts.** Each thread has its own current device (c10's bookkeeping, lazy
  ``MaybeSetDevice`` included). A call that needs a context creates the primary context of the
  thread's current device, which is device 0 for a thread that never chose one; ``sim.contexts``
  records every context created, by whom.
* **Sticky errors.** An exception on a stream (or :meth:`inject_error`) is sticky: every later
  call fails, as after an illegal memory access on a GPU.
* **Streams and events as torch hands them out.** ``torch.cuda.Stream()`` takes a stream from a
  pool of 32 per device, round-robin (the 33rd is the 1st again); an event recorded on another
  device's stream than its first record's is refused, as ``CUDAEvent::record`` refuses it.
* **Host waits.** Every blocking wait of the host is counted by thread and kind
  (:meth:`host_syncs`, :mod:`cgdp.testing.host_syncs`), which needs device data told from host
  data: a simulated device is ``torch.device("cpu", N)`` (its tensors' ``.device`` outside torch's
  own code), and its memory is tracked by storage; a move to it is a copy autograd records.

``sim.counts`` counts what the backend asked of the runtime (events, contexts, copies, host waits,
spin waits on non-blocking events, device synchronisations, coalesced collectives), so tests can
check costs as well as results. What it cannot show: kernel timing, races inside PyTorch's own
CUDA kernels, real PCIe behaviour (see docs/cuda.md). A model part on a stream of its own, for
tests of gradients produced on a side stream, is :class:`cgdp.testing.side_stream.SideStream`.
"""
from __future__ import annotations

import contextlib
import ctypes
import queue
import random
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator

import torch

from cgdp.testing import fake_cuda
from cgdp.testing.host_syncs import HostSyncs
from cgdp.testing.page_locked import PageLockedMemory
from cgdp.testing.sim_autograd import BACKWARDS, AutogradThreads
from cgdp.testing.sim_kernels import KernelMode
from cgdp.testing.page_locked import _poison
from cgdp.testing.stream_check import HOST, StreamChecker, StreamRaceError, on_new_threads, stream_key

__all__ = ["simulated_cuda", "SimulatedCuda"]


class SimulatedCuda(PageLockedMemory):
    """The simulated runtime's state; :attr:`runtime` is the backend's ``TorchCuda`` over it."""

    simulated = True

    def __init__(self, num_devices: int, seed: int = 0, max_delay_s: float = 0.002,
                 timeout_s: float = 60.0, page_size: int | None = None, nccl: bool = True,
                 lockable_bytes: int | None = None):
        from cgdp.engine.backend.cuda_runtime import TorchCuda, host_page_size
        if num_devices < 1:
            raise ValueError(f"simulated_cuda needs at least one device, got {num_devices}")
        self.num_devices = num_devices
        self.seed = seed
        self.max_delay_s = max_delay_s
        self.timeout_s = timeout_s
        self._init_page_locked(page_size or host_page_size(), lockable_bytes)
        self.nccl = nccl
        self.clock = time.perf_counter
        self.counts: Counter = Counter()
        self.copied_bytes: Counter = Counter()
        """Bytes moved by asynchronous copies on side streams, by direction ('d2h', 'h2d', 'd2d');
        those queued on a default stream (``non_blocking`` from page-locked memory) count in
        ``counts['queued_copies']``."""
        self.contexts: dict[int, str] = {}
        """Device → who created its primary context (thread name and the call)."""
        self.thread_devices: dict[str, set[int]] = {}
        """Thread name → the devices it made a call on."""
        self.errors: list[BaseException] = []
        """Sticky errors: once there is one, every call fails."""
        self.violations: list[StreamRaceError] = []
        self._reported = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._streams: list[Any] = []
        self._by_id: dict[tuple[int, int], Any] = {}
        self._workers: set[threading.Thread] = set()
        self._side: dict[int, Any] = {}
        self._pool: dict[int, list[Any]] = {}
        self._handed: dict[int, int] = {}
        self._events = 0
        self.checker = StreamChecker(self._stream_name)
        self.checker.on_error = self.violations.append
        self.mode = KernelMode(self)
        self.syncs = HostSyncs(self._pinned_at, lambda lo, hi: self.checker.forget([(lo, hi)]))
        self.autograd = AutogradThreads(self)
        self.syncs.backwards, self.syncs.run_backward = BACKWARDS, self.autograd.run
        self.syncs.synced = lambda d: self.mode.synchronize(self.current_stream(d))
        self.mode.on_fresh = lambda inputs, fresh: self.syncs.computed(inputs, fresh, self._take_dest())
        self.torch, self.cuda = fake_cuda.namespaces(self)
        self._default = [self.new_stream(fake_cuda.Stream, i, compute=True) for i in range(num_devices)]
        self.runtime = TorchCuda(self.torch, native=lambda: self.native, page_size=self.page_size)

    # ---------------------------------------------------------------- threads, devices, contexts
    def _tls(self) -> Any:
        loc = self._local
        if not hasattr(loc, "device"):
            loc.device, loc.target, loc.streams, loc.last_error = 0, -1, {}, 0
        return loc

    def check(self) -> None:
        """Every call: a sticky error fails it; the calling thread's kernels are recorded from now on."""
        if self.errors:
            raise RuntimeError(f"CUDA error: {self.errors[0]} (simulated; sticky: every later call "
                               f"fails)") from self.errors[0]
        self._watch()

    def _watch(self) -> None:
        """The calling thread's kernels are recorded, and its torch calls watched, from now on."""
        self.checker.watch_thread(self.mode)
        loc = self._local
        if not getattr(loc, "syncing", False):
            _push_function_mode(self.syncs.mode)
            loc.syncing = True

    # ---------------------------------------------------------------- host waits
    def host_syncs(self) -> Counter:
        """Every blocking wait of the host since the simulator started or :meth:`reset_host_syncs`:
        a Counter of (thread name, kind), kinds ``"synchronize"``, ``"read"``, ``"pageable"`` and
        ``"arrival"`` (:mod:`cgdp.testing.host_syncs`)."""
        with self.syncs._lock:
            return Counter(self.syncs.counts)

    def reset_host_syncs(self) -> None:
        with self.syncs._lock:
            self.syncs.counts.clear()

    def _pinned_at(self, ptr: int) -> int | None:
        return next((a for a, n in list(self.registered.items()) if a <= ptr < a + n), None)

    def _valid(self, index: int) -> int:
        if not 0 <= index < self.num_devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal (simulated: cuda:{index} does not "
                               f"exist, {self.num_devices} device(s))")
        return index

    def need_context(self, index: int | None, what: str, work: bool = True) -> None:
        """A call that needs a context on ``index`` (None: the thread's current device), which
        creates that device's primary context if it has none; ``work``: a call that works on the
        device (not only makes it current), noted in :attr:`thread_devices`."""
        d = self.current_device() if index is None else index
        name = threading.current_thread().name
        with self._lock:
            if work:
                self.thread_devices.setdefault(name, set()).add(d)
            if d not in self.contexts:
                self.contexts[d] = f"{name}: {what}"
                self.thread_devices.setdefault(name, set()).add(d)

    def current_device(self) -> int:
        t = self._tls()
        return t.target if t.target >= 0 else t.device

    def _set(self, index: int) -> None:
        """c10::cuda::set_device: ``cudaSetDevice`` (which creates the context) if it changes."""
        t = self._tls()
        t.target = -1
        if t.device != self._valid(index):
            t.device = index
            self.need_context(index, "cudaSetDevice", work=False)

    def set_device(self, index: int) -> None:
        self.check()
        self._set(index)

    def exchange_device(self, index: int) -> int:
        self.check()
        cur = self.current_device()
        if index != cur:
            self._set(index)
        return cur

    def maybe_exchange_device(self, index: int) -> int:
        cur = self.current_device()
        if index != cur:
            if index in self.contexts:
                self._set(index)
            else:
                self._tls().target = index  # no cudaSetDevice on a device without a context
        return cur

    # ---------------------------------------------------------------- streams
    POOL = 32
    """Streams per device and priority in torch's pool (c10/cuda/CUDAStream.cpp: kStreamsPerPool):
    ``torch.cuda.Stream()`` hands them out round-robin, so the 33rd is the 1st again."""

    def new_stream(self, cls: type, index: int, compute: bool) -> Any:
        self._valid(index)
        if not compute:
            with self._lock:
                n = self._handed.get(index, 0)
                self._handed[index] = n + 1
                pooled = self._pool.setdefault(index, [])
            self.counts["streams"] += 1
            if n >= self.POOL:
                self.need_context(index, "stream creation")
                return pooled[n % self.POOL]  # the same stream (one queue), as torch's pool
        s = object.__new__(cls)
        with self._lock:
            n = len(self._streams)
            s.sim, s.device_index, s.compute = self, index, compute
            s.stream_id = s.cuda_stream = 0 if compute else 0x1000 + n  # (torch's: 0 on every device)
            s.name = f"cuda:{index}/{'default' if compute else f'stream{n}'}"
            s._rng = random.Random(self.seed * 7919 + n)
            s._q = queue.SimpleQueue()
            s._pending = 0
            s._copied = None  # (a default stream: set when its last queued copy has run)
            s._thread = threading.Thread(target=self._work, args=(s,), daemon=True, name=f"sim-{s.name}")
            self._streams.append(s)
            self._by_id[stream_key(s)] = s
            self._workers.add(s._thread)
        s.idle = lambda: s._pending == 0
        s._thread.start()
        if not compute:
            pooled.append(s)
            self.need_context(index, "stream creation")
        return s

    def stream_by_id(self, stream_id: int, device_index: int) -> Any:
        return self._by_id[(device_index, stream_id)]

    def stream_by_key(self, key: Any) -> Any:
        """The stream of a checker key (:func:`~cgdp.testing.stream_check.stream_key`)."""
        return self._by_id[key]

    def _stream_name(self, key: Any) -> str:
        s = self._by_id.get(key)
        return s.name if s is not None else str(key)

    def _submit(self, s: Any, fn: Callable[[], None]) -> None:
        with self._lock:
            s._pending += 1
        s._q.put(fn)

    def _work(self, s: Any) -> None:
        while True:
            fn = s._q.get()
            if fn is None:
                return
            delay = s._rng.uniform(0.0, self.max_delay_s)
            if delay:
                time.sleep(delay)
            try:
                fn()
            except BaseException as exc:  # sticky, as a failed kernel is on a GPU
                self.errors.append(exc)
            finally:
                with self._lock:
                    s._pending -= 1

    def current_stream(self, index: int) -> Any:
        return self._tls().streams.get(self._valid(index)) or self._default[index]

    def default_stream(self, index: int) -> Any:
        return self._default[self._valid(index)]

    def set_stream(self, s: Any) -> None:
        """THCPModule_setStream: makes the stream's device current (``cudaSetDevice``) first."""
        self.check()
        if self.current_device() != s.device_index:
            self._set(s.device_index)
        self._tls().streams[s.device_index] = s

    def _hold(self, gate: threading.Event, what: str) -> None:
        if not gate.wait(self.timeout_s):
            raise TimeoutError(f"simulated CUDA: {what} did not complete in {self.timeout_s:g} s")

    def _drain(self, s: Any) -> None:
        done = threading.Event()
        self._submit(s, done.set)
        self._hold(done, f"stream {s.name} to drain")

    def wait_event(self, s: Any, ev: Any) -> None:
        self.check()
        self.need_context(s.device_index, "cudaStreamWaitEvent")
        gate = ev._gate
        if gate is None:
            return  # an event never recorded: nothing to wait for (as in CUDA)
        self.counts["wait_event"] += 1
        self._fire(s.device_index, "EventWaitCallbacks", ev.event_id, s.cuda_stream)
        if s.compute:
            # the kernels after this wait run on the host when issued: they must not run before
            # the event's work (a physical hold; logically the wait stays device-side)
            self.counts["compute_waits"] += 1
            self._hold(gate, "an event the default stream waits on")
        self._submit(s, lambda: self._hold(gate, "an event a stream waits on"))

    def synchronize_stream(self, s: Any) -> None:
        self.check()
        self.need_context(s.device_index, "cudaStreamSynchronize")
        self.syncs.count("synchronize")
        self._drain(s)
        self._fire(s.device_index, "StreamSynchronizationCallbacks", s.cuda_stream)
        self.raise_pending()

    def synchronize_device(self, index: int) -> None:
        self.check()
        self.counts["device_syncs"] += 1
        self.syncs.count("synchronize")
        with fake_cuda.device(index):
            self.need_context(None, "cudaDeviceSynchronize")
            for s in list(self._streams):
                if s.device_index == index:
                    self._drain(s)
        self._fire(index, "DeviceSynchronizationCallbacks")
        self.raise_pending()

    def busy(self, seconds: float) -> None:
        """Device work of ``seconds`` on the calling thread's current stream (the host goes on),
        e.g. inside a model's forward: the device's clock then runs behind the host's."""
        self.check()
        self._submit(self.current_stream(self.current_device()), lambda: time.sleep(seconds))

    def side_stream(self, index: int) -> Any:
        """One extra stream per device, for models that run part of their forward on it."""
        if index not in self._side:
            self._side[index] = fake_cuda.Stream(index)
        return self._side[index]

    # ---------------------------------------------------------------- events
    def new_event(self, cls: type, enable_timing: bool, blocking: bool) -> Any:
        self.check()
        ev = object.__new__(cls)
        with self._lock:
            self._events += 1
            ev.event_id = 0x10_0000 + self._events
        ev.sim, ev.enable_timing, ev.blocking, ev._gate, ev._t = self, enable_timing, blocking, None, None
        ev._stream = None
        self.counts["events"] += 1
        return ev

    def record_event(self, ev: Any, s: Any = None) -> None:
        self.check()
        s = s if s is not None else self.current_stream(self.current_device())
        if getattr(ev, "_device", None) is None:
            ev._device = s.device_index  # (CUDAEvent: created on its first record, on that stream's device)
        elif ev._device != s.device_index:
            raise RuntimeError(f"Event device {ev._device} does not match recording stream's device "
                               f"{s.device_index}. (simulated: as CUDAEvent::record)")
        self.need_context(s.device_index, "cudaEventRecord")
        gate = threading.Event()
        ev._gate, ev._t, ev._stream = gate, None, s
        self._fire(s.device_index, "EventRecordCallbacks", ev.event_id, s.cuda_stream)

        def fire() -> None:
            if ev._gate is gate:
                ev._t = self.clock()
            gate.set()
        self._submit(s, fire)

    def query_event(self, ev: Any) -> bool:
        self.check()
        self.need_context(None, "cudaEventQuery")
        done = ev._gate is None or ev._gate.is_set()
        if done:  # the host now knows (torch fires no trace callback for a query)
            self.checker.event_synchronize(ev.event_id)
        return done

    def synchronize_event(self, ev: Any) -> None:
        self.check()
        self.need_context(None, "cudaEventSynchronize")
        self.counts["host_waits"] += 1
        # the host waiting for a copy on one of cgdp's copy streams is an arrival; any other wait
        # (the compute stream, a model's side stream) is a synchronisation
        stream = getattr(ev, "_stream", None)
        copy = stream is not None and not stream.compute and stream not in self._side.values()
        self.syncs.count("arrival" if copy else "synchronize")
        if not ev.blocking:
            self.counts["spin_waits"] += 1  # a real GPU would spin a core here
        if ev._gate is not None:
            self._hold(ev._gate, "Event.synchronize")
            self._fire(None, "EventSynchronizationCallbacks", ev.event_id)
        self.raise_pending()

    def elapsed_time(self, start: Any, end: Any) -> float:
        self.check()
        if not (start.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if start._t is None or end._t is None:
            raise RuntimeError("CUDA error: device not ready (an event of elapsed_time has not completed)")
        return (end._t - start._t) * 1e3

    def _fire(self, device: int | None, registry: str, *args: Any) -> None:
        """What torch's C++ does on a GPU: call the Python GPU-trace callbacks, under a guard of
        ``device`` (the stream's: the callbacks name a stream by its handle only)."""
        import torch.cuda._gpu_trace as gt
        prev = self.exchange_device(device) if device is not None else None
        try:
            getattr(gt, registry).fire_callbacks(*args)
        finally:
            if prev is not None:
                self.maybe_exchange_device(prev)

    # ---------------------------------------------------------------- kernels (the dispatch mode)
    def _take_dest(self) -> int | None:
        dest, self._local.dest = getattr(self._local, "dest", None), None
        return dest

    def _execute(self, func: Any, args: tuple, kwargs: dict, stream: int | None) -> Any:
        if func is torch.ops.aten._to_copy.default:  # its output lives on its device= (see on_fresh)
            self._local.dest = self.syncs.index(kwargs.get("device"))
        s = self.stream_by_key(stream) if stream not in (None, HOST) else None
        if s is not None:
            self.check()
            self._launch_check()
            if s._copied is not None:  # in order behind the copies queued on a default stream
                self._hold(s._copied, "a copy queued on the default stream")
        to_copy = func is torch.ops.aten._to_copy.default
        if not (func is torch.ops.aten.copy_.default or to_copy) or s is None:
            return func(*args, **kwargs)
        if to_copy:  # a move to a device from page-locked memory, non_blocking: queued as well
            src = args[0]
            if not (kwargs.get("non_blocking") and self.syncs.locked(src) and self._local.dest is not None
                    and src.is_contiguous()):
                return func(*args, **kwargs)
            dst = func(*args, **kwargs)
            if not dst.is_contiguous():
                return dst
            _poison(dst)  # (written when the copy runs, which leaves its version as autograd saw it)
            args, kwargs, func = (dst, src), {}, _write_raw
        dst, src = args[0], args[1]
        self.counts["copies"] += 1
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) or to_copy
        if s.compute and not (non_blocking and (self.syncs.locked(dst) or self.syncs.locked(src))):
            return func(*args, **kwargs)  # compute runs when issued (a copy the host waits for too)
        if self.syncs.device_of(src) is None and not self.syncs.locked(src) and self.syncs.device_of(dst) is not None:
            src = src.clone()  # from pageable memory: CUDA stages the source when issued
            args = (dst, src, *args[2:])
        host = [self._registered_range(x) for x in (dst, src)]
        locked = [False, True] if to_copy else [bool(r) or self.syncs.locked(x) for r, x in zip(host, (dst, src))]
        kind = "d2h" if locked[0] else "h2d" if locked[1] else "d2d"
        if s.compute:
            self.counts["queued_copies"] += 1  # (a default stream's: not in copied_bytes)
        else:
            self.copied_bytes[kind] += dst.numel() * dst.element_size()
        self.need_context(s.device_index, "cudaMemcpyAsync")
        done = threading.Event()
        if s.compute:
            s._copied = done

        def run() -> None:
            try:
                self._check_registered(host, dst, s.name)
                func(*args, **kwargs)
            finally:
                done.set()
        self._submit(s, run)
        return dst

    # ---------------------------------------------------------------- errors and lifetime
    def inject_error(self, message: str = "an illegal memory access was encountered") -> None:
        """A sticky error, as a faulting kernel leaves on a GPU."""
        self.errors.append(RuntimeError(message))

    def raise_pending(self) -> None:
        """Raise the sticky error, or the ordering violations found since the last call."""
        if self.errors:
            self.check()
        if len(self.violations) > self._reported:
            new = self.violations[self._reported:]
            self._reported = len(self.violations)
            more = f" (and {len(new) - 3} more)" if len(new) > 3 else ""
            raise StreamRaceError("; ".join(str(v) for v in new[:3]) + more)

    def activate(self) -> None:
        if fake_cuda._sim is not None:
            raise RuntimeError("a simulated CUDA runtime is already active; nest no simulated_cuda()")
        fake_cuda._sim = self
        self.checker.install_trace(self.current_device)
        self._watch()
        self._unhook = on_new_threads(self._thread_starts, self._unwatch)

    def _thread_starts(self) -> None:
        """Every thread started while the simulator is active is watched from its start, whether
        or not it ever calls ``torch.cuda``: the kernels it issues on simulated devices are checked."""
        if fake_cuda._sim is self and threading.current_thread() not in self._workers:
            self._watch()

    def _unwatch(self) -> None:
        """The calling thread's modes popped (at its end, and the closing thread's at close)."""
        self.checker.unwatch_thread(self.mode)
        if getattr(self._local, "syncing", False):
            _pop_function_mode(self.syncs.mode)
            self._local.syncing = False

    def close(self) -> None:
        if hasattr(self, "_unhook"):
            self._unhook()
        self._unwatch()
        self.syncs.mode.enabled = False
        self.mode.enabled = False  # threads that outlive the simulator run their kernels plainly
        self.checker.uninstall_trace()
        if fake_cuda._sim is self:
            fake_cuda._sim = None
        self.autograd.close()
        for s in self._streams:
            s._q.put(None)
        for s in self._streams:
            s._thread.join(timeout=5)


def _write_raw(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for contiguous tensors, without counting a version of ``dst`` (the write
    of a move that autograd recorded as done when issued)."""
    tmp = src.to(dst.dtype).contiguous()
    ctypes.memmove(dst.data_ptr(), tmp.data_ptr(), dst.numel() * dst.element_size())


def _push_function_mode(mode: Any) -> None:
    torch._C._push_on_torch_function_stack(mode)


def _pop_function_mode(mode: Any) -> None:
    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    if stack and stack[-1] is mode:
        torch._C._pop_torch_function_stack()


@contextlib.contextmanager
def simulated_cuda(num_devices: int = 2, *, seed: int = 0, max_delay_s: float = 0.002,
                   timeout_s: float = 60.0, page_size: int | None = None, nccl: bool = True,
                   lockable_bytes: int | None = None) -> Iterator[SimulatedCuda]:
    """Inside, ``"cuda:0"`` … ``"cuda:{num_devices-1}"`` run cgdp's CUDA backend (``TorchCuda``
    included) on the strict simulated runtime. ``max_delay_s``: the largest random delay before
    each item on a stream (0 keeps order but still runs every stream asynchronously);
    ``page_size``: the host's page size (default: this machine's); ``nccl``: whether
    ``torch.cuda.nccl`` reports itself available; ``lockable_bytes``: the page-locked memory limit.
    Ordering violations not raised earlier are raised when the block ends."""
    from cgdp.engine.backend.cuda_runtime import use_runtime
    sim = SimulatedCuda(num_devices, seed=seed, max_delay_s=max_delay_s, timeout_s=timeout_s,
                        page_size=page_size, nccl=nccl, lockable_bytes=lockable_bytes)
    sim.activate()
    try:
        with use_runtime(sim.runtime):
            yield sim
    except BaseException:
        sim.close()
        raise
    sim.close()
    if len(sim.violations) > sim._reported:  # (a sticky error was raised where it happened)
        sim.errors.clear()
        sim.raise_pending()
