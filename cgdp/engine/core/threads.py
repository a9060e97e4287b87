"""One host thread per device, for the whole run: it drives that device's forward, backward and update (a CUDA device is
bound to its thread once, at start).

:meth:`DeviceThreads.run_all` runs a function on every device's thread and waits for all. A failure is reported to the
step's :class:`~cgdp.engine.sync.Guard`, so the others stop waiting; the caller sees the first real failure, not the
aborts it caused.

Bounded waits: the caller waits at most ``timeout_s`` (plus a tenth, at most 1 s, so the threads' own timeouts fire
first), then raises ``TimeoutError``; Ctrl-C surfaces within :data:`~cgdp.engine.sync.POLL_S`. Either way
:attr:`DeviceThreads.stuck` names the threads still busy, which the trainer refuses to use again. Threads are daemons;
:meth:`close` never joins a stuck one.

Intra-op threads: on CPU-emulated devices each device thread gets one share of the cores (:func:`intra_op_threads`); the
caller's count is unchanged once the engine is built (Numba's threading layer starts on a thread of its own:
:func:`start_numba_threads`).

Turns (:meth:`DeviceThreads.computing`): with more devices than cores, threads dispatching operators hand the GIL over
at every operator, which costs more than it carries, so at most ``cores - 1`` compute at once. A turn is held only
around work that never waits for another device, so turns cannot deadlock, and never change what is computed.
"""
from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

from cgdp.engine.backend.base import Device
from cgdp.engine.core import fork
from cgdp.engine.sync import POLL_S, Guard, StepAborted

STOP_WAIT_S = 0.5
"""After a failure or Ctrl-C, how long the caller waits for the other threads to stop (then they count as stuck)."""


class _DeviceThread:
    """A daemon thread running submitted functions in order (a one-thread pool that exit never joins)."""

    def __init__(self, dev: Device, intra_op: int | None = None):
        self.name = dev.name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=_serve, args=(self._q, dev.bind_thread, intra_op),
                                       name=f"cgdp-{dev.name}", daemon=True)
        self.thread.start()

    def submit_to(self, slot: Any, fn: Callable[..., Any], *args: Any) -> Any:
        self._q.put((slot, fn, args))
        return slot

    def stop(self) -> None:
        self._q.put(None)


def _serve(q: queue.SimpleQueue, bind: Callable[[], None], intra_op: int | None) -> None:
    # a plain function (not a method): the thread holds its queue, never the trainer
    bind()
    if intra_op is not None:
        # torch sets a thread's count from the process's at the thread's first parallel operator (or count query): done
        # first, so that it cannot overwrite this thread's own count later
        torch.get_num_threads()
        torch.set_num_threads(intra_op)  # this thread's own OpenMP and MKL counts (see intra_op_threads)
    while True:
        item = q.get()  # idle between steps
        if item is None:
            return
        fut, fn, args = item  # nothing is ever cancelled
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)
        del item, fut, fn, args  # drop the step's objects while idle


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_at_once(num_devices: int) -> int:
    """All at once while each thread can have a core, else ``cores - 1`` (one left to the host thread and the caller):
    on 2 cores one at a time cut cgdp's CPU per device per step 4.9 -> 1.3 ms (G = 4, ``bench/bench_host_cost.py``)."""
    cores = usable_cores()
    return num_devices if num_devices <= cores else max(1, cores - 1)


def threads_per_device(num_devices: int) -> int:
    return max(1, usable_cores() // num_devices)


def _on_new_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own (whose intra-op count starts from the process-wide one)."""
    with ThreadPoolExecutor(1, thread_name_prefix="cgdp-intra-op-count") as once:
        return once.submit(fn).result()


@functools.lru_cache(maxsize=None)
def start_numba_threads() -> None:
    """Start Numba's threading layer (once per process) on a thread of its own.

    Its ``omp`` layer shares torch's GNU OpenMP runtime, and starting it sets the starting thread's OpenMP count, its
    torch intra-op count, to every core (``omp_set_num_threads``). Started by the host kernels' warm-up on the caller,
    a caller at ``torch.set_num_threads(1)`` computed on 2 threads, whose OpenMP pool thread spun on a core the device
    threads needed (a 48 x Linear(32) step 3x slower on 2 cores). A throwaway thread takes the change instead."""
    import numba  # the host kernels' dependency (cgdp.engine.core.accumulate), imported where it is started
    _on_new_thread(numba.get_num_threads)  # Numba starts its layer at its first thread query


@functools.lru_cache(maxsize=None)
def _counts_per_thread() -> bool:
    """Whether torch keeps the intra-op count per thread (OpenMP backend; the native one has one pool per process)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def intra_op_threads(devs: Sequence[Device]) -> int | None:
    """torch's intra-op threads per device thread, or None to leave torch's count: on CPU-emulated devices G pools over
    every core fight (README, "Performance"), so each thread gets :func:`threads_per_device`, at most the caller's
    count. Left alone: ``OMP_NUM_THREADS`` when set, GPUs, and builds whose count is not per thread."""
    if any(getattr(d, "is_cuda", False) for d in devs) or os.environ.get("OMP_NUM_THREADS") \
            or not _counts_per_thread():
        return None
    return min(torch.get_num_threads(), threads_per_device(len(devs)))


class DeviceThreads:
    def __init__(self, devs: Sequence[Device], guard: Guard, at_once: int | None = None):
        """``at_once``: how many device threads may compute at once (default: :func:`default_at_once`)."""
        fork.engine_started()  # children forked from now on compute on one thread
        start_numba_threads()  # before anything of cgdp's runs a host kernel on this thread
        self._guard = guard
        self.intra_op = intra_op_threads(devs)
        """torch's intra-op threads of each device thread (None: torch's own count)."""
        torch.get_num_threads()  # fixes the caller's own count before the threads start
        # the count threads starting later begin from (set_num_threads sets it, on any thread)
        start = _on_new_thread(torch.get_num_threads) if self.intra_op is not None else None
        self._threads = [_DeviceThread(d, self.intra_op) for d in devs]
        if start is not None:
            for t in self._threads:  # note: waits until each thread has set its own count (at start)
                t.submit_to(Future(), lambda: None).result()
            _on_new_thread(lambda: torch.set_num_threads(start))  # as it was; nobody's own count changes
        self.at_once = n = default_at_once(len(devs)) if at_once is None else max(1, min(at_once, len(devs)))
        """Device threads computing at once (fewer than the devices: they take turns)."""
        self._turns = threading.Semaphore(n) if n < len(devs) else None
        self._queued: set[str] = set()
        """Device threads waiting for a turn (not stuck themselves: a timeout does not name them)."""
        self._later: deque[tuple[_DeviceThread, _Slot, Callable[[int], Any], int]] = deque()
        """Work started only when a turn is free (:meth:`run_all` with ``turns``), in device order."""
        self._later_lock = threading.Lock()
        self._mine = threading.local()
        """``granted``: this thread was started with a turn that its first :meth:`computing` takes."""
        self.stuck: list[str] = []
        """Devices whose thread did not come back from an abandoned call (the trainer is unusable)."""

    def run_all(self, fn: Callable[[int], Any], computing: bool = False, turns: bool = False) -> list[Any]:
        """``[fn(0), fn(1), ...]``, each on its device's thread; the first real failure is raised. ``computing``: each
        ``fn(j)`` runs in a turn and must not wait for another device; ``turns``: ``fn(j)`` takes its turn itself
        (:meth:`computing`). While devices take turns, ``fn(j)`` starts only when a turn is free and is handed it (so
        its thread wakes once), held until its first :meth:`computing` or its end."""
        left = _Countdown(len(self._threads))
        if self._turns is not None and (computing or turns):
            futs = [_Slot(left) for _ in self._threads]
            with self._later_lock:
                for j, (t, f) in enumerate(zip(self._threads, futs)):
                    self._later.append((t, f, fn, j))
                    self._queued.add(t.thread.name)
                for _ in range(self.at_once):
                    if not self._turns.acquire(blocking=False):
                        break
                    self._start_next()
        else:
            futs = [t.submit_to(_Slot(left), self._guarded, fn, j) for j, t in enumerate(self._threads)]
        self._wait(futs, "a forward or loss_fn")  # note: host waits for the device threads
        if left.every:  # a slot failed
            errors = [f.error for f in futs if f.error is not None]
            # the first failure recorded anywhere (a device, the host, the comm) is the cause; what the other threads
            # raised (aborts, their own timeouts) follows from it
            raise self._guard.error or next((e for e in errors if not isinstance(e, StepAborted)), errors[0])
        return [f.result for f in futs]

    def run_beside(self, first: Callable[[], Any], fns: Sequence[Callable[[], Any]]) -> tuple[Any, list]:
        """``first()`` on the caller's thread while ``fns[j - 1]()`` runs on device j's thread, j >= 1; ``first``'s
        result and ``(j, error)`` of each that raised (``first``'s own error is raised once all are done). The wait is
        :meth:`run_all`'s: bounded, Ctrl-C surfaces, a thread still busy after it is :attr:`stuck`."""
        left = _Countdown(len(fns))
        futs = [_DONE] + [t.submit_to(_Slot(left), self._guarded, lambda _, fn=fn: fn(), j)
                          for j, (t, fn) in enumerate(zip(self._threads[1:], fns), start=1)]  # device 0's: ``first``
        try:
            out = first()
        except Exception:
            self._wait(futs, "an optimizer.step()")  # note: host waits for the device threads
            raise
        except BaseException as exc:  # Ctrl-C in ``first``: the others get STOP_WAIT_S to stop
            self._abandon(futs, exc)
            raise
        if left.left:  # (the others mostly finished while ``first`` ran)
            self._wait(futs, "an optimizer.step()")  # note: host waits for the device threads
        return out, [(j, f.error) for j, f in enumerate(futs) if f.error is not None]

    def _wait(self, futs: list, what: str) -> None:
        """Wait for every thread, waking every POLL_S (so Ctrl-C surfaces), bounded by timeout_s; a timeout or Ctrl-C
        abandons the call (:meth:`_abandon`)."""
        timeout = self._guard.timeout_s
        # the device threads' own waits time out after timeout_s with a message naming what they waited for; this outer
        # bound fires just after, for a thread stuck outside any wait
        deadline = None if timeout is None else time.monotonic() + timeout + min(0.1 * timeout, 1.0)
        # after a failure elsewhere, a waiting thread stops at its next wake-up and a computing one when its computation
        # ends; both are waited for (a thread still busy at the deadline is stuck)
        try:
            for f in futs:
                while not f.wait(POLL_S):
                    if deadline is not None and time.monotonic() > deadline:
                        if self._guard.error is not None:  # the cause, not the thread it left stuck
                            raise self._guard.error
                        left = [t for t, g in zip(self._threads, futs) if not g.done]
                        # a thread waiting for a turn is not stuck: name the ones in their turn
                        busy = [t.name for t in left if t.thread.name not in self._queued] or [t.name for t in left]
                        raise TimeoutError(f"the device thread(s) of {', '.join(busy)} did not finish within "
                                           f"timeout_s = {timeout:g} s ({what} that never "
                                           f"returns?); raise timeout_s if a step can really take that long")
        except BaseException as exc:  # a timeout here, or KeyboardInterrupt
            self._abandon(futs, exc)
            raise

    def _abandon(self, futs: list[_Slot], exc: BaseException) -> None:
        self._guard.fail(exc)  # every waiting thread stops at its next wake-up
        futs[-1].wake_every_time()  # so that the wait below sees each thread stop as it stops
        with self._later_lock:  # work not started yet never starts
            later, self._later = self._later, deque()
        for t, f, _, _ in later:
            self._queued.discard(t.thread.name)
            f.set_exception(StepAborted("another thread of this step failed"))
        # stuck until they stop: a second Ctrl-C while they are given time leaves them so
        self.stuck = [t.name for t, f in zip(self._threads, futs) if not f.done]
        deadline = time.monotonic() + STOP_WAIT_S
        for f in futs:
            left = deadline - time.monotonic()
            if left <= 0 or not f.wait(left):
                break
        self.stuck = [t.name for t, f in zip(self._threads, futs) if not f.done]

    def _guarded(self, fn: Callable[[int], Any], j: int) -> Any:
        try:
            return fn(j)
        except BaseException as exc:
            self._guard.fail(exc)
            raise

    def _start_next(self) -> None:
        """Hand a turn (under ``_later_lock``) to the next work waiting to start, else free it."""
        if not self._later:
            self._turns.release()
            return
        t, slot, fn, j = self._later.popleft()
        self._queued.discard(t.thread.name)
        t.submit_to(slot, self._started, fn, j)

    def _started(self, fn: Callable[[int], Any], j: int) -> Any:
        """Work started in a turn; the turn goes back at its first :meth:`computing`, or here."""
        mine = self._mine
        mine.granted = True
        try:
            return self._guarded(fn, j)  # also after a failure elsewhere, as a thread waiting for its turn did
        finally:
            if mine.granted:
                mine.granted = False
                self._give_turn()

    def _give_turn(self) -> None:
        with self._later_lock:
            self._start_next()

    @contextmanager
    def computing(self, on: bool = True) -> Iterator[None]:
        """Around device-thread work that never waits for another device: at most :attr:`at_once` threads at a time."""
        turns = self._turns
        granted = turns is not None and getattr(self._mine, "granted", False)  # started with a turn
        if granted:
            self._mine.granted = False
            if not on:
                self._give_turn()
        if turns is None or not on:
            yield
            return
        if not granted and not turns.acquire(blocking=False):
            me = threading.current_thread().name
            self._queued.add(me)
            try:
                while not turns.acquire(timeout=POLL_S):  # note: waits for another device's turn to end
                    self._guard.check()
            finally:
                self._queued.discard(me)
        try:
            yield
        finally:
            self._give_turn()

    def on_device_thread(self) -> bool:
        """Whether the calling thread is one of the device threads (e.g. inside ``loss_fn``)."""
        me = threading.current_thread()
        return any(t.thread is me for t in self._threads)

    def close(self) -> None:
        """Stop every thread; joins only threads that are idle (a stuck one is left, a daemon)."""
        for t in self._threads:
            t.stop()
        for t in self._threads:
            if t.name not in self.stuck and t.thread is not threading.current_thread():
                t.thread.join(timeout=STOP_WAIT_S)
        self._threads = []


class _Countdown:
    """A run_all's shared condition, its slots not yet done, and whether each one finishing wakes the waiters."""

    __slots__ = ("cond", "left", "every")

    def __init__(self, n: int):
        self.cond, self.left, self.every = threading.Condition(threading.Lock()), n, False


class _Slot:
    """One device's part of a :meth:`DeviceThreads.run_all` (the ``Future`` methods its thread calls), on the call's
    shared condition: the caller wakes once per call (the last done, or a failure), not once per device."""

    __slots__ = ("_cond", "_left", "done", "result", "error")

    def __init__(self, left: _Countdown):
        self._cond, self._left = left.cond, left
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None

    def set_result(self, result: Any) -> None:
        with self._cond:
            self.result, self.done = result, True
            self._finished()

    def set_exception(self, exc: BaseException) -> None:
        with self._cond:
            self.error, self.done = exc, True
            self._left.every = True  # failed: from now on every slot wakes the waiters
            self._finished()

    def wake_every_time(self) -> None:
        with self._cond:
            self._left.every = True

    def _finished(self) -> None:
        left = self._left
        left.left -= 1
        if left.left == 0 or left.every:
            self._cond.notify_all()

    def wait(self, timeout: float | None) -> bool:
        if not self.done:
            with self._cond:
                return self._cond.wait_for(lambda: self.done, timeout)
        return True


_DONE = _Slot(_Countdown(0))
"""A part already done (:meth:`DeviceThreads.run_beside`'s own, on the caller's thread)."""
_DONE.done = True


def caller_context(device_types: Sequence[str] = ("cuda", "cpu"), grad: bool = True
                   ) -> Callable[[], ContextManager[Any]]:
    """A context factory that re-enters, on a device thread, the caller's autocast for ``device_types`` and (``grad``)
    its grad and inference mode, which torch keeps per thread."""
    casts = [(dt, torch.get_autocast_dtype(dt), torch.is_autocast_cache_enabled()) for dt in device_types
             if torch.is_autocast_enabled(dt)]
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) if grad else None
    if not casts and modes is None:
        return nullcontext

    @contextmanager
    def enter() -> Iterator[None]:
        with ExitStack() as stack:
            if modes is not None:
                stack.enter_context(torch.inference_mode() if modes[1] else torch.set_grad_enabled(modes[0]))
            for dt, dtype, cache in casts:
                stack.enter_context(torch.autocast(dt, dtype=dtype, cache_enabled=cache))
            yield
    return enter

