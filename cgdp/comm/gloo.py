"""The gloo tier: one process per machine launched the PyTorch way (torchrun, SLURM, ``env://``).

The same contract as the MPI tier (:mod:`cgdp.comm`), over ``torch.distributed``'s gloo backend,
which every PyTorch build carries (PyPI's have no MPI backend). Each rank drives its own devices;
when a chunk's local weighted sum is ready in the pinned host accumulator, the comm thread
(:class:`~cgdp.comm.ordered.OrderedComm`) starts ``all_reduce(SUM, async_op=True)`` on a tensor
sharing the accumulator's memory (``torch.from_numpy``: no copy; gloo reduces it in place on a
thread of its own), chunks in plan order on every rank, completed in that order.

Process groups: the default group is the user's, or is initialised here from the environment
(:func:`init_from_env`: torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, or
SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_JOB_NODELIST``) when none exists. cgdp then
makes two gloo groups of its own over the same ranks (the user's group's, with ``comm=group``),
as the MPI comm duplicates its communicator: ``_grad`` for the chunk allreduces (comm thread
only) and ``_ctl`` for the engine's blocking calls (step thread only). gloo matches collectives by
the order they are issued on a group, and two threads issuing on one group would not issue in
the same order on every rank.

Waiting: gloo progresses on its own threads, so the comm thread blocks in ``Work.wait`` (GIL
released); a watchdog enforces ``timeout_s``. gloo's own timeout is set ``GLOO_MARGIN_S`` longer,
so cgdp's error (naming the rank, the chunk and the step) comes first. A killed peer closes its
sockets: gloo fails at once ("Connection closed by peer"), reported with the rank and chunk. A
stalled peer or a cut link gives the ``TimeoutError`` after ``timeout_s``. After a failure the
process ends at exit (or ``abort_grace_s`` later) with ``os._exit`` (:mod:`cgdp.comm.ending`): a
gloo work thread stuck in a collective never blocks the interpreter's exit.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import pickle
import re
import threading
import warnings
from typing import Any

import numpy as np

from cgdp.comm.ending import EndingComm, versions
from cgdp.comm.ordered import _InFlight

GLOO_MARGIN_S = 10.0
"""gloo's own timeout is cgdp's ``timeout_s`` plus this: cgdp's clearer error comes first."""

ENV_HINT = ("start every rank with torchrun (torchrun --nnodes N --nproc-per-node 1 --node-rank I "
            "--master-addr HOST --master-port PORT script.py), under SLURM with srun (one task per "
            "node), or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE; or call "
            "torch.distributed.init_process_group('gloo') yourself before building the trainer")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"node[07-09,12],gpu1"`` → ``"node07"``."""
    m = re.match(r"([^,\[]*)(\[([^\]]*)\])?", nodelist.strip())
    if not m or not (m.group(1) or m.group(3)):
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(3)
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


def env_world(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Where the rendezvous is, from the environment: ``{"rank", "size", "addr", "port", "source"}``.

    torchrun (and any ``env://`` launch) sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT``; under SLURM (``srun``, one task per node) the rank and size come from
    ``SLURM_PROCID`` and ``SLURM_NTASKS``, the address from ``MASTER_ADDR`` or else the job's first
    node, the port from ``MASTER_PORT`` or else 29500.
    """
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        source = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "RANK/WORLD_SIZE"
        rank, size = _env_int(env, "RANK", source), _env_int(env, "WORLD_SIZE", source)
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ValueError(f"comm='gloo': RANK and WORLD_SIZE are set but {' and '.join(missing)} "
                             f"not; {ENV_HINT}")
        addr, port = env["MASTER_ADDR"], _env_int(env, "MASTER_PORT", source)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        source = "SLURM"
        rank, size = _env_int(env, "SLURM_PROCID", source), _env_int(env, "SLURM_NTASKS", source)
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        addr = env.get("MASTER_ADDR") or (first_slurm_host(nodes) if nodes else "")
        if not addr:
            raise ValueError("comm='gloo' under SLURM: neither MASTER_ADDR nor SLURM_JOB_NODELIST "
                             "is set; set MASTER_ADDR to the first node's address")
        port = _env_int(env, "MASTER_PORT", source) if env.get("MASTER_PORT") else 29500
    else:
        raise ValueError(f"comm='gloo' but no process group exists and the environment does not say "
                         f"where the other ranks are (no RANK/WORLD_SIZE, no SLURM_PROCID); {ENV_HINT}")
    if not 0 <= rank < size:
        raise ValueError(f"comm='gloo': rank {rank} is not in 0..{size - 1} ({source})")
    if not 1 <= port <= 65535:
        raise ValueError(f"comm='gloo': MASTER_PORT={port} ({source}) is not a TCP port, which must be in "
                         f"1..65535; set MASTER_PORT to a free port on the first node, the same on every "
                         f"rank (e.g. 29500)")
    _check_addr(addr, source)
    return {"rank": rank, "size": size, "addr": addr, "port": port, "source": source}


def _env_int(env: dict[str, str], key: str, source: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"comm='gloo': {key}={env[key]!r} ({source}) is not a whole number; "
                         f"{ENV_HINT}") from None


def _check_addr(addr: str, source: str) -> None:
    """Refuse the MASTER_ADDR mistakes that can be seen without the network (a name that does not
    resolve is left to the rendezvous)."""
    why = None
    if "://" in addr:
        why = "is a URL; give the host name or IP address alone"
    elif any(c.isspace() for c in addr):
        why = "holds a space; give the host name or IP address alone"
    elif ":" in addr:
        try:
            ipaddress.IPv6Address(addr.strip("[]"))
        except ValueError:
            why = "looks like HOST:PORT; put the host in MASTER_ADDR and the port in MASTER_PORT"
    if why:
        raise ValueError(f"comm='gloo': MASTER_ADDR={addr!r} ({source}) {why}")


def _timedelta(seconds: float | None) -> datetime.timedelta:
    return datetime.timedelta(seconds=7 * 86400 if seconds is None else seconds)


def init_from_env(timeout_s: float | None) -> dict[str, Any]:
    """Initialise the default process group over gloo from the environment (:func:`env_world`).

    The rendezvous waits ``timeout_s`` at most for the other ranks; the error names this rank,
    the address it waited on and where that came from.
    """
    import torch.distributed as dist
    w = env_world()
    if "TORCHELASTIC_RUN_ID" in os.environ or w["source"] == "RANK/WORLD_SIZE":
        how = dict(init_method="env://")  # torchrun's agent store, when there is one
    else:
        how = dict(init_method=f"tcp://{w['addr']}:{w['port']}", rank=w["rank"], world_size=w["size"])
    try:
        dist.init_process_group("gloo", timeout=_timedelta(timeout_s), **how)
    except Exception as exc:  # DistStoreError, RuntimeError, TimeoutError: one clear sentence
        raise TimeoutError(
            f"rank {w['rank']} of {w['size']}: the gloo rendezvous at {w['addr']}:{w['port']} (from "
            f"{w['source']}) did not complete within {timeout_s} s: a rank was not started, "
            f"died, or cannot reach that address (GLOO_SOCKET_IFNAME chooses this machine's "
            f"interface). Check the other ranks' output. ({type(exc).__name__}: {exc})") from exc
    return w


class GlooComm(EndingComm):
    """A :class:`~cgdp.comm.Comm` over ``torch.distributed``'s gloo backend (see the module docstring).

    Args:
        group: the ranks that train together: ``None`` for the default group (initialised from
            the environment if need be: :func:`init_from_env`), or a ``ProcessGroup`` of yours.
            Every rank of it must build its trainer at the same point.
        timeout_s: longest a collective may make no progress before this rank fails with
            ``TimeoutError`` (also bounds the rendezvous and the set-up); ``None``: a week.
        abort_on_failure: after a failure, end this process at exit (or ``abort_grace_s`` later
            at most) with ``os._exit``, so that no gloo thread stuck in a collective keeps it
            alive; the error is written first (stderr and ``error_file``).
        abort_grace_s: see ``abort_on_failure``.
        error_file: where this rank also writes its error (``{rank}`` becomes the rank).
    """

    job = "gloo job"

    def __init__(self, group: Any = None, timeout_s: float | None = 300.0, *,
                 abort_on_failure: bool = True, abort_grace_s: float = 30.0,
                 error_file: str | os.PathLike | None = None):
        import torch
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_gloo_available():
            raise ImportError("comm='gloo' needs torch.distributed with gloo, which this torch build "
                              "lacks; install a PyPI torch build, or use comm='mpi'")
        self._torch, self._dist = torch, dist
        if group is None and not dist.is_initialized():
            init_from_env(timeout_s)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"comm must be 'gloo' or a torch.distributed ProcessGroup, got {type(group).__name__}")
        if dist.get_rank(group) < 0:
            raise ValueError(f"comm=group: this process (global rank {dist.get_rank()}) is not in the "
                             f"group; build the trainer only on the group's ranks")
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout_s)
        self.blocking = True
        self._freed = False
        self._setup_ending(None, abort_on_failure, abort_grace_s, error_file)
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self._grad = self._new_group(ranks)
        self._ctl = self._new_group(ranks)
        if self.size == 1:
            warnings.warn("comm='gloo' but this process is alone in its process group (world size "
                          f"1): {ENV_HINT}; training goes on as one machine", RuntimeWarning, stacklevel=3)
        self._start_thread()

    def _new_group(self, ranks: list[int] | None) -> Any:
        pg_timeout = _timedelta(None if self.timeout_s is None else self.timeout_s + GLOO_MARGIN_S)
        try:
            return self._dist.new_group(ranks, timeout=pg_timeout, backend="gloo",
                                        use_local_synchronization=ranks is not None)
        except Exception as exc:
            err = TimeoutError(f"rank {self.rank} of {self.size}: making cgdp's gloo process groups "
                               f"(every rank builds a Trainer at the same point) failed: another "
                               f"rank died, stalls, or never reached this point "
                               f"({type(exc).__name__}: {exc})")
            self._fail_now(err)
            raise err from exc

    def _fail_now(self, exc: BaseException) -> None:
        with self._cond:
            self._set_error(exc)
        self._after_failure(exc)

    # ------------------------------------------------------------------ chunk allreduces (comm thread)
    def _start(self, item: _InFlight) -> Any:
        work = self._dist.all_reduce(self._torch.from_numpy(item.buf), op=self._dist.ReduceOp.SUM,
                                     group=self._grad, async_op=True)
        return work, item

    def _test(self, handle: Any) -> bool:
        return handle[0].is_completed()

    def _block(self, handle: Any) -> None:
        work, item = handle
        try:
            # note: the comm thread waits inside gloo (GIL released) for the oldest chunk; the
            # watchdog thread enforces timeout_s meanwhile
            work.wait()
        except Exception as exc:
            raise RuntimeError(f"rank {self.rank} of {self.size}: the allreduce of chunk {item.key} "
                               f"({item.buf.size} values) in step {self.step} failed: {_why(exc)}") from exc

    # ------------------------------------------------------------------ blocking calls (step thread)
    def _wait(self, work: Any, what: str) -> None:
        """Wait for ``work``; ``TimeoutError`` after ``timeout_s``, the error named otherwise."""
        done = threading.Event()
        try:
            work.get_future().add_done_callback(lambda _: done.set())
            # note: the step thread waits here for the other ranks to join this collective
            if not done.wait(self.timeout_s):
                raise TimeoutError(
                    f"rank {self.rank} of {self.size}: {what} did not complete within "
                    f"{self.timeout_s:g} s: another rank died, stalls, or never reached this "
                    f"point. Check the other ranks' output; raise timeout_s if a step can "
                    f"really take that long")
            try:
                work.wait()
            except Exception as exc:
                raise RuntimeError(f"rank {self.rank} of {self.size}: {what} failed: {_why(exc)}") from exc
        except BaseException as exc:
            self._fail_now(exc)
            raise

    def _tensor(self, arr: np.ndarray) -> Any:
        return self._torch.from_numpy(arr)

    def allreduce_small(self, arr: np.ndarray) -> np.ndarray:
        self._check_ok()
        out = np.array(arr, copy=True, order="C")
        work = self._dist.all_reduce(self._tensor(out), group=self._ctl, async_op=True)
        self._wait(work, f"allreduce_small of {out.size} values in step {self.step}")
        return out

    def broadcast_object(self, obj: Any) -> Any:
        self._check_ok()
        data = pickle.dumps(obj) if self.rank == 0 else b""
        n = np.array([len(data)], np.int64)
        root = self._dist.get_global_rank(self._ctl, 0)
        self._wait(self._dist.broadcast(self._tensor(n), root, group=self._ctl, async_op=True),
                   "broadcast_object (size) from rank 0")
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == 0 else np.empty(int(n[0]), np.uint8)
        self._wait(self._dist.broadcast(self._tensor(buf), root, group=self._ctl, async_op=True),
                   "broadcast_object from rank 0")
        return obj if self.rank == 0 else pickle.loads(buf.tobytes())

    def allgather_bytes(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank."""
        self._check_ok()
        counts = [np.zeros(1, np.int64) for _ in range(self.size)]
        mine = np.array([len(data)], np.int64)
        self._wait(self._dist.all_gather([self._tensor(c) for c in counts], self._tensor(mine),
                                         group=self._ctl, async_op=True), f"{what} (sizes)")
        longest = max(int(c[0]) for c in counts)
        parts = [np.zeros(longest, np.uint8) for _ in range(self.size)]
        send = np.zeros(longest, np.uint8)
        send[:len(data)] = np.frombuffer(data, np.uint8)
        self._wait(self._dist.all_gather([self._tensor(p) for p in parts], self._tensor(send),
                                         group=self._ctl, async_op=True), what)
        return [p[:int(c[0])].tobytes() for p, c in zip(parts, counts)]

    def _versions(self) -> str:
        return versions("gloo")

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        super().close()
        idle = self._error is None and self._completed == self._posted
        if not self._freed and idle and hasattr(self, "_ctl") and self._dist.is_initialized():
            self._freed = True
            for g in (self._grad, self._ctl):
                self._dist.destroy_process_group(g)


class ObjectWorld:
    """The default process group for ``python -m cgdp.train``'s start-up agreement (the part of
    ``MPI.COMM_WORLD`` it uses), initialised from the environment if need be."""

    def __init__(self, timeout_s: float | None = 300.0):
        import torch.distributed as dist
        if not dist.is_initialized():
            init_from_env(timeout_s)
        self._dist = dist

    def Get_rank(self) -> int:
        return self._dist.get_rank()

    def Get_size(self) -> int:
        return self._dist.get_world_size()

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.Get_size()
        self._dist.all_gather_object(out, obj)
        return out


def _why(exc: BaseException) -> str:
    """gloo's error in a sentence that says what it means for the job."""
    text = str(exc).strip()
    if "closed by peer" in text or "Connection reset" in text:
        return (f"a peer closed its connection: another rank died (killed, crashed, out of memory) "
                f"or ended early. Check the other ranks' output. (gloo: {text})")
    if "Timed out" in text or "timed out" in text:
        return (f"gloo timed out: another rank stalls or its link is down. (gloo: {text})")
    return f"{type(exc).__name__}: {text}"
