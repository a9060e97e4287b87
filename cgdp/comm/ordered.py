"""The comm thread: posts chunk allreduces and completes them in order, never waiting forever.

:class:`OrderedComm` is the part of a :class:`~cgdp.comm.Comm` that every implementation shares
(MPI in :mod:`cgdp.comm.mpi`, threads in one process in :mod:`cgdp.comm.inproc`). A subclass only
says how to *start* an allreduce (``_start``), how to *test* it (``_test``) and how to idle
between tests (``_idle``).

Threads and order:

* ``post`` is called by the engine's host-accumulator thread, chunks in plan order. It only
  enqueues and returns (like a backward hook: no waiting on the training path).
* One daemon thread per comm (``cgdp-comm-r<rank>``) takes posts from the queue, starts each at
  once, and waits for the *oldest* one (blocking in ``_block``, or polling ``_test``); when it
  completes it runs its ``on_done`` and moves to the next. So ``on_done`` callbacks run on the
  comm thread, one at a time, in post order, which is the same on every rank.
* A watchdog thread (``cgdp-comm-watchdog-r<rank>``, when ``timeout_s`` is set) looks every
  ``min(1 s, timeout_s/20)`` at the oldest chunk; the comm thread itself may be blocked in MPI.
* ``fence`` (the engine's step thread) waits until every posted chunk has run its ``on_done``.

Failures: if the oldest allreduce makes no progress for ``timeout_s`` seconds (measured from when
it was posted or from the previous completion, whichever is later), a peer died or stalls. The
watchdog records a ``TimeoutError`` naming this rank, the chunk and the step, reports it
through the engine's ``fail`` callback and stops; ``fence`` raises it, and every later call raises
it again: a comm that failed once is out of step with its peers for good.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from cgdp.comm.base import Comm


class CommFailed(RuntimeError):
    """A collective failed or timed out earlier; this comm is out of step with its peers."""


@dataclass
class _InFlight:
    seq: int
    key: int
    buf: np.ndarray  # kept referenced while the allreduce writes into it
    on_done: Callable[[], None]
    handle: Any = None
    t_post: float = field(default_factory=time.monotonic)


class OrderedComm(Comm):
    """A ``Comm`` whose chunk allreduces are driven by one dedicated thread, in post order."""

    def __init__(self, rank: int, size: int, timeout_s: float | None):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds or None (wait forever), got {timeout_s!r}")
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self._fail: Callable[[BaseException], None] = lambda exc: None
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._posted = 0     # chunks posted since the comm started (all steps)
        self._completed = 0  # of those, how many have run their on_done
        self._head: _InFlight | None = None  # oldest chunk not complete (for error messages)
        self._last_progress = time.monotonic()  # last start-from-idle or completion
        self._error: BaseException | None = None
        self._closed = False
        self.step = 0  # number of fences passed: the training step, for error messages
        self.comm_s = 0.0  # time chunks spent in flight, summed (post → complete)
        self._failed_reported = False
        self._thread = threading.Thread(target=self._run, name=f"cgdp-comm-r{rank}", daemon=True)

    blocking = False
    """True: the comm thread blocks in ``_block`` on the oldest chunk (the watchdog enforces the
    timeout); False: it polls with ``_test`` and ``_idle``."""

    def _start_thread(self) -> None:
        self._thread.start()
        if self.timeout_s is not None:
            threading.Thread(target=self._watch, name=f"cgdp-comm-watchdog-r{self.rank}",
                             daemon=True).start()

    # ------------------------------------------------------------------ what a subclass provides
    def _start(self, item: _InFlight) -> Any:
        """Start the in-place SUM allreduce of ``item.buf``; return a handle for ``_test``."""
        raise NotImplementedError

    def _test(self, handle: Any) -> bool:
        """True when the allreduce behind ``handle`` has completed (never blocks)."""
        raise NotImplementedError

    def _block(self, handle: Any) -> None:
        """Return when the allreduce behind ``handle`` has completed (``blocking`` subclasses)."""
        raise NotImplementedError

    def _idle(self, since_progress_s: float) -> None:
        """Pause the comm thread briefly between two tests of an incomplete allreduce."""
        raise NotImplementedError

    def _on_failure(self, exc: BaseException) -> None:
        """Hook: what else to do once the comm has failed (MPI aborts the job at exit)."""

    # ------------------------------------------------------------------ the engine's side
    def post(self, key: int, buf: np.ndarray, on_done: Callable[[], None]) -> None:
        self._check_ok()
        if not isinstance(buf, np.ndarray) or buf.ndim != 1 or not buf.flags.c_contiguous \
                or not buf.flags.writeable:
            raise TypeError("post() needs a writeable contiguous 1-D NumPy array (a slice of the "
                            f"host accumulator), got {type(buf).__name__}"
                            f"{'' if not isinstance(buf, np.ndarray) else f' {buf.shape} {buf.strides}'}")
        with self._cond:
            seq = self._posted
            self._posted += 1
        self._queue.put(_InFlight(seq, int(key), buf, on_done))

    def fence(self, timeout: float | None = None) -> None:
        """Block until every posted chunk has completed and run its ``on_done``.

        Raises the comm's error if one occurred, and ``TimeoutError`` if no chunk completes for
        ``timeout`` seconds (default: the comm's ``timeout_s``).
        """
        timeout = self.timeout_s if timeout is None else timeout
        with self._cond:
            last = (self._completed, time.monotonic())
            while self._completed < self._posted and self._error is None:
                # note: the step thread waits here for the comm thread (the chunks still in flight)
                self._cond.wait(0.05)
                now = time.monotonic()
                if self._completed != last[0]:
                    last = (self._completed, now)
                elif timeout is not None and now - last[1] > timeout:
                    exc = TimeoutError(self._stuck_message(timeout))
                    self._set_error(exc)
                    break
            error = self._error
            if error is None:
                self.step += 1
        if error is not None:
            self._after_failure(error)
            raise error

    def close(self) -> None:
        if self._closed:
            return
        with self._cond:
            in_flight = self._posted - self._completed
            if in_flight and self._error is None:
                exc = CommFailed(f"rank {self.rank}: closed with {in_flight} allreduce(s) still in "
                                 f"flight; the other ranks are out of step with this one")
                self._set_error(exc)
            else:
                exc = None
        if exc is not None:
            self._after_failure(exc)
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._queue.put(None)
            # note: waits for the comm thread to leave its loop; after a failure it may be stuck
            # in a collective that will never complete, so do not wait for it then
            self._thread.join(timeout=5.0 if self._error is None else 0.1)

    # ------------------------------------------------------------------ the comm thread
    def _run(self) -> None:
        inflight: collections.deque[_InFlight] = collections.deque()
        try:
            while True:
                # take new posts: block only when nothing is in flight
                while True:
                    try:
                        # note: the comm thread waits here for the next chunk when it is idle
                        item = self._queue.get(block=not inflight)
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    if self._error is not None:
                        continue  # failed: start nothing more (the peers are out of step)
                    item.handle = self._start(item)
                    with self._cond:
                        if not inflight:
                            self._last_progress = time.monotonic()
                            self._head = item
                    inflight.append(item)
                if not inflight:
                    continue
                head = inflight[0]
                if self.blocking:
                    # note: the comm thread waits inside MPI (GIL released) for the oldest chunk;
                    # the watchdog thread enforces timeout_s meanwhile
                    self._block(head.handle)
                elif not self._test(head.handle):
                    self._idle(time.monotonic() - self._last_progress)
                    continue
                inflight.popleft()
                if self._error is not None:
                    continue  # declared failed meanwhile: the engine has moved on, leave its buffers
                now = time.monotonic()
                self.comm_s += now - head.t_post
                head.on_done()
                with self._cond:
                    self._completed += 1
                    self._last_progress = now
                    self._head = inflight[0] if inflight else None
                    self._cond.notify_all()
        except BaseException as exc:  # reported, never lost: the step raises it
            with self._cond:
                self._set_error(exc)
            self._after_failure(exc)

    def _watch(self) -> None:
        """Watchdog thread: fail the comm when the oldest chunk makes no progress for timeout_s."""
        assert self.timeout_s is not None
        tick = min(1.0, self.timeout_s / 20)
        while True:
            with self._cond:
                if self._closed or self._error is not None:
                    return
                head = self._head
                left = tick
                if head is not None:
                    left = max(head.t_post, self._last_progress) + self.timeout_s - time.monotonic()
                    if left <= 0:
                        exc = TimeoutError(self._stuck_message(self.timeout_s))
                        self._set_error(exc)
                        break
                # note: the watchdog sleeps until the oldest chunk's deadline (or its next look)
                self._cond.wait(min(tick, left))
        self._after_failure(exc)

    # ------------------------------------------------------------------ failures
    def _stuck_message(self, waited: float) -> str:
        head = self._head
        what = (f"the allreduce of chunk {head.key} ({head.buf.size} values)" if head is not None
                else "the allreduces posted")
        return (f"rank {self.rank} of {self.size}: {what} in step {self.step} made no progress for "
                f"{waited:g} s: another rank died, stalls, or runs a different chunk plan. "
                f"{self._peer_hint()}Check the other ranks' output; raise timeout_s if a step can "
                f"really take that long")

    def _peer_hint(self) -> str:
        """Extra words on which peer is missing, when the implementation can tell."""
        return ""

    def _set_error(self, exc: BaseException) -> None:
        """Record the first failure (caller holds ``_cond``) and wake every waiter."""
        if self._error is None:
            self._error = exc
        self._cond.notify_all()

    def _after_failure(self, exc: BaseException) -> None:
        with self._cond:
            first = not self._failed_reported
            self._failed_reported = True
        self._fail(exc)
        if first:
            self._on_failure(exc)

    def _check_ok(self) -> None:
        if self._closed:
            raise CommFailed(f"rank {self.rank}: this comm was closed; build a new Trainer")
        if self._error is not None:
            raise CommFailed(f"rank {self.rank}: an earlier collective failed ({self._error}); this "
                             f"rank is out of step with its peers, restart the job") from self._error
