"""The MPI tier: one rank per machine, chunk allreduces between the host accumulators.

Each rank drives its own devices through the single-machine data path. When a chunk's local
weighted sum is ready in the host accumulator, the engine posts it here; the comm thread
(:class:`~cgdp.comm.ordered.OrderedComm`) starts a non-blocking in-place SUM allreduce on the
accumulator's own memory (``Iallreduce(MPI.IN_PLACE, buf)``: no extra copy), chunks in plan order
on every rank, and completes them in that order, so completed chunks go back to the devices while
backward goes on (Lee et al.: output side first, the last message small).

Communicators (all duplicates of the one given, so they never match a user's own collectives):

* ``_grad``: chunk allreduces, used only by the comm thread;
* ``_ctl``: the engine's blocking calls (``allreduce_small``, ``broadcast_object``,
  ``check_same``), used only by the step thread, in program order, the same on every rank.

Two threads call MPI at once, so MPI must provide ``MPI_THREAD_MULTIPLE`` (checked at start).

Waiting: MPI progresses a non-blocking collective only inside MPI calls, so the comm thread
tests the oldest chunk with ``MPI_Test``: back to back (with ``sched_yield``) for ``spin_s`` after
each start or completion, then every ``poll_s``. ``progress="wait"`` blocks in ``MPI_Wait``
instead (GIL released, MPICH spins inside); on this project's CPU-bound test machine that left
more communication exposed for the same step time (bench/results/mpi_overlap.md), so polling is
the default. A watchdog thread enforces ``timeout_s`` either way, and the step thread's own
calls poll ``Test`` with the same timeout. A dead or stalled peer gives a ``TimeoutError``
naming this rank, the chunk and the step.

After a failure the job cannot continue (the other ranks are inside collectives this rank will
never join), and MPI cannot cancel a collective. So with ``abort_on_failure`` (the default) the
error is written (stderr, and ``error_file`` when given), raised in ``Trainer.step()``, and this
process ends the job when it exits, or ``abort_grace_s`` later at most, through
:func:`cgdp.comm.abort.end`: ``MPI_Abort``, then ``os._exit`` without ``MPI_Finalize``, since a
launcher behind a dead link makes ``MPI_Abort`` return and ``MPI_Finalize`` wait forever. Every
process of the job thus ends by itself, whether or not the launcher can be reached. Likewise an
uncaught exception on any rank ends the job (as ``python -m mpi4py`` does), instead of leaving the
failed rank in ``MPI_Finalize`` and the others in a collective. (With mpiexec's default cleanup, a
rank killed outright ends the job within a second anyway; the timeout covers stalled ranks, frozen
machines, cut links, and launchers that do not clean up.)

mpi4py is imported only when an ``MPIComm`` is built; the rest of this module (the mismatch
report, the α/β probe) works on any :class:`~cgdp.comm.Comm`.
"""
from __future__ import annotations

import os
import pickle
import statistics
import time
import warnings
from typing import Any

import numpy as np

from cgdp.comm import abort
from cgdp.comm.base import Comm
from cgdp.comm.ending import EndingComm, describe_mismatch, versions
from cgdp.comm.ordered import _InFlight

__all__ = ["MPIComm", "describe_mismatch", "load_mpi", "probe_alpha_beta"]

INSTALL_HINT = ('install the MPI extra from a clone of cgdp: pip install -e ".[mpi]" (mpi4py and the mpich wheel; no '
                'compiler needed), then start every rank with: mpiexec -n R python -m cgdp.train ...')


def load_mpi() -> Any:
    """``mpi4py.MPI``, initialised with thread level MULTIPLE, or a clear error on how to get it."""
    try:
        import mpi4py
    except ImportError as exc:
        raise ImportError(f"comm='mpi' needs mpi4py, which is not installed: {INSTALL_HINT}") from exc
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:  # mpi4py present, no MPI library found
        raise ImportError(f"mpi4py {mpi4py.__version__} is installed but cannot load an MPI library "
                          f"({exc}); {INSTALL_HINT}") from exc
    return MPI


def check_thread_level(MPI: Any) -> None:
    """Two threads of a rank call MPI at once (comm thread, step thread): need THREAD_MULTIPLE."""
    if MPI.Is_finalized():
        raise RuntimeError("MPI was already finalized in this process; build the Trainer before "
                           "MPI_Finalize (or before mpi4py finalizes at exit)")
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
        raise RuntimeError(
            f"MPI provides thread level {names.get(provided, provided)}, but cgdp's comm thread calls "
            f"MPI while the training thread does too, which needs MPI_THREAD_MULTIPLE. If you set "
            f"mpi4py.rc.thread_level or called MPI_Init yourself, ask for 'multiple'; otherwise use "
            f"an MPI built with thread support, e.g. the mpich wheel: pip install -e \".[mpi]\" in a clone of cgdp")


class MPIComm(EndingComm):
    """A :class:`~cgdp.comm.Comm` over MPI (see the module docstring).

    Args:
        comm: the mpi4py communicator whose ranks train together (default ``MPI.COMM_WORLD``).
        timeout_s: longest a collective may make no progress before this rank fails with
            ``TimeoutError``; ``None`` waits forever (not advised: a stalled peer hangs the job).
        progress: how the comm thread drives the oldest chunk's allreduce. ``"poll"`` (default):
            ``MPI_Test`` from Python, ``spin_s`` seconds back to back, then every ``poll_s``.
            ``"wait"``: ``MPI_Wait`` with the GIL released (lowest latency when the host has
            idle cores; MPICH spins inside it). Both measured in bench/results/mpi_overlap.md.
        poll_s: sleep between two tests after the first ``spin_s`` seconds (also in the
            blocking calls of the step thread). Bounds the latency polling adds per MPI round.
        spin_s: how long to test back to back (with ``sched_yield``) before sleeping.
        abort_on_failure: after a failure, end the whole MPI job at process exit (or
            ``abort_grace_s`` later at most) so that no rank waits forever; this process ends
            even where ``MPI_Abort`` cannot reach the launcher (:mod:`cgdp.comm.abort`).
        abort_grace_s: see ``abort_on_failure``.
        error_file: where this rank also writes its error (appended, synced to disk), since the
            launcher forwards stderr over the network and a dead link loses it; ``{rank}`` in it
            becomes the rank. ``python -m cgdp.train`` passes ``OUT/rank<r>.error``.
        finalize_timeout_s: after a run without failure, a process whose ``MPI_Finalize`` (at
            interpreter exit) waits longer than this for an unreachable launcher is ended by
            SIGALRM (:func:`cgdp.comm.abort.bound_finalize`). Counted from when this comm's exit
            handler runs, so atexit handlers registered before it (an experiment tracker's upload)
            run inside that time too: ``None`` (the default) waits as long as MPI does.
            ``python -m cgdp.train`` passes 60.
    """

    def __init__(self, comm: Any = None, timeout_s: float | None = 300.0, *, progress: str = "poll",
                 poll_s: float = 2e-4, spin_s: float = 2e-4, abort_on_failure: bool = True,
                 abort_grace_s: float = 30.0, error_file: str | os.PathLike | None = None,
                 finalize_timeout_s: float | None = None):
        MPI = load_mpi()
        check_thread_level(MPI)
        self._MPI = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        super().__init__(base.Get_rank(), base.Get_size(), timeout_s)
        if progress not in ("wait", "poll"):
            raise ValueError(f"progress must be 'wait' or 'poll', got {progress!r}")
        self.blocking = progress == "wait"
        if poll_s < 0 or spin_s < 0:
            raise ValueError(f"poll_s and spin_s must be >= 0, got {poll_s!r}, {spin_s!r}")
        self.poll_s = poll_s
        self.spin_s = spin_s
        self.finalize_timeout_s = finalize_timeout_s
        self._freed = False
        self._base = base
        # the exit handler first: a rank whose set-up below fails (a peer that never comes, a link
        # cut during start-up) must end too, not raise and then wait for ever in MPI_Finalize
        self._setup_ending(MPI, abort_on_failure, abort_grace_s, error_file)
        # Idup, polled: a rank that never builds its Trainer gives a timeout here, not a hang
        self._grad = self._dup(base, "duplicating the communicator (all ranks build a Trainer)")
        self._ctl = self._dup(base, "duplicating the communicator (all ranks build a Trainer)")
        if self.size == 1:
            warnings.warn("comm='mpi' but this process is alone in its MPI world (size 1): start "
                          "every rank with mpiexec -n R; training goes on as one machine",
                          RuntimeWarning, stacklevel=3)
        self._start_thread()

    # ------------------------------------------------------------------ chunk allreduces (comm thread)

    def _start(self, item: _InFlight) -> Any:
        return self._grad.Iallreduce(self._MPI.IN_PLACE, item.buf, op=self._MPI.SUM)

    def _test(self, handle: Any) -> bool:
        return handle.Test()

    def _block(self, handle: Any) -> None:
        handle.Wait()  # GIL released inside; MPICH spins, then yields the core, until complete

    def _idle(self, since_progress_s: float) -> None:
        # MPI advances a non-blocking collective only inside MPI calls: test often at first.
        # sched_yield costs < 1 µs and lets the compute threads run; time.sleep(0) costs ~70 µs.
        if since_progress_s < self.spin_s:
            os.sched_yield()
        else:
            time.sleep(self.poll_s)

    # ------------------------------------------------------------------ blocking calls (step thread)
    def _wait(self, req: Any, what: str) -> None:
        """Poll ``req`` until complete; ``TimeoutError`` after ``timeout_s`` without completion."""
        start = time.monotonic()
        try:
            while not req.Test():
                waited = time.monotonic() - start
                if self.timeout_s is not None and waited > self.timeout_s:
                    raise TimeoutError(
                        f"rank {self.rank} of {self.size}: {what} did not complete within "
                        f"{self.timeout_s:g} s: another rank died, stalls, or never reached this "
                        f"point. Check the other ranks' output; raise timeout_s if a step can "
                        f"really take that long")
                # note: the step thread waits here for the other ranks to join this collective
                if waited < self.spin_s:
                    os.sched_yield()
                else:
                    time.sleep(self.poll_s)
        except BaseException as exc:
            with self._cond:
                self._set_error(exc)
            self._after_failure(exc)
            raise

    def _dup(self, base: Any, what: str) -> Any:
        new, req = base.Idup()
        self._wait(req, what)
        return new

    def allreduce_small(self, arr: np.ndarray) -> np.ndarray:
        self._check_ok()
        out = np.array(arr, copy=True, order="C")
        req = self._ctl.Iallreduce(self._MPI.IN_PLACE, out, op=self._MPI.SUM)
        self._wait(req, f"allreduce_small of {out.size} values in step {self.step}")
        return out

    def broadcast_object(self, obj: Any) -> Any:
        self._check_ok()
        data = pickle.dumps(obj) if self.rank == 0 else b""
        n = np.array([len(data)], np.int64)
        self._wait(self._ctl.Ibcast(n, root=0), "broadcast_object (size) from rank 0")
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == 0 else np.empty(int(n[0]), np.uint8)
        self._wait(self._ctl.Ibcast(buf, root=0), "broadcast_object from rank 0")
        return obj if self.rank == 0 else pickle.loads(buf.tobytes())

    def allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        self._check_ok()
        n = np.array([len(data)], np.int64)
        counts = np.empty(self.size, np.int64)
        self._wait(self._ctl.Iallgather(n, counts), f"{what} (sizes)")
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        out = np.empty(int(counts.sum()), np.uint8)
        send = np.frombuffer(data, np.uint8).copy()
        req = self._ctl.Iallgatherv(send, [out, counts.tolist(), displs.tolist(), self._MPI.BYTE])
        self._wait(req, what)
        return [out[d:d + c].tobytes() for d, c in zip(displs.tolist(), counts.tolist())]

    # ------------------------------------------------------------------ failures and shutdown
    job = "MPI job"

    def _versions(self) -> str:
        return _versions(self._MPI)

    def _finished(self) -> bool:
        return self._MPI.Is_finalized()

    def _at_exit(self) -> None:
        super()._at_exit()
        if self.size > 1:
            abort.bound_finalize(self.finalize_timeout_s)

    def close(self) -> None:
        super().close()
        # free our communicators unless a collective may still be in flight on them
        idle = self._error is None and self._completed == self._posted
        if not self._freed and idle and not self._MPI.Is_finalized():
            self._freed = True
            for c in (self._grad, self._ctl):
                c.Free()


def _versions(MPI: Any) -> str:
    return versions(MPI.Get_library_version().strip().splitlines()[0])


# ---------------------------------------------------------------------- α/β probe for the simulator
def probe_alpha_beta(comm: Any, sizes_bytes: tuple[int, ...] = (4, 1 << 12, 1 << 16, 1 << 20, 1 << 22),
                     reps: int = 5) -> tuple[float, float]:
    """Measure the chunk allreduce as ``t(n) = alpha_s + beta_s_per_byte * n`` bytes.

    Runs the path the engine uses (``post`` + ``fence`` on float32 buffers, comm thread included),
    ``reps`` times per size after one warm-up, each time after lining the ranks up; fits the
    ranks' mean of the median times by least squares relative to each time. Collective: every
    rank must call it at the same point; every rank returns rank 0's fit. ``comm`` is a
    :class:`~cgdp.comm.Comm` or an mpi4py communicator. Takes about 0.1 s on one machine.
    """
    own = not isinstance(comm, Comm)
    if own:
        comm = MPIComm(comm)
    step = getattr(comm, "step", None)
    try:
        sizes, times = [], []
        for nbytes in sizes_bytes:
            buf = np.zeros(max(nbytes // 4, 1), np.float32)
            ts = []
            for _ in range(reps + 1):
                comm.allreduce_small(np.zeros(1))  # line the ranks up
                t0 = time.perf_counter()
                comm.post(-1, buf, lambda: None)
                comm.fence()
                ts.append(time.perf_counter() - t0)
            med = statistics.median(ts[1:])
            mean = float(comm.allreduce_small(np.array([med]))[0]) / comm.size
            sizes.append(buf.nbytes)
            times.append(mean)
        n = np.array(sizes, np.float64)
        t = np.array(times, np.float64)
        # least squares on relative error: small and large messages count alike
        a = np.stack([1.0 / t, n / t], axis=1)
        (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
        alpha = max(float(alpha), 0.0)
        beta = max(float(beta), 1e-15)
        return comm.broadcast_object((alpha, beta))
    finally:
        if step is not None:
            comm.step = step  # the probe is not a training step
        if own:
            comm.close()
