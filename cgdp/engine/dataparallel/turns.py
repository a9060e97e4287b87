"""One operation at a time on a ``DataParallel``, and the clean-up of one that failed silently.

A ``DataParallel``'s operations change what every replica shares (flat buffers, hooks, buffers,
optimizer state): its forward; its backward, from the gather's backward to autograd's final
callback; the user's ``optimizer.step()``, which steps every replica; ``clip_grad_norm_``. Two
at once, from two threads, would interleave on that state (misleading errors, replicas that
differ). So each takes the model's turn (:meth:`Turns.take`) and gives it back when it ends. An
operation from another thread while one runs is refused at once with ``RuntimeError``, as
``Trainer`` refuses a second ``step()``, and the running one goes on undisturbed. Operations that
do not overlap may come from any thread: they act as on one device in the same order.

Two operations can end without giving the turn back, because torch tells nobody that they
failed: a backward that raised (autograd skips its final callback) and an optimizer step that
raised on replica 0 (torch skips the step post-hooks). Such a turn is *stale*: its owner thread
has left the operation. The next operation from the owner thread sees that (the owner is
itself: it cannot be inside the other operation) and runs the stale operation's clean-up first,
holding the turn meanwhile; so does any thread once the owner thread has ended (it cannot be
inside anything). An operation from another thread while the owner lives cannot tell a stale
turn from a running operation, and is refused. A backward's owner is the thread that ran its
forward (on CUDA, autograd runs the gather's backward on one of its own threads).

``close()`` while an operation holds the turn (:meth:`Turns.close`) must not free what that
operation uses: it stops the operation (its waits raise the ``RuntimeError`` that names
``close()``), waits a bounded time for the turn, and if the operation has not given it back by
then, the operation releases everything when it does (as ``Trainer.close()`` does with a step).
A stale turn holds nothing: it is dropped and the release is immediate.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

import torch

NAME = "cgdp.DataParallel"
F = TypeVar("F", bound=Callable[..., Any])


class Turns:
    def __init__(self) -> None:
        self._lock = threading.Condition()  # guards the fields below; notified when the turn is given
        self._release: Callable[[], None] | None = None  # what give() runs after a close() that stopped waiting
        self.what: str | None = None
        """The operation that holds the turn (None: free)."""
        self._owner: threading.Thread | None = None
        self._cleanup: Callable[[], None] | None = None
        self._task = -1  # autograd's graph task of the backward that holds the turn

    def take(self, what: str, owner: threading.Thread | None = None,
             cleanup: Callable[[], None] | None = None) -> None:
        """Hold the turn for ``what`` on behalf of thread ``owner`` (the caller's by default).
        ``cleanup``: what to run if the operation ends without :meth:`give` (see the module)."""
        owner = threading.current_thread() if owner is None else owner
        with self._lock:
            stale = None
            if self.what is not None:
                if not self._stale_for(owner):
                    where = "another thread" if self._owner is not owner else "inside it"
                    raise RuntimeError(
                        f"{what} was called on a {NAME} while its {self.what} is running on {where}; a "
                        f"{NAME} takes one operation at a time (forward, backward, optimizer.step(), "
                        f"clip_grad_norm_): drive it from one thread, or serialise the calls with a lock")
                stale, self._cleanup = self._cleanup, None
                self.what = f"clean-up after the failed {self.what}"
            else:
                self.what, self._owner = what, owner
        if stale is not None:
            try:
                stale()
            except BaseException:
                self.give()
                raise
        with self._lock:
            self.what, self._owner, self._cleanup = what, owner, cleanup

    def _stale_for(self, thread: threading.Thread) -> bool:
        """Whether the held turn is stale as seen from ``thread`` (see the module); lock held."""
        return self._cleanup is not None and (self._owner is thread or not self._owner.is_alive())

    def take_backward(self, owner: threading.Thread, cleanup: Callable[[], None]) -> bool:
        """The turn for a backward, called in it (on autograd's thread); False if this backward
        already holds it (a second gathered output reached in the same graph task)."""
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
            self._lock.notify_all()
        if release is not None:
            release()

    def close(self, stop: Callable[[BaseException], None], wait_s: float, inside: bool,
              release: Callable[[], None]) -> bool:
        """``close()`` of the model: whether it may ``release`` now. If not, the operation that
        holds the turn runs ``release`` when it gives the turn back. ``inside``: the caller is a
        thread the operation waits for (a device thread), which must not wait for it."""
        me = threading.current_thread()
        with self._lock:
            if self.what is None:
                return True
            what = self.what
            in_backward = what == "backward" and torch._C._current_graph_task_id() == self._task
            if self._stale_for(me) and not in_backward:
                self.what = self._owner = self._cleanup = None  # stale: nothing runs, nothing to clean
                return True
        stop(RuntimeError(f"{NAME}.close() was called while its {what} was running; that {what} stopped "
                          f"(nothing applied unless it was past its last wait) and the {NAME} is closed"))
        with self._lock:
            if not (inside or in_backward or self._owner is me):  # never wait for what this thread is in
                self._lock.wait_for(lambda: self.what is None, wait_s)
            if self.what is None:
                return True
            self._release = release
            return False

    def settle(self) -> None:
        """Clean up a stale operation of this thread now, if there is one (and hold nothing)."""
        with self._lock:
            if self.what is None or not self._stale_for(threading.current_thread()):
                return
        self.take("a look at the replicas")
        self.give()


def holding(what: str, until_given: bool = False) -> Callable[[F], F]:
    """A method that holds the model's turn (``self._turns``) while it runs; with ``until_given``,
    until a later call gives it back (its first argument: the clean-up if that never comes), and
    only an exception here gives it back at once."""
    def wrap(method: F) -> F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            self._turns.take(what, cleanup=args[0] if until_given else None)
            try:
                out = method(self, *args, **kwargs)
            except BaseException:
                self._turns.give()
                raise
            if not until_given:
                self._turns.give()
            return out
        return call  # type: ignore[return-value]
    return wrap


def giving(method: F) -> F:
    """A method that ends an operation: it gives the model's turn back, whatever happens."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self._turns.give()
    return call  # type: ignore[return-value]
