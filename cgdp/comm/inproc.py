"""R "ranks" as threads of one process: the MPI tier's semantics without mpiexec, for tests.

An :class:`InProcGroup` of size R is shared by R :class:`InProcComm` objects, one per rank; each
rank is usually driven by its own thread (one ``Trainer`` per thread). The semantics are those of
:class:`cgdp.comm.mpi.MPIComm`:

* chunk allreduces are SUMs, in place, started and completed in post order by each rank's own
  comm thread (:class:`~cgdp.comm.ordered.OrderedComm`), ``on_done`` on that thread;
* the sum is formed in rank order 0, 1, …, R-1 once, by the last rank to arrive, and written
  into every rank's buffer, so all ranks hold bitwise identical results;
* the n-th collective of each kind on one rank matches the n-th on every other rank, and a
  mismatch (a different chunk, a different length) is an error naming both ranks, where MPI would
  silently mix data or hang;
* every wait has the comm's timeout, and a rank that stops taking part makes the others raise
  ``TimeoutError`` naming the missing ranks.

Buffers: a posted buffer belongs to the group until its ``on_done``; the last rank to arrive
writes into the other ranks' buffers (they are all waiting for that collective, so nobody else
touches them).
"""
from __future__ import annotations

import copy
import pickle
import threading
import time
from typing import Any

import numpy as np

from cgdp.comm.ending import describe_mismatch
from cgdp.comm.ordered import CommFailed, OrderedComm, _InFlight


class _Slot:
    """One collective: what each rank brought, and the result once everybody has."""

    def __init__(self) -> None:
        self.parts: dict[int, Any] = {}
        self.tags: dict[int, Any] = {}
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False


class InProcGroup:
    """The shared state of R in-process ranks; ``group.comms()`` gives one comm per rank."""

    def __init__(self, size: int, timeout_s: float | None = 60.0):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"an in-process group needs size >= 1 ranks, got {size!r}")
        self.size = size
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._comms = [InProcComm(self, r, timeout_s) for r in range(size)]

    def comms(self) -> list["InProcComm"]:
        return list(self._comms)

    def comm(self, rank: int) -> "InProcComm":
        return self._comms[rank]

    # ------------------------------------------------------------------ matching collectives
    def arrive(self, kind: str, seq: int, rank: int, part: Any, tag: Any) -> _Slot:
        """Rank ``rank`` brings its ``part`` to the ``seq``-th collective of ``kind``."""
        with self.cond:
            slot = self._slots.setdefault((kind, seq), _Slot())
            slot.parts[rank] = part
            slot.tags[rank] = tag
            if len(slot.parts) == self.size:
                try:
                    slot.result = self._combine(kind, seq, slot)
                except BaseException as exc:
                    slot.error = exc
                slot.done = True
                del self._slots[(kind, seq)]
                self.cond.notify_all()
            return slot

    def missing(self, kind: str, seq: int) -> list[int]:
        with self.cond:
            slot = self._slots.get((kind, seq))
            return [] if slot is None else [r for r in range(self.size) if r not in slot.parts]

    def wait(self, slot: _Slot, kind: str, seq: int, rank: int, what: str,
             timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not slot.done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    gone = [r for r in range(self.size) if r not in slot.parts]
                    raise TimeoutError(
                        f"rank {rank} of {self.size}: {what} did not complete within {timeout:g} s: "
                        f"rank(s) {gone} never joined it (died, stall, or run a different program). "
                        f"Check those ranks; raise timeout_s if a step can really take that long")
                # note: this rank's thread waits for the other ranks to join the collective
                self.cond.wait(left if left is not None else 0.5)
        if slot.error is not None:
            raise slot.error
        return slot.result

    def _combine(self, kind: str, seq: int, slot: _Slot) -> Any:
        tags = slot.tags
        if len(set(map(repr, tags.values()))) > 1:
            first = tags[0]
            other = next(r for r in range(self.size) if tags[r] != first)
            raise CommFailed(
                f"collective #{seq} ({kind}) does not match across ranks: rank 0 brought {first!r} "
                f"but rank {other} brought {tags[other]!r}. The ranks run different chunk plans or "
                f"models; start every rank with the same config")
        parts = [slot.parts[r] for r in range(self.size)]
        if kind in ("chunk", "small"):
            total = parts[0].copy()
            for p in parts[1:]:  # rank order, once: every rank gets the same bits
                total += p
            if kind == "chunk":
                for p in parts:
                    p[:] = total
            return total
        if kind == "bcast":
            return parts[0]  # rank 0's pickled bytes
        if kind == "gather":
            return parts
        raise AssertionError(kind)


class InProcComm(OrderedComm):
    """One rank of an :class:`InProcGroup`; see the module docstring."""

    def __init__(self, group: InProcGroup, rank: int, timeout_s: float | None):
        super().__init__(rank, group.size, timeout_s)
        self.group = group
        self._seq = {"small": 0, "bcast": 0, "gather": 0}
        self._start_thread()

    # ------------------------------------------------------------------ chunk allreduces
    def _start(self, item: _InFlight) -> Any:
        tag = (item.key, item.buf.size, item.buf.dtype.str)
        return self.group.arrive("chunk", item.seq, self.rank, item.buf, tag)

    def _test(self, handle: Any) -> bool:
        if handle.done and handle.error is not None:
            raise handle.error
        return handle.done

    def _idle(self, since_progress_s: float) -> None:
        with self.group.cond:
            # note: the comm thread waits for the other ranks to post this chunk
            self.group.cond.wait(0.05)

    def _peer_hint(self) -> str:
        head = self._head
        if head is None:
            return ""
        gone = self.group.missing("chunk", head.seq)
        return f"Rank(s) {gone} never posted it. " if gone else ""

    # ------------------------------------------------------------------ blocking small collectives
    def _collective(self, kind: str, part: Any, tag: Any, what: str) -> Any:
        self._check_ok()
        seq = self._seq[kind]
        self._seq[kind] += 1
        slot = self.group.arrive(kind, seq, self.rank, part, tag)
        try:
            return self.group.wait(slot, kind, seq, self.rank, what, self.timeout_s)
        except BaseException as exc:
            with self._cond:
                self._set_error(exc)
            self._after_failure(exc)
            raise

    def allreduce_small(self, arr: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(arr).copy()
        total = self._collective("small", a, (a.shape, a.dtype.str), f"allreduce_small of {a.size} values")
        return total.copy()

    def broadcast_object(self, obj: Any) -> Any:
        data = pickle.dumps(obj) if self.rank == 0 else None
        data = self._collective("bcast", data, None, "broadcast_object from rank 0")
        return obj if self.rank == 0 else pickle.loads(data)

    def check_same(self, signature: dict[str, str]) -> None:
        mine = {"signature": copy.deepcopy(dict(signature)), "host": "in-process",
                "world_size": str(self.size)}
        every = self._collective("gather", mine, None, "check_same (start-up check)")
        message = describe_mismatch(every)
        if message is not None:
            raise RuntimeError(message)
