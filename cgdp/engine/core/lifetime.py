"""A trainer's lifetime: one caller at a time, and everything it owns released when it ends.

Invariants:

* **One call at a time.** ``step``, ``load_state_dict`` and ``set_plan`` are :func:`exclusive`:
  a second call while one runs (from another thread, or from inside ``loss_fn`` or the model's
  forward, which run on the device threads) is a ``RuntimeError`` at once, never a hang and never
  two steps interleaved on the same replicas. ``close()`` during a call (from another thread)
  stops that call and releases nothing under it (:func:`close_during_call`).
* **No reference cycles through the engine.** The engine's threads and callbacks hold the
  trainer only weakly (:func:`weak_call`), so a trainer is freed by reference counting the moment
  its last user reference goes, not whenever the cycle collector runs.
* **Dropped means closed.** :class:`Resources` holds what must be stopped (device threads, the
  gradient stream with its hooks and host accumulator, the devices' stream workers, the comm)
  but never the trainer; a ``weakref.finalize`` runs
  :meth:`Resources.release` when the trainer is freed without ``close()`` (and at interpreter
  exit). ``close()`` runs the same finalizer, so release happens exactly once.
* **Nothing is freed in flight.** A step returns after device-side waits only: on a GPU its last
  copies back may still read the host rows and write the flat buffers. Release first lets every
  copy finish (:func:`settle`), then frees.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Sequence, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def exclusive(method: F) -> F:
    """Refuse a call of ``method`` while another exclusive call on the same object runs."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        lock = self.__dict__.setdefault("_exclusive_lock", threading.Lock())  # setdefault is atomic
        if not lock.acquire(blocking=False):
            threads = getattr(self, "_threads", None)
            if threads is not None and threads.on_device_thread():
                where = ("from a device thread, i.e. from inside loss_fn or the model's forward; "
                         "call it after step() has returned")
            else:
                where = ("from another thread while one is running; a Trainer takes one call at a "
                         "time: serialise the calls with a lock, or use one Trainer per thread")
            raise RuntimeError(f"Trainer.{method.__name__}() was called {where}")
        self.__dict__["_exclusive_owner"] = threading.get_ident()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.__dict__["_exclusive_owner"] = None
            lock.release()
            if self.__dict__.get("_closed"):  # close() came from another thread during this call
                self._finish_close()
    return call  # type: ignore[return-value]


def close_during_call(obj: Any, stop: Callable[[BaseException], None], wait_s: float) -> bool:
    """``close()`` of an object with :func:`exclusive` methods: whether it may release now.

    No call running: yes. A call running on another thread: ``stop`` it (its waits raise at
    their next wake-up) and wait up to ``wait_s`` for it to return; if it does not, the call
    releases everything itself when it returns (its :func:`exclusive` wrapper calls
    ``_finish_close``), so nothing is freed under a running step. From inside the running call
    (its ``loss_fn``, on a device thread): never wait, the call releases on its way out."""
    lock = obj.__dict__.setdefault("_exclusive_lock", threading.Lock())
    if lock.acquire(blocking=False):
        lock.release()
        return True
    stop(RuntimeError(f"{type(obj).__name__}.close() was called from another thread while a call was "
                      f"running; that call stopped (nothing applied unless its update had begun) and "
                      f"the {type(obj).__name__} is closed"))
    threads = getattr(obj, "_threads", None)
    inside = obj.__dict__.get("_exclusive_owner") == threading.get_ident() or (
        threads is not None and threads.on_device_thread())
    if inside or not lock.acquire(timeout=wait_s):
        return False
    lock.release()
    return True


def weak_call(bound: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``functools.partial(bound, *args)`` holding the bound method's object weakly."""
    ref = weakref.WeakMethod(bound)  # type: ignore[arg-type]

    def call(*more: Any) -> Any:
        fn = ref()
        if fn is None:
            raise RuntimeError("the Trainer this callback belongs to is gone")
        return fn(*args, *more)
    return call


class Resources:
    """What a trainer must stop when it ends; holds no reference to the trainer itself."""

    def __init__(self) -> None:
        self.threads: Any = None
        self.stream: Any = None
        self.devs: Sequence[Any] = ()
        self.comm: Any = None
        self.claim: Any = None  # the model's parameters (core/claims.py), given back last

    def take(self, trainer: Any) -> None:
        """Note what ``trainer`` has built so far (called after construction and by close())."""
        self.threads, self.stream, self.comm = trainer._threads, trainer._stream, trainer._comm
        self.devs = list(trainer._devs)

    def release(self) -> None:
        """Stop every thread, remove the hooks, free the flat and pinned buffers, close the comm; once."""
        devs, stream = self.devs, self.stream
        steps = [lambda: settle(devs, stream),
                 getattr(self.threads, "close", None), getattr(self.stream, "close", None),
                 *(d.close for d in self.devs), getattr(self.comm, "close", None),
                 getattr(self.claim, "release", None)]
        self.threads = self.stream = self.comm = None
        self.devs = ()
        first: BaseException | None = None
        for close in steps:
            if close is None:
                continue
            try:
                close()
            except BaseException as exc:  # release the rest anyway; report the first failure
                first = first or exc
        if first is not None:
            raise first


def settle(devs: Sequence[Any], stream: Any, timeout_s: float = 30.0) -> None:
    """Wait until no copy of ``devs`` is in flight, the copies back the host accumulator of
    ``stream`` (a GradientStream, or None) is still issuing included: before anything is freed."""
    from cgdp.engine.core.drain import quiesce
    if devs:
        quiesce(devs, getattr(stream, "host", None), timeout_s)  # note: host waits on every stream


def finalizer(owner: object, res: Resources) -> weakref.finalize:
    """Run ``res.release()`` when ``owner`` is freed (or at exit), or when called; only once."""
    return weakref.finalize(owner, res.release)
