"""Stream-ordering checks keyed by address ranges: what CUDA guarantees, and nothing more.

CUDA orders work on one stream; across streams only events (``record`` / ``wait_event``) and host
synchronisations (``Event.synchronize``, ``Stream.synchronize``, ``torch.cuda.synchronize``) do.
:class:`StreamChecker` keeps that order as vector clocks (as PyTorch's CUDA sanitizer does) and
every kernel's reads and writes as *byte ranges* of memory, so a slice of a flat buffer is
compared with the buffer and with every other slice (the sanitizer keys accesses by
``data_ptr()``, so it never compares a slice with its buffer). It reports:

* a **race**: two accesses to overlapping bytes on different streams, at least one a write, with
  no event or host synchronisation ordering them (e.g. a D2H copy of a chunk that does not wait
  for a stream on which a gradient of that chunk accumulated);
* a **use after unregister**: page-locked host memory unregistered (or freed) while a copy that
  uses it is not known by the host to have completed;
* a **reuse hazard** of the caching allocator: memory allocated on a stream whose previous
  owner's block (allocated on the same stream, so CUDA's allocator hands it out at once) was
  still used on another stream without ``record_stream`` or an event ordering that use first.

Its inputs are the ones PyTorch gives on a GPU: ``torch.cuda._gpu_trace`` callbacks (event
record, stream wait, event / stream / device synchronisation), which torch fires from C++ on a
GPU and :mod:`cgdp.testing.cuda_sim` fires the same way; and :class:`AccessMode`, a dispatch mode
that records each operator's tensors on the stream it runs on. A stream is keyed by (device,
handle) (:func:`stream_key`): the callbacks name a stream by its handle only, which is 0 for every
device's default stream, and torch fires them under a guard of the stream's device, so the
current device completes the key. The host's own operators on page-locked memory may be recorded
as a stream of their own (:data:`HOST`), ordered by exactly what the host waited for. The mode
stack is per thread, so the mode must be pushed on *every* thread that issues work
(:meth:`StreamChecker.watch_thread`): :func:`checked` pushes it on the caller's thread, on every
thread started while it is in use (:func:`on_new_threads`) and on any that binds a device or
enters a stream through the runtime (autograd's device threads inherit it from the thread that
calls backward).
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode

__all__ = ["StreamChecker", "StreamRaceError", "AccessMode", "checked", "tensor_bytes", "stream_key", "HOST",
           "on_new_threads"]


Key = Any
"""A stream's key: any hashable; cgdp's are (device, handle) (:func:`stream_key`)."""
HOST = "host"
"""The key of the host's own accesses (e.g. to page-locked memory): a stream whose clock is the
host's knowledge, so what it does is ordered after exactly what the host has waited for, and
before whatever it issues next."""


class StreamRaceError(RuntimeError):
    """Work on two streams (or a stream and the host) touched the same bytes without ordering."""


@dataclass
class Access:
    write: bool
    stream: Key
    seq: int
    what: str


@dataclass
class Span:
    """Bytes [lo, hi) with one history: the last write and the reads since, per stream."""
    lo: int
    hi: int
    alloc: Key | None = None  # stream the block was allocated on (None: not seen)
    write: Access | None = None
    reads: dict[Key, Access] = field(default_factory=dict)
    recorded: set[Key] = field(default_factory=set)  # streams given to record_stream


def stream_key(s: Any) -> tuple[int, int]:
    """A stream's key in the checker: (device, ``cuda_stream``). The handle alone does not tell
    devices apart: every device's default stream is handle 0."""
    return s.device_index, s.cuda_stream


def tensor_bytes(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a tensor's elements occupy (the bounding range of a strided view)."""
    try:
        if t.numel() == 0 or t.is_sparse or t.device.type == "meta":
            return None
        lo = t.data_ptr()
        ext = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        return lo, lo + ext * t.element_size()
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
        return None


class StreamChecker:
    """Vector clocks of streams, events and the host, and the access history of every byte range."""

    def __init__(self, stream_name: Callable[[Key], str] = str):
        self._lock = threading.RLock()
        self._streams: dict[Key, dict[Key, int]] = {}
        self._events: dict[int, dict[Key, int]] = {}
        self._host: dict[Key, int] = {}
        self._seq = 0
        self._starts: list[int] = []
        self._spans: list[Span] = []
        self.stream_name = lambda s: "the host" if s == HOST else stream_name(s)
        self.errors: list[StreamRaceError] = []
        self.on_error: Callable[[StreamRaceError], None] | None = None
        self.accesses = 0

    # ------------------------------------------------------------------ happens-before
    def _state(self, s: Key) -> dict[Key, int]:
        if s == HOST:
            return self._host
        st = self._streams.get(s)
        if st is None:
            st = self._streams[s] = dict(self._host)
        return st

    @staticmethod
    def _merge(into: dict[Key, int], other: dict[Key, int]) -> None:
        for k, v in other.items():
            if into.get(k, 0) < v:
                into[k] = v

    def _tick(self, s: Key) -> int:
        st = self._state(s)
        self._merge(st, self._host)  # work issued after the host learned X is ordered after X
        self._seq += 1
        st[s] = self._seq
        return self._seq

    def event_record(self, event: int, stream: Key) -> None:
        with self._lock:
            self._tick(stream)
            self._events[event] = dict(self._state(stream))

    def event_wait(self, event: int, stream: Key) -> None:
        with self._lock:
            self._merge(self._state(stream), self._events.get(event, {}))

    def event_synchronize(self, event: int) -> None:
        with self._lock:
            self._merge(self._host, self._events.get(event, {}))

    def stream_synchronize(self, stream: Key) -> None:
        with self._lock:
            self._merge(self._host, self._state(stream))

    def device_synchronize(self, device: int | None = None) -> None:
        """``cudaDeviceSynchronize``: the streams of ``device`` (keys ``(device, handle)``, as
        :func:`stream_key` makes them); None: every stream."""
        with self._lock:
            for s in list(self._streams):
                if device is None or (isinstance(s, tuple) and s[0] == device):
                    self._merge(self._host, self._state(s))

    def _ordered(self, s: Key | None, a: Access) -> bool:
        """Whether access ``a`` is ordered before new work on stream ``s`` (None: the host)."""
        known = self._host if s is None else self._state(s)
        return a.seq <= known.get(a.stream, 0)

    # ------------------------------------------------------------------ byte ranges
    def _cut(self, x: int) -> None:
        i = bisect.bisect_right(self._starts, x) - 1
        if i >= 0:
            sp = self._spans[i]
            if sp.lo < x < sp.hi:
                new = Span(x, sp.hi, sp.alloc, sp.write, dict(sp.reads), set(sp.recorded))
                sp.hi = x
                self._spans.insert(i + 1, new)
                self._starts.insert(i + 1, x)

    def _covering(self, lo: int, hi: int, fill: bool) -> list[Span]:
        """The spans that cover [lo, hi) (cut at lo and hi); ``fill``: gaps become new spans."""
        self._cut(lo)
        self._cut(hi)
        i = bisect.bisect_left(self._starts, lo)
        out, at = [], lo
        while i < len(self._spans) and self._spans[i].lo < hi:
            sp = self._spans[i]
            if fill and sp.lo > at:
                gap = Span(at, sp.lo)
                self._spans.insert(i, gap)
                self._starts.insert(i, at)
                out.append(gap)
                i += 1
            out.append(sp)
            at = sp.hi
            i += 1
        if fill and at < hi:
            self._spans.insert(i, Span(at, hi))
            self._starts.insert(i, at)
            out.append(self._spans[i])
        return out

    def _drop(self, lo: int, hi: int) -> None:
        for sp in self._covering(lo, hi, fill=False):
            i = self._spans.index(sp)
            del self._spans[i], self._starts[i]

    def _report(self, msg: str) -> None:
        err = StreamRaceError(msg)
        self.errors.append(err)
        if self.on_error is not None:
            self.on_error(err)

    def _race(self, new: Access, old: Access, sp: Span) -> None:
        kind = "wrote" if old.write else "read"
        self._report(f"{new.what} on stream {self.stream_name(new.stream)} "
                     f"{'writes' if new.write else 'reads'} bytes that {old.what} {kind} on stream "
                     f"{self.stream_name(old.stream)}, and no event or host synchronisation orders "
                     f"the two ({sp.hi - sp.lo} bytes at {sp.lo:#x})")

    def access(self, stream: Key, reads: list[tuple[int, int]], writes: list[tuple[int, int]],
               what: str, fresh: list[tuple[int, int]] = ()) -> None:
        """A kernel on ``stream`` read ``reads``, wrote ``writes`` and allocated ``fresh``."""
        with self._lock:
            seq = self._tick(stream)
            self.accesses += 1
            for lo, hi in fresh:
                self._allocate(lo, hi, stream, what)
            for rngs, write in ((reads, False), (writes, True)):
                a = Access(write, stream, seq, what)
                for lo, hi in rngs:
                    for sp in self._covering(lo, hi, fill=True):
                        self._check_and_set(sp, a)

    def _check_and_set(self, sp: Span, a: Access) -> None:
        if a.write:
            for r in (sp.reads.values() if sp.reads else [sp.write] if sp.write else []):
                if r.stream != a.stream and not self._ordered(a.stream, r):
                    self._race(a, r, sp)
                    break
            sp.write, sp.reads = a, {}
        else:
            w = sp.write
            if w is not None and w.stream != a.stream and not self._ordered(a.stream, w):
                self._race(a, w, sp)
            sp.reads[a.stream] = a

    def _allocate(self, lo: int, hi: int, stream: Key, what: str) -> None:
        """A new block at [lo, hi) on ``stream``: what the previous owner's block left behind."""
        for sp in self._covering(lo, hi, fill=False):
            if sp.alloc != stream or stream == HOST:
                continue  # (host memory: a queued copy keeps its operands alive)  # CUDA's allocator reuses a block only on the stream it was allocated on
            uses = [*sp.reads.values(), *([sp.write] if sp.write else [])]
            for u in uses:
                if u.stream != stream and u.stream not in sp.recorded and not self._ordered(stream, u):
                    self._report(f"{what} on stream {self.stream_name(stream)} got memory freed while "
                                 f"{u.what} on stream {self.stream_name(u.stream)} may still use it: "
                                 f"call record_stream, or order that stream first with an event")
                    break
        self._drop(lo, hi)
        sp = self._covering(lo, hi, fill=True)
        for s in sp:
            s.alloc = stream

    def forget(self, ranges: list[tuple[int, int]]) -> None:
        """Memory allocated where no stream is known: whatever was there before is gone."""
        with self._lock:
            for lo, hi in ranges:
                self._drop(lo, hi)

    def record_stream(self, lo: int, hi: int, stream: Key) -> None:
        """``Tensor.record_stream``: the allocator will not reuse the block before ``stream`` is done."""
        with self._lock:
            for sp in self._covering(lo, hi, fill=False):
                sp.recorded.add(stream)

    def host_release(self, lo: int, hi: int, what: str) -> bool:
        """Host memory [lo, hi) is unregistered or freed; whether every use of it had completed
        as far as the host knows (if not, a copy may still read or write it)."""
        with self._lock:
            ok = True
            for sp in self._covering(lo, hi, fill=False):
                uses = [*sp.reads.values(), *([sp.write] if sp.write else [])]
                late = [u for u in uses if not self._ordered(None, u)]
                if late and ok:
                    u = late[0]
                    self._report(f"{what} while {u.what} on stream {self.stream_name(u.stream)} may "
                                 f"still use it: synchronise the copy streams first")
                    ok = False
            self._drop(lo, hi)
            return ok

    def unsettled(self) -> list[str]:
        """Accesses the host has not seen complete (the work still in flight, as CUDA knows it)."""
        with self._lock:
            out = []
            for sp in self._spans:
                for u in [*sp.reads.values(), *([sp.write] if sp.write else [])]:
                    if not self._ordered(None, u):
                        out.append(f"{u.what} on {self.stream_name(u.stream)}")
            return sorted(set(out))

    # ------------------------------------------------------------------ torch's trace callbacks
    def install_trace(self, current_device: Callable[[], int]) -> None:
        """Receive ``torch.cuda._gpu_trace`` callbacks (GPU: fired by torch; simulator: by the fakes).
        They name a stream by its handle only (0 for every device's default stream); torch fires
        them under a guard of the stream's device (``CUDAEvent::record`` and ``block``,
        ``CUDAStream::synchronize``, ``device_synchronize``), so ``current_device()`` completes
        the key."""
        _Trace.target, _Trace.device = self, current_device
        _Trace.register()

    def uninstall_trace(self) -> None:
        if _Trace.target is self:
            _Trace.target = None

    # ------------------------------------------------------------------ threads
    def watch_thread(self, mode: "AccessMode") -> None:
        """Push ``mode`` on the calling thread (once): its kernels are recorded from now on."""
        if getattr(_tls, "mode", None) is mode:
            return
        _push_mode(mode)
        _tls.mode = mode

    @staticmethod
    def unwatch_thread(mode: "AccessMode") -> None:
        """Pop ``mode`` off the calling thread if it is what this thread last pushed and still on top."""
        if getattr(_tls, "mode", None) is mode and _get_current_dispatch_mode() is mode:
            _pop_mode()
            _tls.mode = None


_tls = threading.local()


def on_new_threads(start: Callable[[], None], end: Callable[[], None] | None = None) -> Callable[[], None]:
    """Call ``start()`` on every thread started from now on, on its first Python call
    (``threading.setprofile``), so a mode can be pushed on threads that never call ``torch.cuda``;
    and ``end()`` on that thread when its target returns or raises. What ``start`` pushed, ``end``
    must pop: torch's mode stacks are C++ thread-locals whose destructors take the GIL, and one that
    runs after the thread was joined races with the interpreter's exit, which then aborts the
    process ("terminate called without an active exception", pytorch#38228). A thread without a
    target (a subclass's own ``run``) gets no ``end``. Returns what stops it."""
    prev = threading.getprofile()

    def hook(frame: Any, event: str, arg: Any) -> None:
        sys.setprofile(prev)
        start()
        thread = threading.current_thread()
        target = getattr(thread, "_target", None)  # the first call is Thread.run's: its target not run yet
        if end is not None and target is not None:
            thread._target = functools.partial(_then, target, end)
    threading.setprofile(hook)
    return lambda: threading.setprofile(prev)


def _then(target: Callable[..., Any], end: Callable[[], None], *args: Any, **kwargs: Any) -> Any:
    try:
        return target(*args, **kwargs)
    finally:
        end()


class _Trace:
    """One registration with torch's trace registries (they cannot be removed), forwarding to the
    checker in use."""
    target: StreamChecker | None = None
    device: Callable[[], int] = staticmethod(lambda: 0)
    registered = False

    @classmethod
    def register(cls) -> None:
        if cls.registered:
            return
        import torch.cuda._gpu_trace as gt
        if hasattr(torch._C, "_activate_gpu_trace") and torch.cuda.is_available():
            torch._C._activate_gpu_trace()
        fwd, dev = cls._forward, lambda: cls.device()
        gt.register_callback_for_event_record(lambda e, s: fwd("event_record", e, (dev(), s)))
        gt.register_callback_for_event_wait(lambda e, s: fwd("event_wait", e, (dev(), s)))
        gt.register_callback_for_event_synchronization(lambda e: fwd("event_synchronize", e))
        gt.register_callback_for_stream_synchronization(lambda s: fwd("stream_synchronize", (dev(), s)))
        gt.register_callback_for_device_synchronization(lambda: fwd("device_synchronize", dev()))
        cls.registered = True

    @classmethod
    def _forward(cls, name: str, *args: Any) -> None:
        if cls.target is not None:
            getattr(cls.target, name)(*args)


class AccessMode(TorchDispatchMode):
    """Records every operator's reads, writes and fresh outputs on the stream it runs on.

    ``stream_of(tensors)`` gives that stream's id (None: do not record this operator, e.g. a
    thread whose stream the environment cannot tell); ``execute`` runs the operator (the
    simulator replaces it to make copies on side streams asynchronous)."""

    def __init__(self, checker: StreamChecker, stream_of: Callable[[list[torch.Tensor]], int | None],
                 execute: Callable[..., Any] | None = None):
        super().__init__()
        self.checker = checker
        self.stream_of = stream_of
        self.execute = execute
        self.enabled = True
        self.on_fresh: Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None = None
        """Called with an operator's input tensors and the tensors it allocated."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.enabled:
            return func(*args, **kwargs)
        schema = func._schema
        reads: list[torch.Tensor] = []
        writes: list[torch.Tensor] = []
        for i, arg in enumerate(schema.arguments):
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            if value is None:
                continue
            ts = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
            if not ts:
                continue
            if arg.alias_info is None:
                reads += ts
            elif arg.alias_info.is_write:
                writes += ts
            # a view's argument (alias, not written) is metadata only
        stream = self.stream_for(func, args, kwargs, reads, writes)
        if func is torch.ops.aten.record_stream.default:
            rng = tensor_bytes(args[0])
            target = self.stream_of_object(args[1])
            if rng is not None and target is not None:
                self.checker.record_stream(rng[0], rng[1], target)
            return func(*args, **kwargs)
        out = (self.execute or _call)(func, args, kwargs, stream)
        fresh, made = [], []
        if not any(r.alias_info is not None for r in schema.returns):
            inputs = {t.untyped_storage().data_ptr() for t in reads + writes if tensor_bytes(t)}
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and (rng := tensor_bytes(t)) is not None \
                        and t.untyped_storage().data_ptr() not in inputs:
                    fresh.append(rng)
                    made.append(t)
        if made and self.on_fresh is not None:
            self.on_fresh(reads + writes, made)
        if stream is None:  # not recorded; but memory it allocated starts a new history
            if fresh:
                self.checker.forget(fresh)
            self.finish(func, args, kwargs, stream, reads, writes)
            return out
        rr = [r for t in reads if (r := tensor_bytes(t)) is not None]
        ww = [r for t in writes if (r := tensor_bytes(t)) is not None]
        if not _UNINITIALISED.match(schema.name):
            ww += fresh  # an empty() allocates without writing (and may be host memory)
        what = f"{func.__name__} ({threading.current_thread().name})"
        home = self.alloc_stream(func, kwargs, stream)
        if home != stream and fresh:
            self.checker.access(home, [], [], what, fresh)  # allocated on another stream first
            fresh = []
        self.checker.access(stream, rr, ww, what, fresh)
        self.finish(func, args, kwargs, stream, reads, writes)
        return out

    def stream_for(self, func: Any, args: tuple, kwargs: dict, reads: list[torch.Tensor],
                   writes: list[torch.Tensor]) -> Any:
        """The stream an operator runs on (None: not recorded); by default ``stream_of``."""
        return self.stream_of(reads + writes)

    def alloc_stream(self, func: Any, kwargs: dict, stream: Any) -> Any:
        """The stream whose allocator gave the operator's outputs (by default its own)."""
        return stream

    def finish(self, func: Any, args: tuple, kwargs: dict, stream: Any, reads: list[torch.Tensor],
               writes: list[torch.Tensor]) -> None:
        """After an operator ran and was recorded (what the environment adds: e.g. a blocking
        copy's synchronisation)."""

    def stream_of_object(self, s: Any) -> Any:
        """The key of a stream object passed to ``record_stream``."""
        return stream_key(s) if hasattr(s, "cuda_stream") else None


def _call(func, args, kwargs, stream):
    return func(*args, **kwargs)


_UNINITIALISED = re.compile(r"aten::(new_)?empty(_like|_strided|_permuted)?$")


class checked:
    """A runtime object (``cgdp.engine.backend.cuda_runtime.use_runtime``) that records, on a GPU,
    what every thread issues: the access mode is pushed on the caller's thread, on each thread
    started while it is in use (:func:`on_new_threads`), and by ``set_device`` and ``stream`` on
    any other (autograd's device threads inherit it from the thread that calls backward); ``host_free`` reports page-locked memory unregistered while still
    in use. Everything else is the wrapped runtime's."""

    def __init__(self, rt: Any):
        self._rt = rt
        cuda = rt.cuda
        self.checker = StreamChecker()
        self.checker.install_trace(cuda.current_device)

        def stream_of(tensors: list[torch.Tensor]) -> Any:
            dev = next((t.device for t in tensors if t.is_cuda), None)
            return None if dev is None else stream_key(cuda.current_stream(dev))
        self.mode = AccessMode(self.checker, stream_of)
        self.checker.watch_thread(self.mode)  # the caller's thread zeroes and relays buffers
        self._unhook = on_new_threads(lambda: self.mode.enabled and self.checker.watch_thread(self.mode),
                                      lambda: self.checker.unwatch_thread(self.mode))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def set_device(self, index: int) -> None:
        self._rt.set_device(index)
        self.checker.watch_thread(self.mode)

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        self.checker.watch_thread(self.mode)  # the host-sum and comm threads issue copies back here
        with self._rt.stream(s):
            yield

    def host_free(self, t: torch.Tensor) -> None:
        rng = tensor_bytes(t)
        if rng is not None:
            self.checker.host_release(rng[0], rng[1], "cudaHostUnregister")
        self._rt.host_free(t)

    def close(self) -> None:
        self._unhook()
        self.checker.unwatch_thread(self.mode)
        self.checker.uninstall_trace()
        self.mode.enabled = False
