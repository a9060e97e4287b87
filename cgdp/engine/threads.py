"""One host thread per device, for the whole run: it drives that device's forward, backward and
update (a CUDA device is bound to its thread once, at start).

:meth:`DeviceThreads.run_all` runs one function on every device's thread and waits for all of
them. A failure on any thread is reported to the step's :class:`~cgdp.engine.sync.Guard`, so
that the other threads stop waiting, and the first real failure (not the aborts it caused) is
what the caller sees.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from cgdp.engine.backend.base import Device
from cgdp.engine.sync import Guard, StepAborted


class DeviceThreads:
    def __init__(self, devs: Sequence[Device], guard: Guard):
        self._guard = guard
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"cgdp-{d.name}", initializer=d.bind_thread)
                       for d in devs]

    def run_all(self, fn: Callable[[int], Any]) -> list[Any]:
        """``[fn(0), fn(1), ...]``, each on its device's thread; the first real failure is raised."""
        futs: list[Future] = [pool.submit(self._guarded, fn, j) for j, pool in enumerate(self._pools)]
        results, first = [], None
        for f in futs:
            try:
                results.append(f.result())  # note: host waits for the device threads
            except BaseException as exc:
                if first is None or (isinstance(first, StepAborted) and not isinstance(exc, StepAborted)):
                    first = exc
        if first is not None:
            # the first failure recorded anywhere (a device, the host, the comm) is the cause;
            # what the other threads raised (aborts, their own timeouts) follows from it
            if self._guard.error is not None:
                raise self._guard.error
            raise first
        return results

    def submit(self, j: int, fn: Callable[[], Any]) -> Future:
        """``fn()`` on device j's thread, without waiting (the caller waits on the future)."""
        return self._pools[j].submit(self._guarded, lambda _: fn(), j)

    def _guarded(self, fn: Callable[[int], Any], j: int) -> Any:
        try:
            return fn(j)
        except BaseException as exc:
            self._guard.fail(exc)
            raise

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)
        self._pools = []
