"""How a failed rank ends: its error written where the user finds it, then MPI_Abort, then ``_exit``.

After a failure the MPI job cannot go on (MPI cannot cancel a collective), so it must end. Ending
it is the launcher's work, but the launcher may be out of reach: a cut link, a dead head node.
Then ``MPI_Abort`` reaches nobody and *returns* (MPICH sends the abort to its local
``hydra_pmi_proxy`` and goes on), and the ``MPI_Finalize`` that mpi4py runs at interpreter exit
waits on the proxy's socket for the launcher's answer, forever (seen over UCX). Hydra also forwards each rank's output over the
network, so a far rank's stderr is lost with its link.

So a failed rank never enters ``MPI_Finalize``; :func:`end` does, in this order:

1. the message goes to this process's stderr and to its error file (``error_file``, written and
   fsynced on the rank's own disk, next to ``--out`` for ``python -m cgdp.train``);
2. stdout and stderr are flushed;
3. a hard deadline is armed: faulthandler's watchdog, a C thread that needs neither the GIL nor
   the main thread, writes every thread's stack to the error file (or stderr) and ``_exit(1)``\\ s
   after :data:`HARD_EXIT_S`, should anything below block;
4. ``MPI_Abort(MPI_COMM_WORLD)``: where the launcher is reachable it ends every rank of the job;
5. ``os._exit``: where ``MPI_Abort`` returned, the process ends here, without ``MPI_Finalize``
   and without the atexit handlers not yet run (flush your own files before the error leaves
   your script).

One state per process (:data:`_state`): the first :class:`~cgdp.comm.mpi.MPIComm` built sets the
rank and installs the uncaught-exception hook; an ``error_file`` given to any of them is used.

May import: nothing of cgdp (it is part of :mod:`cgdp.comm`).
"""
from __future__ import annotations

import faulthandler
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import IO, Any

HARD_EXIT_S = 5.0
"""Longest ``MPI_Abort`` may take before the process ends itself anyway."""


@dataclass
class _State:
    MPI: Any = None
    rank: int = 0
    size: int = 1
    error_file: str | None = None
    hook_installed: bool = False
    ending: bool = False
    file: IO[str] | None = None  # the error file, kept open for faulthandler


_state = _State()
_lock = threading.Lock()


def configure(MPI: Any, rank: int, size: int, error_file: str | os.PathLike | None) -> None:
    """Record this process's rank (and error file, if given) for :func:`record` and :func:`end`."""
    with _lock:
        _state.MPI, _state.rank, _state.size = MPI, rank, size
        if error_file is not None:
            _state.error_file = os.fspath(error_file)


def error_file() -> str | None:
    return _state.error_file


def _header() -> str:
    return (f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {_state.rank} of {_state.size} on host "
            f"{socket.gethostname()} (pid {os.getpid()})")


def record(text: str, stderr: bool = True) -> None:
    """Write ``text`` to stderr and append it to the error file (created if need be), synced to disk.

    Never raises: a full disk or a bad path must not hide the error being reported.
    """
    text = text if text.endswith("\n") else text + "\n"
    if stderr:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
    with _lock:
        f = _open()
        try:
            if f is not None:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, ValueError) as exc:
            _cannot_write(exc)


def _open() -> IO[str] | None:
    """The error file, opened (with its header line) on first use; None if there is none. Caller
    holds ``_lock``."""
    if _state.file is None and _state.error_file is not None:
        try:
            _state.file = open(_state.error_file, "a")
            _state.file.write(f"cgdp: {_header()}\n")
            _state.file.flush()
        except (OSError, ValueError) as exc:
            _state.error_file = None  # say so once, then report on stderr only
            _cannot_write(exc)
    return _state.file


def _cannot_write(exc: BaseException) -> None:
    try:
        sys.stderr.write(f"cgdp: rank {_state.rank}: could not write the error file: {exc}\n")
    except (OSError, ValueError):
        pass


def end(text: str, code: int = 1, stderr: bool = True) -> None:
    """Record ``text``, then end the whole job if the launcher can be reached, and this process anyway.

    Never returns. Safe to call from any thread, and more than once (the first call wins).
    """
    with _lock:
        first = not _state.ending
        _state.ending = True
    if not first:
        while True:  # another thread is ending the process (os._exit ends this one too)
            time.sleep(1)
    record(text, stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    deadline(HARD_EXIT_S)
    MPI = _state.MPI
    try:
        if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(code)  # returns when the launcher is out of reach
    finally:
        os._exit(code)


def deadline(seconds: float) -> None:
    """End the process after ``seconds`` even if no Python thread can run (the GIL held, a thread
    stuck in C), writing every thread's stack to the error file (or stderr): the last resort
    behind the orderly :func:`end`. Replaces the previous deadline."""
    with _lock:
        f = _open()
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=f if f is not None else sys.stderr)
    except (OSError, ValueError, RuntimeError):
        pass


def bound_finalize(seconds: float | None) -> None:
    """After a run without failure: should ``MPI_Finalize`` (run by mpi4py after every atexit
    handler) not return within ``seconds``, the kernel ends the process with SIGALRM.

    ``MPI_Finalize`` waits for the launcher; one behind a dead link never answers (seen with UCX:
    the ranks finished training, then waited for ever). Python's own watchdogs are shut down by
    then, so this uses ``alarm(2)``, whose default action needs no thread at all. Left alone when
    the program handles SIGALRM itself or has an alarm pending.
    """
    if seconds is None:
        return
    try:
        if signal.getsignal(signal.SIGALRM) != signal.SIG_DFL:
            return
        pending = signal.alarm(max(1, math.ceil(seconds)))
        if pending:
            signal.alarm(pending)  # the program's own alarm stands
    except (AttributeError, ValueError, OSError):  # no SIGALRM on this platform
        pass


def install_excepthook() -> None:
    """An uncaught exception on one rank ends the job (as ``python -m mpi4py`` does), with the
    traceback in the error file too, instead of leaving this rank in ``MPI_Finalize`` and the
    others in their next collective. Installed once per process."""
    with _lock:
        if _state.hook_installed:
            return
        _state.hook_installed = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        MPI = _state.MPI
        if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or _state.size < 2:
            previous(kind, exc, tb)
            return
        own = previous is not sys.__excepthook__
        if own:  # an IDE's or a logger's hook: let it report, then keep the traceback in the file
            previous(kind, exc, tb)
        text = "".join(traceback.format_exception(kind, exc, tb))
        note = (f"cgdp: rank {_state.rank}: uncaught {kind.__name__}; aborting the MPI job so that "
                f"the other ranks do not wait for this one forever")
        if own:
            record(text, stderr=False)
            end(note)
        end(text + note)

    sys.excepthook = hook
