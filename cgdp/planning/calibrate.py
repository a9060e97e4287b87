"""Calibration: turn the engine's measured step profiles into simulator inputs.

A :class:`cgdp.planning.profile.StepProfile` says when each layer's gradient was complete (``layer_ready_s``,
from the start of backward) and how long each chunk spent in D2H, accumulation, MPI and H2D. From
one or more profiles, taken with different chunk plans, this module estimates:

* the backward order (layers sorted by completion time; layers without a gradient go last, costing 0),
* the sync cost per chunk ``sync_s`` (t_as): a layer that follows a chunk boundary waits for that
  chunk's sync, so comparing the same layer's completion gap under a plan with a boundary before
  it and a plan without isolates t_as (median over layers: robust to a noisy gap),
* per-layer backward compute: the completion gaps minus the syncs the profiled plan paid,
* each stage's cost as ``latency + bytes/bandwidth``, least squares over all profiled chunks,
* forward, update and the rest of the step (medians).

Everything is deterministic in the profiles given (the tuner's decisions must replay). Planning code:
it reads profiles and never touches the runtime.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Any, Callable, Sequence

import numpy as np

from cgdp.planning.costs import Linear, ModelCosts, StageCosts
from cgdp.planning.profile import StepProfile


def backward_order(profile: StepProfile) -> list[int]:
    """Layers in the order their gradients completed; layers with none (``nan``) last, descending."""
    ready = profile.layer_ready_s
    seen = [i for i in range(len(ready)) if math.isfinite(ready[i])]
    unseen = [i for i in range(len(ready) - 1, -1, -1) if not math.isfinite(ready[i])]
    return sorted(seen, key=lambda i: (ready[i], -i)) + unseen


def _boundary_after(plan: Sequence[Sequence[int]], order: Sequence[int]) -> set[int]:
    """Layers that complete a chunk when backward runs in ``order`` (they pay the chunk's sync)."""
    owner = {layer: c for c, ch in enumerate(plan) for layer in ch}
    left = {c: len(ch) for c, ch in enumerate(plan)}
    out = set()
    for layer in order:
        c = owner.get(layer)
        if c is None:
            continue
        left[c] -= 1
        if left[c] == 0:
            out.add(layer)
    return out


def _gaps(profile: StepProfile, order: Sequence[int]) -> dict[int, float]:
    """Per layer (finite only): completion time minus that of the layer completed just before."""
    out, prev = {}, 0.0
    for layer in order:
        t = profile.layer_ready_s[layer]
        if not math.isfinite(t):
            continue
        out[layer] = max(t - prev, 0.0)
        prev = t
    return out


def fit_sync(profiles: Sequence[StepProfile], order: Sequence[int]) -> float:
    """t_as: the slope of backward compute (last completion) against the number of chunks, least
    squares over the profiles; if every profile used the same number of chunks, the median over
    layers of (gap when the previous layer closed a chunk) − (gap when not)."""
    pts = [(len(p.plan), max((t for t in p.layer_ready_s if math.isfinite(t)), default=0.0)) for p in profiles]
    if len({n for n, _ in pts}) >= 2:
        x = np.array([n for n, _ in pts], float)
        y = np.array([t for _, t in pts], float)
        slope = float(np.polyfit(x, y, 1)[0])
        return max(slope, 0.0)
    with_b: dict[int, list[float]] = {}
    without: dict[int, list[float]] = {}
    for p in profiles:
        closes = _boundary_after(p.plan, order)
        gaps = _gaps(p, order)
        for prev, layer in zip(order, order[1:]):
            if layer in gaps:
                (with_b if prev in closes else without).setdefault(layer, []).append(gaps[layer])
    diffs = [median(with_b[x]) - median(without[x]) for x in with_b if x in without]
    return float(max(median(diffs), 0.0)) if diffs else 0.0


def fit_linear(points: Sequence[tuple[float, float]]) -> Linear:
    """``latency + bytes * per_byte`` by least squares, both kept non-negative."""
    pts = [(b, t) for b, t in points if b > 0 and math.isfinite(t) and t >= 0]
    if not pts:
        return Linear()
    x = np.array([b for b, _ in pts], dtype=float)
    y = np.array([t for _, t in pts], dtype=float)
    if len(set(x.tolist())) >= 2:
        A = np.stack([np.ones_like(x), x], axis=1)
        (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
        if a >= 0 and b >= 0:
            return Linear(float(a), float(b))
    b = float((x @ y) / (x @ x))  # through the origin
    if b >= 0:
        a = float(np.median(np.maximum(y - b * x, 0.0)))
        return Linear(a if a < 0.5 * float(np.median(y)) else 0.0, b)
    return Linear(float(np.median(y)), 0.0)


@dataclass
class Calibration:
    """Simulator inputs fitted from profiles, and how well they reproduce the profiles."""

    model: ModelCosts
    """Per-layer compute and bytes, forward/update/other time."""
    costs: StageCosts
    """Sync, copy, accumulation and MPI costs."""
    profiles: int
    """How many profiles were used."""


def calibrate(profiles: Sequence[StepProfile], base: StageCosts | None = None) -> Calibration:
    """Fit the simulator to ``profiles`` (CGDP steps; ideally two or more plans with different cuts).

    ``base`` supplies stage costs a profile cannot show (say, the MPI tier on one machine).
    """
    if not profiles:
        raise ValueError("calibrate needs at least one profiled step; profile a step first "
                         "(Trainer(profile=True) or trainer.profile_next())")
    p0 = profiles[0]
    L = len(p0.layer_bytes)
    for p in profiles:
        if len(p.layer_bytes) != L or p.devices != p0.devices:
            raise ValueError("profiles come from different models or device counts; calibrate one "
                             "configuration at a time")
    order = backward_order(p0)
    sync = fit_sync(profiles, order)
    per_layer: dict[int, list[float]] = {}
    for p in profiles:
        closes = _boundary_after(p.plan, order)
        gaps = _gaps(p, order)
        for prev, layer in zip([None] + list(order), order):
            if layer in gaps:
                paid = sync if prev is not None and prev in closes else 0.0
                per_layer.setdefault(layer, []).append(max(gaps[layer] - paid, 0.0))
    backward = [median(per_layer[i]) if i in per_layer else 0.0 for i in range(L)]
    # Per-layer medians describe the shape; noise makes their sum fall short of a typical step
    # (a preempted layer is a different one each time), so scale them to the median total.
    totals = [max((t for t in p.layer_ready_s if math.isfinite(t)), default=0.0)
              - sync * max(len(_boundary_after(p.plan, order)) - 1, 0) for p in profiles]  # the last sync is after it
    if sum(backward) > 0:
        scale = max(median(totals), 0.0) / sum(backward)
        backward = [b * scale for b in backward]

    def stage(attr: str) -> Linear:
        return fit_linear([(c.bytes, getattr(c, attr)) for p in profiles for c in p.chunks])

    base = base or StageCosts(devices=p0.devices)
    # a probed allreduce (base.ranks > 1) beats a fit of the profile's comm times, which include
    # each chunk's wait behind the chunks posted before it
    comm = base.comm if base.ranks > 1 else stage("comm_s") if p0.ranks > 1 else base.comm
    costs = StageCosts(devices=p0.devices, sync_s=sync, d2h=stage("d2h_s"), h2d=stage("h2d_s"),
                       acc=stage("acc_s"), ranks=p0.ranks, comm=comm, link_groups=base.link_groups,
                       device_speed=base.device_speed, p2p=base.p2p, device_acc=base.device_acc,
                       typical_pattern=base.typical_pattern)
    fwd = median(p.forward_s for p in profiles)
    upd = median(p.update_s for p in profiles)
    # forward, backward and update are maxima over devices, so per profile they may overlap;
    # the rest of the step is taken from medians of whole terms
    other = median(p.step_s for p in profiles) - fwd - upd - median(p.backward_s + p.exposed_comm_s for p in profiles)
    last = [max((t for t in p.layer_ready_s if math.isfinite(t)), default=0.0) for p in profiles]
    tail = median(max(p.backward_s - t, 0.0) for p, t in zip(profiles, last))
    model = ModelCosts(list(p0.layer_bytes), backward, order, fwd, upd, max(other, 0.0), tail)
    return Calibration(model, costs, len(profiles))


def synthetic_profile(model: ModelCosts, costs: StageCosts, plan: Sequence[Sequence[int]],
                      ranks: int | None = None) -> StepProfile:
    """The profile the engine would record if it behaved exactly as the simulator says.

    The inverse of :func:`calibrate` (tests check the round trip), and a stand-in machine for
    exercising tuners without one.
    """
    from cgdp.planning.profile import ChunkTiming
    from cgdp.planning.simulator import simulate

    plan = [list(ch) for ch in plan]
    res = simulate(model, costs, plan)
    ready = [math.nan] * model.num_layers
    for t in res.tasks:
        if t.kind == "compute" and t.layer >= 0 and model.backward_s[t.layer] >= 0:
            ready[t.layer] = t.end if math.isnan(ready[t.layer]) else max(ready[t.layer], t.end)
    chunks = []
    for c, ch in enumerate(plan):
        mine = [t for t in res.tasks if t.chunk == c]

        def mean(kind: str) -> float:
            xs = [t.duration for t in mine if t.kind == kind]
            return sum(xs) / len(xs) if xs else 0.0
        sent = [t.start for t in mine if t.kind == "d2h"]
        back = [t.end for t in mine if t.kind == "h2d"]
        chunks.append(ChunkTiming(c, ch, sum(model.layer_bytes[i] for i in ch), mean("d2h"), mean("acc"),
                                  mean("comm"), mean("h2d"), sum(sent) / len(sent), max(back)))
    return StepProfile(devices=costs.devices, ranks=ranks or costs.ranks, mode="cgdp",
                       layer_bytes=list(model.layer_bytes), layer_ready_s=ready, forward_s=model.forward_s,
                       backward_s=res.compute_s, exposed_comm_s=res.exposed_s, update_s=model.update_s,
                       step_s=res.step_s, plan=plan, chunks=chunks)


def profile_and_time(trainer: Any, plans: dict[str, list[list[int]]], rounds: int,
                     step: Callable[[], object]) -> tuple[list[StepProfile], dict[str, list[float]]]:
    """Calibration data and measurements from one trainer, interleaved round by round so that
    both see the same load: each round profiles one step of the one-layer-per-chunk plan and one of
    the single-chunk plan (the two cuts :func:`calibrate` needs), then times one step of every
    plan in ``plans``. ``step()`` runs one training step on ``trainer``. Returns the profiles and
    the step times per plan name."""
    L = len(trainer.layers)
    cuts = [[[i] for i in range(L - 1, -1, -1)], [list(range(L - 1, -1, -1))]]
    profiles: list[StepProfile] = []
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(rounds):
        for plan in cuts:
            trainer.set_plan(plan)
            trainer.profile_next()
            step()
            profiles.append(trainer.last_profile)
        for name, plan in plans.items():
            trainer.set_plan(plan)
            step()
            times[name].append(trainer.stats["step_s"])
    return profiles, times
