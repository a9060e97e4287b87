"""How threads of one step wait for each other without ever hanging.

Every thread the engine owns (device threads, stream workers, the accumulator, the comm thread)
reports its exception to one :class:`Guard`. Every place where a thread waits goes through
:meth:`Guard.wait`, which wakes up regularly to check whether another thread failed or the
timeout has passed. So a failure anywhere surfaces as an exception in ``Trainer.step()`` and a
lost message as a ``TimeoutError`` naming what never came, never as a hang.
"""
from __future__ import annotations

import threading
import time

POLL_S = 0.05
"""How often a waiting thread looks at the failure flag (a wake-up costs microseconds)."""


class StepAborted(RuntimeError):
    """Raised in threads that stop because another thread of the step failed."""


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

    def wait(self, event: threading.Event, what: str) -> None:
        """Block the calling thread until ``event`` is set, another thread fails, or timeout."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while not event.wait(POLL_S):
            self.check()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout_s:g} s for {what}; raise timeout_s if a "
                                   f"step can really take that long")
        self.check()
