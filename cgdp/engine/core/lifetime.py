"""An engine's lifetime, the same for both faces: one operation at a time, one stack of resources, one ``close()``.

Invariants (``docs/reliability.md`` states them for users):

* **One operation at a time.** Each operation that changes what the replicas share holds the *operation lock*
  (:class:`Operations`). A second one while it runs, from another thread or from inside it (``loss_fn``, a forward on a
  device thread), is a ``RuntimeError`` at once, never a hang or an interleaving.
* **An unfinished operation is reported at the next call.** A ``DataParallel`` backward that raised (autograd skips its
  final callback) leaves a *stale* hold. The next operation from the owner thread, or from any thread once the owner has
  ended, runs its clean-up first; another thread while the owner lives is refused. A backward's owner is the thread that
  ran its forward; a second gathered output in the same backward is recognised by autograd's graph task.
* **Dropped means closed, and nothing is freed in flight.** :class:`Resources` is a stack of what must be stopped,
  released in reverse after every copy in flight has finished, exactly once: by ``close()`` or by a ``weakref.finalize``
  (it holds no reference to the engine).
* **``close()`` during an operation** stops it, waits up to :data:`CLOSE_WAIT_S`, and otherwise the operation releases
  everything when it gives the lock back. A stale hold is dropped and the release is immediate.
* **No reference cycles through the engine.** Threads and callbacks hold it weakly (:func:`weak_call`).
"""
from __future__ import annotations

import functools
import threading
import weakref
from types import SimpleNamespace
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

CLOSE_WAIT_S = 5.0
"""How long ``close()`` from another thread waits for a running operation to stop."""


class Operations:
    """The operation lock of one engine."""

    def __init__(self, refusal: Callable[[str, str, bool], str], stopped: Callable[[str], str],
                 on_device_thread: Callable[[], bool]):
        """``refusal(what, running, inside)``: the message refusing ``what`` (``inside``: from the running operation's
        own or device thread); ``stopped(running)``: the error that stops it when ``close()`` comes."""
        self._refusal, self._stopped = refusal, stopped
        self._on_device_thread = on_device_thread
        self._lock = threading.Lock()  # guards the fields below
        self._given = threading.Condition(self._lock)  # notified when the lock is given, if someone waits
        self._waiting = 0  # close() calls waiting for the lock to be given
        self._release: Callable[[], None] | None = None  # what give() runs after a close() that stopped waiting
        self.what: str | None = None
        """The operation that holds the lock (None: free)."""
        self._owner: threading.Thread | None = None
        self._cleanup: Callable[[], None] | None = None
        self._task = -1  # autograd's graph task of the backward that holds the lock

    def take(self, what: str, owner: threading.Thread | None = None,
             cleanup: Callable[[], None] | None = None) -> None:
        """Hold the lock for ``what`` for thread ``owner`` (default: the caller); ``cleanup`` runs if it goes stale."""
        owner = threading.current_thread() if owner is None else owner
        with self._lock:
            if self.what is None:  # the common case: free
                self.what, self._owner, self._cleanup = what, owner, cleanup
                return
            if not self._stale_for(owner):
                inside = self._owner is owner or self._on_device_thread()
                raise RuntimeError(self._refusal(what, self.what, inside))
            stale, self._cleanup = self._cleanup, None
            self.what = f"clean-up after the failed {self.what}"
        try:
            stale()
        except BaseException:
            self.give()
            raise
        with self._lock:
            self.what, self._owner, self._cleanup = what, owner, cleanup

    def _stale_for(self, thread: threading.Thread) -> bool:
        """Whether the held lock is stale as seen from ``thread`` (see the module); lock held."""
        return self._cleanup is not None and (self._owner is thread or not self._owner.is_alive())

    def take_backward(self, owner: threading.Thread, cleanup: Callable[[], None]) -> bool:
        """The lock for a backward, taken on autograd's thread; False if this backward (graph task) already holds it."""
        task = torch._C._current_graph_task_id()
        with self._lock:
            if self.what == "backward" and self._task == task and self._cleanup is not None:
                return False
        self.take("backward", owner, cleanup)
        self._task = task
        return True

    def give(self) -> None:
        with self._lock:
            self.what = self._owner = self._cleanup = None
            release, self._release = self._release, None
            if self._waiting:
                self._given.notify_all()
        if release is not None:
            release()

    def clean_stale(self) -> None:
        """Run a stale operation's clean-up of this thread now, if there is one (holding nothing)."""
        with self._lock:
            if self.what is None or not self._stale_for(threading.current_thread()):
                return
        self.take("a look at the replicas")
        self.give()

    def close(self, stop: Callable[[BaseException], None], release: Callable[[], None]) -> bool:
        """Whether ``close()`` may ``release`` now; else the operation holding the lock runs it as it gives it back."""
        me = threading.current_thread()
        with self._lock:
            if self.what is None:
                return True
            what = self.what
            in_backward = what == "backward" and torch._C._current_graph_task_id() == self._task
            if self._stale_for(me) and not in_backward:
                self.what = self._owner = self._cleanup = None  # stale: nothing runs, nothing to clean
                return True
        stop(RuntimeError(self._stopped(what)))
        inside = self._on_device_thread()  # a thread the operation waits for must not wait for it
        with self._lock:
            if not (inside or in_backward or self._owner is me):  # never wait for what this thread is in
                self._waiting += 1
                try:
                    self._given.wait_for(lambda: self.what is None, CLOSE_WAIT_S)
                finally:
                    self._waiting -= 1
            if self.what is None:
                return True
            self._release = release
            return False


class Resources:
    """What an engine must stop when it ends, as a stack; holds no reference to the engine."""

    def __init__(self) -> None:
        self._stack: list[Callable[[], None]] = []
        self.drain: Callable[[], None] | None = None
        """Run before anything is freed: let every copy in flight finish (the last one set)."""

    def push(self, close: Callable[[], None]) -> None:
        self._stack.append(close)

    def release(self) -> None:
        """Let copies in flight finish, then stop everything in reverse order, once; the first failure raised last."""
        steps = [self.drain] if self.drain is not None else []  # note: host waits on every stream (drain)
        steps, self._stack, self.drain = steps + self._stack[::-1], [], None
        first: BaseException | None = None
        for close in steps:
            try:
                close()
            except BaseException as exc:  # release the rest anyway; report the first failure
                first = first or exc
        if first is not None:
            raise first


class Lifetime:
    """An engine's lifetime: its operation lock, its resources, whether it is closed or broken."""

    def __init__(self, owner: object, name: str, reopen: str, refusal: Callable[[str, str, bool], str],
                 stopped: Callable[[str], str], stop: Callable[[BaseException], None]):
        """``name``, ``reopen``: how errors name the engine and what to do once closed; ``refusal``, ``stopped``: see
        :class:`Operations`; ``stop``: fails every wait of the engine."""
        self.name, self._reopen, self._stop = name, reopen, stop
        self.threads: Any = SimpleNamespace(stuck=[], on_device_thread=lambda: False)
        """The engine's DeviceThreads, once built."""
        self.ops = Operations(refusal, stopped, lambda: self.threads.on_device_thread())
        self.resources = Resources()
        self.release = weakref.finalize(owner, self.resources.release)
        """Releases the resources once: from ``close()``, or when the engine is freed."""
        self.closed = False
        self.broken: str | None = None
        """Why the engine cannot continue (a failure that may have left the replicas different)."""

    def check_usable(self) -> None:
        if self.closed:
            raise RuntimeError(f"this {self.name} is closed; {self._reopen}")
        if self.broken:
            raise RuntimeError(f"this {self.name} cannot continue: {self.broken}")
        if self.threads.stuck:
            raise RuntimeError(f"this {self.name} cannot continue: the device thread(s) of "
                               f"{', '.join(self.threads.stuck)} never returned from a step that failed; "
                               f"{self._reopen} (load a checkpoint into it)")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.ops.close(self._stop, self.release):
            self.release()

    def start(self, owner: object, model: torch.nn.Module, devices: Any, share_devices: bool,
              build: Callable[[list[Any]], None]) -> None:
        """The start both faces share: ``model`` claimed (given back last), the devices made (closed at the end, after
        every copy in flight), none of them on a user's stream (the engine's buffers must not live there).
        Then the face's ``build(devs)``; the one failure path of a construction: what was built is released."""
        try:
            from cgdp.engine.backend import make_devices
            from cgdp.engine.core.claims import claim
            res, name = self.resources, self.name if self.name.startswith("cgdp.") else f"cgdp.{self.name}"
            self.claim = claim(owner, model, name)
            res.push(self.claim.release)
            from cgdp.engine.core.drain import quiesce
            devs = make_devices(devices, self._stop, share_devices)
            res.drain = functools.partial(quiesce, devs, None, 30.0)
            for d in devs:
                res.push(d.close)
            for d in devs:
                d.check_caller(f"{name}(...)")
            build(devs)
        except BaseException:
            self.close()
            raise

    def open_comm(self, comm: Any, timeout_s: float | None, signature: Callable[[], dict[str, str]]) -> Any:
        """The engine's comm (None for one machine), closed with it; every rank started alike (``signature()``)."""
        from cgdp.comm import make_comm
        comm = make_comm(comm, timeout_s=timeout_s)
        if comm is not None:
            self.resources.push(comm.close)
            comm.attach(self._stop)
            comm.check_same(signature())
        return comm

    def fail(self, exc: BaseException, devs: Any, host: Any) -> str | None:
        """The failure path both faces share: every wait stopped by ``exc``, every stream and the host brought to rest;
        why the engine cannot go on (also set as :attr:`broken`), or None."""
        from cgdp.engine.core.drain import settle
        self._stop(exc)
        try:
            self.broken = None if settle(devs, host, 30.0) else "the host accumulator did not stop after a failed step"
        except BaseException as drain_exc:  # pragma: no cover - only when a stream is wedged
            self.broken = f"a stream did not drain after a failed step ({drain_exc})"
        return self.broken


class Face:
    """What both faces show of their lifetime (``self._life``): :meth:`close`, :attr:`closed`, ``with``."""

    _life: Lifetime

    def close(self) -> None:
        """Remove every hook, stop every thread, free the flat and pinned buffers (``DataParallel``: ``.module`` keeps
        its gradients).

        From another thread while an operation runs (``step()``, a backward): it stops with a ``RuntimeError`` naming
        ``close()`` (or returns, if it was already past its last wait), and ``close()`` waits up to
        :data:`CLOSE_WAIT_S` for it; one still running then releases everything itself when it ends."""
        self._life.close()

    @property
    def closed(self) -> bool:
        return self._life.closed

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def operation(what: str) -> Callable[[F], F]:
    """A method that is one operation of its engine (``self._life``): holds its operation lock, on a usable engine."""
    def wrap(method: F) -> F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            life: Lifetime = self._life
            life.ops.take(what)
            try:
                life.check_usable()
                return method(self, *args, **kwargs)
            finally:
                life.ops.give()
        return call  # type: ignore[return-value]
    return wrap


def weak_call(bound: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``functools.partial(bound, *args)`` holding the bound method's object weakly."""
    ref = weakref.WeakMethod(bound)  # type: ignore[arg-type]

    def call(*more: Any) -> Any:
        fn = ref()
        if fn is None:
            raise RuntimeError("the engine this callback belongs to is gone")
        return fn(*args, *more)
    return call
