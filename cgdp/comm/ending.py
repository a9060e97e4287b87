"""A comm whose process ends by itself after a failure: shared by the MPI and the gloo comms.

After a failed collective the job cannot go on (neither MPI nor gloo can cancel a collective; the
other ranks are inside collectives this rank will never join). With ``abort_on_failure`` (the
default) the error is written (stderr, and ``error_file`` when given), raised to the caller, and
this process ends when it exits, or ``abort_grace_s`` later at most, through
:func:`cgdp.comm.abort.end` (``MPI_Abort`` where MPI is up, then ``os._exit``): never a wait in
``MPI_Finalize`` or in a process group's destructor behind a dead link.

The exit handler is registered *before* the comm's own set-up collectives, so that a rank whose
set-up failed (a peer never came, a link cut during start-up) ends the same way, instead of
raising and then waiting for ever at interpreter exit.

The start-up check (:meth:`EndingComm.check_same`, with :func:`describe_mismatch`'s words naming
the ranks and fields that differ) is shared too.

May import: nothing of cgdp outside this package.
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import threading
from typing import Any

from cgdp.comm import abort
from cgdp.comm.ordered import OrderedComm


class EndingComm(OrderedComm):
    """An :class:`~cgdp.comm.ordered.OrderedComm` that ends its process after a failure."""

    job = "job"
    """What ends, in messages ("MPI job", "gloo job")."""

    def _setup_ending(self, MPI: Any, abort_on_failure: bool, abort_grace_s: float,
                      error_file: str | os.PathLike | None) -> None:
        """Call after ``OrderedComm.__init__`` (the rank is known) and before any collective."""
        self.abort_on_failure = abort_on_failure
        self.abort_grace_s = abort_grace_s
        self._abort_armed = False
        if error_file is not None:  # one setting for every rank: "run/rank{rank}.error"
            error_file = os.fspath(error_file).replace("{rank}", str(self.rank))
        abort.configure(MPI, self.rank, self.size, error_file)
        atexit.register(self._at_exit)
        if abort_on_failure and MPI is not None:
            abort.install_excepthook()

    def _finished(self) -> bool:
        """True once the library has shut down (no abort then)."""
        return False

    def _set_error(self, exc: BaseException) -> None:
        if self._error is None and self.abort_on_failure:
            # before any other thread can see the error: the caller may take the GIL and never give
            # it back (a C call), so that no Python thread (the abort timer) runs again; this C
            # watchdog ends the process anyway, and the error is in the file already
            abort.deadline(self.abort_grace_s + 2 * abort.HARD_EXIT_S)
            abort.record(f"cgdp: rank {self.rank}: {type(exc).__name__}: {exc}")
        super()._set_error(exc)

    def _on_failure(self, exc: BaseException) -> None:
        if not self.abort_on_failure:  # the caller handles the error; keep it in the file anyway
            abort.record(f"cgdp: rank {self.rank}: {type(exc).__name__}: {exc}", stderr=False)
            return
        if self._abort_armed:
            return
        self._abort_armed = True
        if exc is not self._error:  # (the first error was written when it was set)
            abort.record(f"cgdp: rank {self.rank}: {type(exc).__name__}: {exc}")
        abort.record(f"cgdp: rank {self.rank}: aborting the {self.job} when this process exits (in "
                     f"{self.abort_grace_s:g} s at most), so that no rank waits forever")
        timer = threading.Timer(self.abort_grace_s, self._abort)  # backed by the deadline (_set_error)
        timer.daemon = True
        timer.start()

    def _abort(self) -> None:
        if self._finished():
            return
        abort.end(f"cgdp: rank {self.rank}: ending the {self.job} now (after the "
                  f"{type(self._error).__name__} above)")

    def _at_exit(self) -> None:
        self.close()  # arms the abort if allreduces are still in flight
        if self._abort_armed:
            self._abort()

    # ------------------------------------------------------------------ the start-up check
    def allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank (blocking, with the timeout)."""
        raise NotImplementedError

    def _versions(self) -> str:
        """The library versions compared at start-up (:func:`versions`)."""
        raise NotImplementedError

    def check_same(self, signature: dict[str, str]) -> None:
        mine = {"signature": {str(k): str(v) for k, v in signature.items()},
                "world_size": str(self.size), "versions": self._versions(),
                "host": socket.gethostname(), "pid": os.getpid()}
        every = [pickle.loads(b) for b in
                 self.allgather_bytes(pickle.dumps(mine), "check_same (start-up check)")]
        message = describe_mismatch(every)
        if message is not None:
            raise RuntimeError(message)  # the same words on every rank: each has every signature


def versions(library: str) -> str:
    import numpy as np
    import torch

    import cgdp
    return f"cgdp {cgdp.__version__}, torch {torch.__version__}, numpy {np.__version__}, {library}"


def _around_difference(a: Any, b: Any, n: int = 90) -> tuple[str, str]:
    """``repr`` of both values, cut to a window around their first difference when long."""
    ra, rb = repr(a), repr(b)
    if len(ra) <= n and len(rb) <= n:
        return ra, rb
    i = next((k for k, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
    lo = max(0, i - n // 3)

    def cut(r: str) -> str:
        return ("…" if lo else "") + r[lo:lo + n] + ("…" if lo + n < len(r) else "")
    return cut(ra), cut(rb)


def describe_mismatch(every: list[dict[str, Any]]) -> str | None:
    """Words naming the ranks and fields that differ from rank 0, or ``None`` if all agree.

    ``every[r]`` is rank r's ``{"signature": {field: str}, "world_size": str, "versions": str,
    "host": str, "pid": int}`` (only ``signature`` is required).
    """
    def fields(d: dict[str, Any]) -> dict[str, Any]:
        f = dict(d["signature"])
        for extra in ("world_size", "versions"):
            if extra in d:
                f[f"({extra.replace('_', ' ')})"] = d[extra]
        return f

    ref = fields(every[0])
    lines: list[str] = []
    bad: list[int] = []
    for r, d in enumerate(every[1:], start=1):
        f = fields(d)
        where = f"rank {r}" + (f" (host {d['host']}, pid {d['pid']})" if "pid" in d else "")
        for key in sorted(set(ref) | set(f)):
            a, b = ref.get(key, "<missing>"), f.get(key, "<missing>")
            if a != b:
                if r not in bad:
                    bad.append(r)
                sa, sb = _around_difference(a, b)
                lines.append(f"  {where} differs from rank 0 in {key}: rank 0 has {sa}, "
                             f"rank {r} has {sb}")
    if not lines:
        return None
    return ("the ranks were not started with the same settings (rank(s) "
            f"{bad} differ from rank 0):\n" + "\n".join(lines) +
            "\nStart every rank with the same config, model, devices count and library versions "
            "(one mpiexec command, one config file)")
