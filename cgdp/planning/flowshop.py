"""The simulator's backward phase in closed form for identical devices: a permutation flow shop.

A chunk holds the stages :data:`STAGES` in turn, every stage serving chunks in plan order, so the
finish times of chunk c are C[c][s] = max(C[c-1][s], C[c][s-1]) + p[c][s] (:func:`advance`), except
that ``dram`` starts with the chunk's ready time (after compute) and the copy back waits for both
``comm`` and ``dram``. :func:`chain_makespan` is the end of the backward phase. With stages that never
queue it reduces to the paper's Definition 3.3 (:mod:`cgdp.planning.costmodel`).

It agrees with the event simulation (:func:`cgdp.planning.simulator.simulate`; the tests check
it) only where that model has no more freedom than a flow shop: identical devices (no
``device_speed`` spread), no cores shared with emulated devices, and a plan that is contiguous runs
of ``ModelCosts.order`` (:func:`sizes_of`). :func:`cgdp.planning.simulator.predict_step` uses it
there (floored by all backward compute, syncs and ``tail_s``) and the event simulation elsewhere;
:mod:`cgdp.planning.planner` optimises it, chunk boundary by chunk boundary.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from cgdp.planning.chunks import Plan
from cgdp.planning.costs import Linear, ModelCosts, StageCosts

STAGES = ("compute", "d2h", "acc", "comm", "dram", "h2d")
"""The flow shop's stages; ``dram`` runs beside d2h..comm (from the chunk's ready time) and the
copy back waits for both."""


def ordered_compute(model: ModelCosts, costs: StageCosts) -> np.ndarray:
    """Per layer in ``model.order``: its backward on the slowest device plus its hooks' host CPU."""
    bwd = np.array([model.backward_s[i] for i in model.order]) * max(costs.device_speed or [1.0])
    if model.layer_tensors and costs.hook_s:
        bwd = bwd + np.array([model.layer_tensors[i] for i in model.order]) * costs.hook_s
    return bwd


def stage_times(model: ModelCosts, costs: StageCosts, sizes: Sequence[int]) -> np.ndarray:
    """Per chunk (``sizes``: chunk lengths along ``model.order``) the time it holds each stage."""
    bwd = ordered_compute(model, costs)
    nb = np.array([model.layer_bytes[i] for i in model.order], dtype=float)
    edges = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    cb = np.concatenate([[0.0], np.cumsum(bwd)])
    cn = np.concatenate([[0.0], np.cumsum(nb)])
    return stage_times_from_sums(costs, cb[edges[1:]] - cb[edges[:-1]], cn[edges[1:]] - cn[edges[:-1]])


def stage_times_from_sums(costs: StageCosts, bwd: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Vectorised stage times of chunks given their compute time and bytes."""
    def lin(f: Linear, b: np.ndarray) -> np.ndarray:
        return np.where(b > 0, f.latency_s + b * f.per_byte_s, 0.0)
    p = np.empty((len(bwd), len(STAGES)))
    p[:, 0] = bwd + costs.sync_s
    p[:, 1] = costs.share() * lin(costs.d2h, nbytes)
    p[:, 2] = lin(costs.acc, nbytes)
    if costs.segment_s or costs.segment_device_s:
        per = costs.segment_s + costs.devices * costs.segment_device_s
        segs = np.where(nbytes > 0, np.maximum(1.0, np.ceil(nbytes / costs.segment_bytes))
                        if costs.segment_bytes > 0 else 1.0, 0.0)
        p[:, 2] += segs * per
    p[:, 3] = lin(costs.comm, nbytes) if costs.ranks > 1 else 0.0
    p[:, 4] = lin(costs.dram, nbytes)
    p[:, 5] = costs.share() * lin(costs.h2d, nbytes)
    return p


def advance(state: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Flow-shop step: finish times of one more chunk given the previous chunk's (rows broadcast).
    Stages run in series, except ``dram`` (column 4), which starts with the chunk's d2h and which
    the copy back (column 5) also waits for."""
    out = np.empty(np.broadcast_shapes(state.shape, p.shape))
    out[..., 0] = state[..., 0] + p[..., 0]
    for s in range(1, 4):
        out[..., s] = np.maximum(state[..., s], out[..., s - 1]) + p[..., s]
    out[..., 4] = np.maximum(state[..., 4], out[..., 0]) + p[..., 4]
    out[..., 5] = np.maximum(state[..., 5], np.maximum(out[..., 3], out[..., 4])) + p[..., 5]
    return out


def chain_makespan(p: np.ndarray) -> float:
    """End of the backward phase for stage times ``p`` (chunks × stages), identical devices."""
    state = np.zeros(p.shape[1])
    for row in p:
        state = advance(state, row)
    return float(state[-1]) if len(p) else 0.0


def sizes_of(model: ModelCosts, plan: Plan) -> list[int] | None:
    """Chunk lengths if ``plan`` is contiguous runs of ``model.order`` (else ``None``)."""
    pos = {layer: i for i, layer in enumerate(model.order)}
    sizes, at = [], 0
    for ch in plan:
        ps = sorted(pos[x] for x in ch)
        if ps != list(range(at, at + len(ch))):
            return None
        sizes.append(len(ch))
        at += len(ch)
    return sizes


def plan_of(model: ModelCosts, sizes: Sequence[int]) -> Plan:
    """The plan with chunk lengths ``sizes`` along ``model.order`` (layers in completion order)."""
    plan, at = [], 0
    for s in sizes:
        plan.append(list(model.order[at:at + s]))
        at += s
    return plan
