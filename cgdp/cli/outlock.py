"""One run at a time in an ``--out`` directory: ``OUT/.lock``, held with ``flock`` for the whole run.

Two runs started on the same ``--out`` at once would both find it empty, both start, and write
over each other's checkpoint and metrics. The first to start takes an exclusive, non-blocking
``flock`` on ``OUT/.lock`` before anything in ``OUT`` is checked or written, and holds it until it
ends; the second is refused with the first one's process id. The kernel gives the lock back when
the process ends in any way (a crash or ``kill -9`` included), so a lock is never stale and never
needs removing; the file stays, holding the id of the last run. It is never deleted, since a
process could still hold it open: deleting it would let a third run lock a new file while the
second holds the old one.

``OUT/.lock`` is opened without following a symbolic link and must be a plain file with one name:
a ``.lock`` planted as a link (symbolic or hard) to a file elsewhere is refused, never written
through. A disk that cannot take the process id (full, or over quota) is refused with what to do,
and nothing else in ``OUT`` is touched.

Where ``fcntl`` does not exist (Windows) there is no lock; with MPI only rank 0 takes it (the ranks
of one run share ``OUT``).
"""
from __future__ import annotations

import errno
import os
import pathlib
import stat

from cgdp.cli.output import disk_error

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

LOCK_FILE = ".lock"


class OutLock:
    """The lock of one ``--out``; :meth:`take` it before anything there is read or written."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def take(self, out: str | os.PathLike) -> None:
        """Hold ``OUT/.lock``; ``RuntimeError`` (what to do) if another run holds it."""
        if fcntl is None or self._fd is not None:
            return
        out = pathlib.Path(out)
        path = out / LOCK_FILE
        try:
            out.mkdir(parents=True, exist_ok=True)
            # NOFOLLOW: never through a planted link; NONBLOCK: a FIFO planted there does not hang the open
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
                raise RuntimeError(_link_error(path, "a symbolic link")) from None
            raise RuntimeError(f"cannot create results directory {out}: {e.strerror}; choose another --out") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            what = "not a plain file" if not stat.S_ISREG(st.st_mode) else f"a hard link ({st.st_nlink} names)"
            raise RuntimeError(_link_error(path, what))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(f"--out {out} is in use by another cgdp.train run (process {holder}), which "
                               f"writes its checkpoint and metrics there; wait for it to end, or choose "
                               f"another --out") from None
        pid = f"{os.getpid()}\n".encode()
        try:  # written before the old id is cut off: a full disk leaves the file as it was
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
        except OSError as e:
            os.close(fd)
            raise disk_error(e, path, f"nothing was changed in {out}") from None
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor gives the flock back


def _link_error(path: pathlib.Path, what: str) -> str:
    return (f"{path} is {what}; cgdp.train writes its process id there and does not write through links. "
            f"Remove {path} (a run creates it as a plain file), or choose another --out")
