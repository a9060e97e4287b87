"""The chunk plan in use: the first one, and the tuner's next ones. Every rank takes rank 0's (the MPI tier allreduces
chunk by chunk); a plan changes only between iterations, with nothing in flight, and never changes results."""
from __future__ import annotations

from typing import Any, Sequence

from cgdp.comm import Comm
from cgdp.planning.chunks import Plan, resolve_plan, validate_plan


def first_plan(chunks: int | Plan | str, layer_bytes: Sequence[int], devices: int, comm: Comm | None, *,
               tuned: bool = True, paper: bool = False) -> tuple[Plan, Any]:
    """The first plan and the tuner (None if the plan is given or ``tuned`` is False: nothing streams, ``"auto"`` is one
    layer per chunk). ``paper``: allows ``"paper"``; ``"auto"`` with a comm probes the MPI tier (~0.1 s, collective)."""
    n = len(layer_bytes)
    tuner = None
    if not isinstance(chunks, str):
        plan = resolve_plan(chunks, n)
    elif chunks not in (("auto", "paper") if paper else ("auto",)):
        raise ValueError(f"chunks must be an int, an explicit plan or 'auto'; got {chunks!r}")
    elif not tuned:
        plan = resolve_plan(1, n)
    else:
        from cgdp.planning.tuner import make_tuner
        cost, ranks = None, 1
        if comm is not None and chunks == "auto" and paper:
            from cgdp.comm.mpi import probe_alpha_beta
            from cgdp.planning.costs import Linear
            alpha, beta = probe_alpha_beta(comm)
            cost, ranks = Linear(alpha, beta), comm.size
        tuner = make_tuner(chunks, list(layer_bytes), devices, comm=cost, ranks=ranks)
        plan = validate_plan(tuner.plan(), n)
    if comm is not None:
        plan = comm.broadcast_object(plan)  # rank 0's plan: the same chunks everywhere
    return plan, tuner


def tuned_plan(tuner: Any, comm: Comm | None, layers: int) -> tuple[Plan, bool]:
    """The tuner's plan for the next iteration, and whether it is its final one: rank 0's on every rank."""
    plan, done = tuner.plan(), tuner.done
    if comm is not None:  # rank 0 decides, every rank follows
        plan, done = comm.broadcast_object((plan, done))
    return validate_plan(plan, layers), done
