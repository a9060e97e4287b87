"""Communication between machines: one interface, implementations imported only when used.

The engine's host accumulator produces, per chunk, the local weighted sum of the gradients of this
machine's devices. With a ``Comm`` attached, each chunk is then summed across all ranks in place
(the gradient weights already divide by the *global* batch, so a SUM is the mean) before it goes
back to the devices.

Contract (what the engine relies on):

* ``post(key, buf, on_done)`` starts a non-blocking in-place SUM allreduce of the 1-D NumPy array
  ``buf`` (a slice of the pinned host accumulator; no extra copy). The engine calls ``post`` from one
  thread, chunks in plan order, the same order on every rank. ``on_done()`` runs on the comm's own
  thread when that allreduce has completed, in post order.
* ``fence(timeout)`` blocks until every posted allreduce has completed; raises the comm error if one
  failed, ``TimeoutError`` if ``timeout`` seconds pass (a dead or stalled peer).
* ``allreduce_small(arr)`` is a blocking SUM allreduce of a small array (batch sizes, flags, loss).
* ``broadcast_object(obj)`` returns rank 0's ``obj`` on every rank (chunk plans, tuner decisions).
* ``check_same(signature)`` raises ``RuntimeError`` naming the ranks and fields that differ, when the
  ``dict`` of strings ``signature`` (config, model shape, devices) is not the same on every rank.
* ``attach(fail)``: the engine hands its failure callback; errors on the comm thread are reported
  through ``fail(exc)`` so that a step never hangs.

Implementations: :mod:`cgdp.comm.mpi` (mpi4py), :mod:`cgdp.comm.gloo` (``torch.distributed``'s
gloo, as launched by torchrun or SLURM), :mod:`cgdp.comm.inproc` (threads of one process, tests).

May import: nothing of cgdp outside this package (the engine imports it).
"""
from __future__ import annotations

from typing import Any

from cgdp.comm.base import Comm

__all__ = ["Comm", "make_comm"]


def make_comm(spec: object, **options: Any) -> Comm | None:
    """``None`` → one machine; ``"mpi"`` → :class:`cgdp.comm.mpi.MPIComm`; ``"gloo"`` or a
    ``torch.distributed`` process group → :class:`cgdp.comm.gloo.GlooComm`; a ``Comm`` → itself."""
    if spec is None:
        return None
    if isinstance(spec, Comm):
        return spec
    if spec == "mpi":
        from cgdp.comm.mpi import MPIComm  # MPI is imported only when asked for
        return MPIComm(**options)
    if isinstance(spec, str) and spec == "gloo" or _is_process_group(spec):
        from cgdp.comm.gloo import GlooComm
        return GlooComm(None if isinstance(spec, str) else spec, **options)
    raise ValueError(f"comm must be None (one machine), 'mpi' or 'gloo' (several machines), a "
                     f"torch.distributed ProcessGroup, or a cgdp.comm.Comm; got {spec!r}")


def _is_process_group(obj: object) -> bool:
    import torch.distributed as dist
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)
