"""How threads of one step wait for each other without ever hanging.

Every thread the engine owns (device threads, stream workers, the accumulator, the comm thread) reports its exception to
one :class:`Guard`. Every place where a thread waits goes through :meth:`Guard.wait`, which wakes up regularly to check
whether another thread failed or the timeout has passed. So a failure anywhere surfaces as an exception in
``Trainer.step()`` and a lost message as a ``TimeoutError`` naming what never came, never as a hang.
"""
from __future__ import annotations

import threading
import time

POLL_S = 0.05
"""How often a waiting thread looks at the failure flag (a wake-up costs microseconds)."""


class StepAborted(RuntimeError):
    """Raised in threads that stop because another thread of the step failed."""


def check_timeout(timeout_s: float | None) -> None:
    """``timeout_s`` of either face: seconds > 0, or None (wait forever)."""
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s > 0):
        raise ValueError(f"timeout_s must be a number of seconds > 0 (the default is 300), or None to wait "
                         f"forever; got {timeout_s!r}")


class Guard:
    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def reset(self) -> None:
        with self._lock:
            self.error = None

    def fail(self, exc: BaseException) -> None:
        """Record the first failure of the step; later ones are consequences of it."""
        with self._lock:
            if self.error is None and not isinstance(exc, StepAborted):
                self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise StepAborted("another thread of this step failed") from self.error

    def check_until(self, deadline: float | None, what: str) -> None:
        """:meth:`check`; past ``deadline`` (``time.monotonic()``, None: never) a timeout of the wait for ``what``."""
        self.check()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"waited {self.timeout_s:g} s for {what}; raise timeout_s if a step can really take "
                               f"that long")

    def wait(self, event: threading.Event, what: str) -> None:
        """Block the calling thread until ``event`` is set, another thread fails, or timeout."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while not event.wait(POLL_S):
            self.check_until(deadline, what)
        self.check()


class Progress:
    """A count that only grows between resets, and a wait for it to reach a value; a waiter wakes every :data:`POLL_S`
    to check the guard. One thread advances a given count, so it needs no lock; the condition is taken only when someone
    waits (a waiter announces itself before reading the count, the producer reads the waiters after writing it: no
    wake-up is lost)."""

    __slots__ = ("done", "_waiters", "_cond")

    def __init__(self) -> None:
        self.done = 0
        self._waiters = 0
        self._cond = threading.Condition(threading.Lock())

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more done (from the one thread that produces them)."""
        self.done += n
        if self._waiters:
            with self._cond:
                self._cond.notify_all()

    def reset(self) -> None:
        """Back to zero (only with nothing in flight)."""
        self.done = 0

    def wait(self, target: int, guard: Guard, what: str) -> None:
        """Block until the count is at least ``target``, another thread fails, or timeout."""
        if self.done >= target:  # an int read: no lock needed to see that it is done
            return
        deadline = None if guard.timeout_s is None else time.monotonic() + guard.timeout_s
        with self._cond:
            self._waiters += 1
            try:
                while self.done < target:
                    self._cond.wait(POLL_S)
                    if self.done < target:
                        guard.check_until(deadline, what)
            finally:
                self._waiters -= 1
