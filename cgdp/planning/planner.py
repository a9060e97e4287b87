"""Chunk planning on the simulator: non-uniform chunk boundaries by dynamic programming.

The paper searches only uniform chunk sizes (§4.2, Algorithm 1); there are 2^(l−1) plans
(Proposition 4.1). For identical devices the simulator's backward phase is a permutation flow shop
(:func:`cgdp.planning.flowshop.chain_makespan`): a chunk holds compute, D2H, host accumulation, (MPI) and
H2D in turn, each stage serving chunks in order. The state after a prefix of chunks is the vector of
finish times of the last chunk on every stage, and the final time is a monotone (max-plus) function
of that vector. So the planner keeps, at every layer boundary, the Pareto front of state vectors
reachable by plans of the prefix: a state no better on every stage than another can be dropped
without losing the optimum. The result is exact while fronts are not truncated (``max_front``),
which the tests check by brute force; on deep models the front is capped, keeping the states with
the best lower bound, and the plan is also compared with the best uniform and byte-bucket plans, so
it is never worse than those on the simulator.

Planning code: it imports nothing from the runtime.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from cgdp.planning.chunks import paper_plan
from cgdp.planning.costs import ModelCosts, StageCosts
from cgdp.planning.flowshop import STAGES, advance, ordered_compute, plan_of, stage_times_from_sums
from cgdp.planning.simulator import predict_step

Plan = list[list[int]]


@dataclass
class PlanChoice:
    """The planner's answer."""

    plan: Plan
    """Chunks in send order, layers in completion order."""
    predicted_s: float
    """Predicted step time of ``plan``."""
    method: str
    """Which search produced it: "dp", "dp-capped", "uniform k=..", "bytes <=..MB"."""
    alternatives: dict[str, tuple[float, Plan]] = field(default_factory=dict)
    """Other candidates: name → (predicted step time, plan)."""


def dp_plan(model: ModelCosts, costs: StageCosts, max_front: int = 64) -> tuple[Plan, float, bool]:
    """Best contiguous plan along ``model.order`` under the closed-form model.

    Returns (plan, predicted step time, exact) where ``exact`` is False if some front was capped.
    Cost: O(L² · max_front) vectorised steps.
    """
    L = model.num_layers
    if L == 0:
        return [], model.forward_s + model.update_s + model.other_s, True
    bwd = ordered_compute(model, costs)
    nb = np.array([model.layer_bytes[i] for i in model.order], dtype=float)
    cb = np.concatenate([[0.0], np.cumsum(bwd)])
    cn = np.concatenate([[0.0], np.cumsum(nb)])
    S = len(STAGES)
    # fronts[j]: states (rows) after a plan of the first j layers; back[j]: (i, row in fronts[i])
    fronts: list[np.ndarray] = [np.zeros((1, S))]
    back: list[np.ndarray] = [np.array([[-1, -1]])]
    exact = True
    for j in range(1, L + 1):
        starts = np.concatenate([np.full(len(fronts[i]), i) for i in range(j)])
        rows = np.concatenate([np.arange(len(fronts[i])) for i in range(j)])
        prev = np.concatenate(fronts[:j])
        p = stage_times_from_sums(costs, cb[j] - cb[starts], cn[j] - cn[starts])
        cand = advance(prev, p)
        # Lower bound of the final time: compute still to run, then the cheapest possible tail.
        lb = np.maximum(cand[:, 0] + (cb[L] - cb[j]), cand[:, -1])
        keep, truncated = _pareto(cand, lb, max_front)
        exact = exact and not truncated
        fronts.append(cand[keep])
        back.append(np.stack([starts[keep], rows[keep]], axis=1))
    best = int(np.argmin(np.maximum(fronts[L][:, -1], fronts[L][:, 0] + model.tail_s)))
    sizes = []
    j, r = L, best
    while j > 0:
        i, r2 = back[j][r]
        sizes.append(j - int(i))
        j, r = int(i), int(r2)
    sizes.reverse()
    plan = plan_of(model, sizes)
    return plan, predict_step(model, costs, plan), exact


def _pareto(cand: np.ndarray, lb: np.ndarray, cap: int) -> tuple[np.ndarray, bool]:
    """Indices of non-dominated rows (≤ on every stage), at most ``cap``, best lower bound first;
    and whether non-dominated rows were left out because of ``cap``.

    Rows are taken in order of (lower bound, sum): no row is dominated by a later one, so the row
    taken first among those left is always non-dominated.
    """
    order = np.lexsort((cand.sum(axis=1), lb))
    alive = np.ones(len(cand), dtype=bool)
    keep = []
    for idx in order:
        if not alive[idx]:
            continue
        keep.append(idx)
        alive &= ~np.all(cand >= cand[idx], axis=1)  # drops idx itself and everything it dominates
        if len(keep) >= cap:
            break
    return np.array(keep, dtype=int), bool(alive.any())


def uniform_plans(model: ModelCosts) -> Iterator[tuple[int, Plan]]:
    """The paper's uniform plans k = 1..L, over ``model.order`` (for the default order exactly
    :func:`cgdp.planning.chunks.paper_plan`)."""
    L = model.num_layers
    for k in range(1, max(L, 1) + 1):
        sizes = [len(ch) for ch in paper_plan(L, k)]
        yield k, plan_of(model, sizes)


def best_uniform(model: ModelCosts, costs: StageCosts) -> tuple[int, Plan, float]:
    """The uniform plan the simulator likes best: (k, plan, predicted step time)."""
    best = None
    for k, plan in uniform_plans(model):
        t = predict_step(model, costs, plan)
        if best is None or t < best[2] - 1e-15:
            best = (k, plan, t)
    assert best is not None
    return best


def byte_bucket_sizes(model: ModelCosts, cap_bytes: float, tail_singles: int = 0) -> list[int]:
    """Chunk lengths that close a chunk once it holds ``cap_bytes`` (DDP's buckets), optionally
    sending the last ``tail_singles`` layers alone."""
    L = model.num_layers
    body = L - min(tail_singles, L)
    sizes, run, nbytes = [], 0, 0.0
    for pos in range(body):
        run += 1
        nbytes += model.layer_bytes[model.order[pos]]
        if nbytes >= cap_bytes:
            sizes.append(run)
            run, nbytes = 0, 0.0
    if run:
        sizes.append(run)
    return sizes + [1] * (L - body)


def best_byte_buckets(model: ModelCosts, costs: StageCosts) -> tuple[str, Plan, float]:
    """Byte-capped buckets over a geometric range of caps, with and without a singles tail."""
    total = max(sum(model.layer_bytes), 1)
    best = None
    for cap in np.geomspace(total / 256, total, 25):
        for tail in (0, 1, 2, 4):
            plan = plan_of(model, byte_bucket_sizes(model, cap, tail))
            t = predict_step(model, costs, plan)
            if best is None or t < best[2] - 1e-15:
                best = (f"bytes <={cap / 1e6:.3g}MB tail={tail}", plan, t)
    assert best is not None
    return best


def choose_plan(model: ModelCosts, costs: StageCosts, max_front: int = 64) -> PlanChoice:
    """The best plan found by the DP, the uniform search and the byte buckets, with the others."""
    plan, t, exact = dp_plan(model, costs, max_front)
    alts: dict[str, tuple[float, Plan]] = {("dp" if exact else "dp-capped"): (t, plan)}
    k, up, ut = best_uniform(model, costs)
    alts[f"uniform k={k}"] = (ut, up)
    name, bp, bt = best_byte_buckets(model, costs)
    alts[name] = (bt, bp)
    method = min(alts, key=lambda m: (alts[m][0], list(alts).index(m)))
    return PlanChoice(alts[method][1], alts[method][0], method, alts)


def all_sizes(num_layers: int) -> Iterator[list[int]]:
    """Every way to cut ``num_layers`` layers into chunks: 2^(l−1) compositions (Proposition 4.1
    counts those with at least one cut)."""
    for cuts in itertools.product((False, True), repeat=max(num_layers - 1, 0)):
        sizes, run = [], 1
        for cut in cuts:
            if cut:
                sizes.append(run)
                run = 1
            else:
                run += 1
        yield sizes + [run] if num_layers else []


def brute_force(model: ModelCosts, costs: StageCosts) -> tuple[Plan, float]:
    """The optimum by enumeration (small models only: 2^(L−1) plans)."""
    if model.num_layers > 20:
        raise ValueError(f"brute force over 2^{model.num_layers - 1} plans is too slow; use dp_plan")
    best = None
    for sizes in all_sizes(model.num_layers):
        t = predict_step(model, costs, plan_of(model, sizes))
        if best is None or t < best[1] - 1e-15:
            best = (plan_of(model, sizes), t)
    assert best is not None
    return best
