"""A discrete-event model of one training iteration: CGDP, the typical baseline, ring allreduce.

Inputs are a :class:`~cgdp.planning.costs.ModelCosts` (what one device computes: per-layer
backward time and gradient bytes, forward and update time, measured by the engine's profile) and a
:class:`~cgdp.planning.costs.StageCosts` (what moving and adding a chunk costs on this machine:
fitted from profiles by :mod:`cgdp.planning.calibrate`, or derived from a hardware description by
:mod:`cgdp.planning.hardware`); both, and :class:`~cgdp.planning.costs.Linear`, live in
:mod:`cgdp.planning.costs` and are importable from here too. The output is the predicted step time
and a timeline (:class:`SimResult`, its :class:`Task` list).

The model, and why:

* Every device has one in-order compute stream. Backward runs the layers in ``ModelCosts.order``;
  when the last layer of a chunk is done, the stream pays ``sync_s`` (the paper's t_as: recording
  the event, running the hook) and the chunk is ready.
* A link carries one transfer at a time per direction (the paper, §3.1). Devices listed together
  in ``link_groups`` share one link per direction (two GPUs behind one PCIe switch uplink).
* The host adds one chunk at a time (all accumulation threads work on it): ``acc`` prices the whole
  chunk, all devices' contributions included, so it is where host memory bandwidth and thread count
  bind. With several machines, one MPI allreduce per chunk follows (``comm``: α + β·bytes), in order.
* Each device's copy back uses its H2D link; the backward phase ends when the last chunk is back on
  every device (or, if later, when compute ends).
* Host DRAM carries (3G + 1) x the chunk's bytes (G copies in, G reads and one write by the sum,
  G reads by the copies back): a FIFO resource ``dram`` that every chunk holds for that traffic
  once it is ready, in parallel with its copies and its sum; a chunk goes back only when both are
  done. Where DRAM is slower than the links and the sum, it binds (a desktop's DRAM from G = 2).
* Host CPU, the one process's own work: ``hook_s`` per parameter tensor on the thread that issues
  a device's backward (added to the layer's compute), ``sync_s`` per chunk there (the send), and
  ``segment_s + G * segment_device_s`` per segment on the host thread (waiting on the copies,
  launching the sum, issuing the copies back), added to the chunk's accumulation. Where the host
  thread's per-segment work sets the pace, the limit is reported as ``hostcpu``.
* Every resource serves its ready tasks first-come first-served, ties broken by chunk then device:
  the engine's streams and host queues are FIFO too.

The same model in closed form for identical devices (a permutation flow shop, which the planner
optimises and the tests check against the event simulation) is :mod:`cgdp.planning.flowshop`;
:func:`predict_step` uses it where it is exact and :func:`simulate` elsewhere.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

# ModelCosts and StageCosts are also imported from here (cgdp.cli.plan)
from cgdp.planning.costs import ModelCosts, StageCosts
from cgdp.planning.flowshop import chain_makespan, ordered_compute, sizes_of, stage_times

Plan = list[list[int]]


@dataclass
class Task:
    """One piece of work on one resource in the timeline."""

    kind: str
    """Stage: compute, sync, d2h, acc, comm, dram, h2d, gather, reduce, update, bcast, ring."""
    resource: str | None
    """Who serves it one at a time (``None``: unlimited)."""
    duration: float
    deps: list[int]
    chunk: int = -1
    device: int = -1
    layer: int = -1
    """For compute tasks: the layer whose backward this is."""
    host_s: float = 0.0
    """Of ``duration``, the host CPU's own work (per-segment costs of an ``acc`` task)."""
    start: float = math.nan
    end: float = math.nan


@dataclass
class SimResult:
    """A predicted iteration."""

    mode: str
    step_s: float
    """Forward + backward phase + update + other."""
    compute_s: float
    """When backward compute ended on the slowest device."""
    phase_s: float
    """When the backward phase ended (gradients back everywhere; typical: parameters broadcast)."""
    busy_s: dict[str, float]
    """Busy time of the busiest resource of each stage kind."""
    critical_s: dict[str, float]
    """Time each stage kind spends on the critical path."""
    binding: str
    """The limit that sets the step time."""
    tasks: list[Task]

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.phase_s - self.compute_s)


def run_tasks(tasks: list[Task], costs: StageCosts | None = None) -> None:
    """Event simulation of ``tasks`` (a DAG by ``deps``) on single-server FIFO resources, in place.

    With ``costs.shared_cores`` set, tasks that run on host CPUs (see :meth:`~cgdp.planning.costs.StageCosts.threads`)
    also share that many cores: while the threads wanting a core outnumber the cores, every such
    task progresses at cores/threads of its full speed (processor sharing). That is the emulated
    machine, where "device" compute, copies and accumulation all run on the same cores.
    """
    n = len(tasks)
    waiting = [len(t.deps) for t in tasks]
    users: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for d in t.deps:
            users[d].append(i)
    cores = costs.shared_cores if costs is not None else None
    demand = [costs.threads(t.kind) if cores else 0.0 for t in tasks]
    queues: dict[str, list] = {}
    busy: dict[str, bool] = {}
    running: dict[int, float] = {}  # task id -> work left (seconds at full speed)

    def ready(i: int, now: float) -> None:
        t = tasks[i]
        if t.resource is None:
            t.start = now
            running[i] = t.duration
        else:
            heapq.heappush(queues.setdefault(t.resource, []), (now, t.chunk, t.device, i))

    def dispatch(now: float) -> None:
        for res, q in queues.items():
            if q and not busy.get(res):
                _, _, _, i = heapq.heappop(q)
                tasks[i].start = now
                busy[res] = True
                running[i] = tasks[i].duration

    for i in range(n):
        if waiting[i] == 0:
            ready(i, 0.0)
    now, done = 0.0, 0
    dispatch(now)
    while running:
        want = sum(demand[i] for i in running)
        share = min(1.0, cores / want) if cores and want > 0 else 1.0
        rate = {i: (share if demand[i] > 0 else 1.0) for i in running}
        dt = min(left / rate[i] for i, left in running.items())
        now += dt
        finished = []
        for i in list(running):
            running[i] -= dt * rate[i]
            if running[i] <= 1e-15 * max(1.0, tasks[i].duration) + 1e-18:
                finished.append(i)
        for i in sorted(finished):  # finish everything due now before starting more
            del running[i]
            tasks[i].end = now
            done += 1
            if tasks[i].resource is not None:
                busy[tasks[i].resource] = False
            for u in users[i]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    ready(u, now)
        dispatch(now)
    if done != n:
        raise RuntimeError("task graph has a cycle; this is a bug in the simulator")


def _chunks_in_order(model: ModelCosts, plan: Plan) -> tuple[list[int], list[int]]:
    """Per layer its chunk, and per chunk the position in ``order`` where it completes."""
    owner = [-1] * model.num_layers
    for c, chunk in enumerate(plan):
        for layer in chunk:
            owner[layer] = c
    if min(owner, default=0) < 0:
        raise ValueError("the plan leaves out some layers; every layer must be in one chunk")
    left = [len(ch) for ch in plan]
    completes = [0] * len(plan)
    for pos, layer in enumerate(model.order):
        left[owner[layer]] -= 1
        if left[owner[layer]] == 0:
            completes[owner[layer]] = pos
    return owner, completes


def _backward_tasks(model: ModelCosts, costs: StageCosts, plan: Plan | None,
                    tasks: list[Task]) -> tuple[list[int], list[list[int]]]:
    """Compute streams; returns the last compute task per device and, per chunk, its ready task per
    device (``plan=None``: no chunks, backward alone)."""
    speed = costs.device_speed or [1.0] * costs.devices
    owner, _ = _chunks_in_order(model, plan) if plan else ([], [])
    left = [len(ch) for ch in plan] if plan else []
    last = [-1] * costs.devices
    ready: list[list[int]] = [[-1] * costs.devices for _ in (plan or [])]
    hooks = model.layer_tensors if (model.layer_tensors and costs.hook_s) else None
    for d in range(costs.devices):
        left_d = list(left)
        prev = -1
        for layer in model.order:
            hook = hooks[layer] * costs.hook_s if hooks and plan else 0.0
            tasks.append(Task("compute", f"compute{d}", model.backward_s[layer] * speed[d] + hook,
                              [prev] if prev >= 0 else [], device=d, layer=layer))
            prev = len(tasks) - 1
            if plan:
                c = owner[layer]
                left_d[c] -= 1
                if left_d[c] == 0:
                    tasks.append(Task("sync", f"compute{d}", costs.sync_s, [prev], chunk=c, device=d))
                    prev = len(tasks) - 1
                    ready[c][d] = prev
        if model.tail_s > 0:
            tasks.append(Task("compute", f"compute{d}", model.tail_s * speed[d], [prev] if prev >= 0 else [],
                              device=d))
            prev = len(tasks) - 1
        last[d] = prev
    return last, ready


def _chunk_bytes(model: ModelCosts, plan: Plan) -> list[int]:
    return [sum(model.layer_bytes[i] for i in ch) for ch in plan]


def _finish(mode: str, model: ModelCosts, costs: StageCosts, tasks: list[Task],
            compute_last: list[int], extra_s: float) -> SimResult:
    run_tasks(tasks, costs)
    compute_s = max((tasks[i].end for i in compute_last if i >= 0), default=0.0)
    phase_s = max([compute_s] + [t.end for t in tasks])
    busy: dict[str, dict[str, float]] = {}
    for t in tasks:
        per = busy.setdefault(t.kind, {})
        per[t.resource or ""] = per.get(t.resource or "", 0.0) + t.duration
    busy_s = {k: max(v.values()) for k, v in busy.items()}
    critical = _critical_path(tasks)
    exposed = phase_s - compute_s
    comm_kinds = {k: v for k, v in critical.items() if k not in ("compute", "sync")}
    if exposed <= 0.02 * max(compute_s, 1e-12) or not comm_kinds:
        binding = "compute"
    else:
        binding = max(comm_kinds, key=comm_kinds.get)
    step = model.forward_s + phase_s + extra_s + model.other_s
    return SimResult(mode, step, compute_s, phase_s, busy_s, critical, binding, tasks)


def _critical_path(tasks: list[Task]) -> dict[str, float]:
    """Walk back from the last task: each task waited either on a dependency or on its resource."""
    if not tasks:
        return {}
    by_res: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        if t.resource is not None:
            by_res.setdefault(t.resource, []).append(i)
    prev_on_res: dict[int, int] = {}
    for ids in by_res.values():
        ids.sort(key=lambda i: tasks[i].start)
        for a, b in zip(ids, ids[1:]):
            prev_on_res[b] = a
    out: dict[str, float] = {}
    i = max(range(len(tasks)), key=lambda k: (tasks[k].end, k))
    while i >= 0:
        t = tasks[i]
        out[t.kind] = out.get(t.kind, 0.0) + t.duration - t.host_s
        if t.host_s:
            out["hostcpu"] = out.get("hostcpu", 0.0) + t.host_s
        cands = [d for d in t.deps] + ([prev_on_res[i]] if i in prev_on_res else [])
        cands = [c for c in cands if abs(tasks[c].end - t.start) <= 1e-12 + 1e-9 * abs(t.start)]
        i = max(cands, key=lambda c: tasks[c].end) if cands else -1
    return out


def simulate(model: ModelCosts, costs: StageCosts, plan: Plan, mode: str = "cgdp") -> SimResult:
    """Predict one iteration. ``mode``: "cgdp" (chunks per ``plan``), "typical" (the paper's §2.3
    baseline, ``plan`` ignored) or "ring" (ring allreduce per chunk, as DDP buckets, overlapping
    backward)."""
    if mode == "cgdp":
        return _simulate_cgdp(model, costs, plan)
    if mode == "typical":
        return _simulate_typical(model, costs)
    if mode == "ring":
        return _simulate_ring(model, costs, plan)
    raise ValueError(f"mode must be 'cgdp', 'typical' or 'ring', got {mode!r}")


def _link_of(costs: StageCosts) -> dict[int, int]:
    return {d: gi for gi, g in enumerate(costs.groups()) for d in g}


def _simulate_cgdp(model: ModelCosts, costs: StageCosts, plan: Plan) -> SimResult:
    tasks: list[Task] = []
    last, ready = _backward_tasks(model, costs, plan, tasks)
    link = _link_of(costs)
    for c, nbytes in enumerate(_chunk_bytes(model, plan)):
        d2h = []
        for d in range(costs.devices):
            tasks.append(Task("d2h", f"d2h-link{link[d]}", costs.d2h(nbytes), [ready[c][d]], c, d))
            d2h.append(len(tasks) - 1)
        host = costs.host_cpu(nbytes)
        tasks.append(Task("acc", "host", costs.acc(nbytes) + host, d2h, c, host_s=host))
        src = len(tasks) - 1
        if costs.ranks > 1:
            tasks.append(Task("comm", "network", costs.comm(nbytes), [src], c))
            src = len(tasks) - 1
        # host DRAM moves the chunk's (3G + 1) x bytes while its copies and sum run
        tasks.append(Task("dram", "dram", costs.dram(nbytes), list(ready[c]), c))
        dram = len(tasks) - 1
        for d in range(costs.devices):
            tasks.append(Task("h2d", f"h2d-link{link[d]}", costs.h2d(nbytes), [src, dram], c, d))
    return _finish("cgdp", model, costs, tasks, last, model.update_s)


def _copy(costs: StageCosts, tasks: list[Task], kind: str, src: int, dst: int, nbytes: int,
          deps: list[int], chunk: int = -1) -> int:
    """Device-to-device copy: direct if P2P, else staged through host memory. Staged copies are
    pipelined in slices, so the H2D leg only adds what it takes beyond the D2H leg."""
    link = _link_of(costs)
    if costs.p2p is not None:
        tasks.append(Task(kind, f"p2p-out{src}", costs.p2p(nbytes), deps, chunk, src))
        return len(tasks) - 1
    down, up = costs.d2h(nbytes), costs.h2d(nbytes)
    tasks.append(Task(kind, f"d2h-link{link[src]}", down, deps, chunk, src))
    tasks.append(Task(kind, f"h2d-link{link[dst]}", max(up - down, 0.0) + costs.h2d.latency_s,
                      [len(tasks) - 1], chunk, dst))
    return len(tasks) - 1


def _simulate_typical(model: ModelCosts, costs: StageCosts) -> SimResult:
    """§2.3: after backward, device 0 gathers and averages, updates, then broadcasts parameters."""
    tasks: list[Task] = []
    last, _ = _backward_tasks(model, costs, None, tasks)
    total = sum(model.layer_bytes)
    G = costs.devices
    if costs.p2p is None and G > 1:
        # staged through host memory: gathered ((G - 1) x written and read) and broadcast (written
        # once, read G - 1 times): the phase cannot end before DRAM has moved that
        tasks.append(Task("dram", "dram", (3 * G - 1) / (3 * G + 1) * costs.dram(total), [i for i in last if i >= 0]))
    have = {d: last[d] for d in range(G)}  # task after which device d holds its (partial) sum
    if costs.typical_pattern == "tree":
        stride = 1
        while stride < G:
            for d in range(0, G, 2 * stride):
                if d + stride < G:
                    cp = _copy(costs, tasks, "gather", d + stride, d, total, [have[d + stride]])
                    tasks.append(Task("reduce", f"compute{d}", costs.device_acc(total), [cp, have[d]], device=d))
                    have[d] = len(tasks) - 1
            stride *= 2
        root = have[0]
    else:
        arrived = [_copy(costs, tasks, "gather", d, 0, total, [have[d]]) for d in range(1, G)]
        tasks.append(Task("reduce", "compute0", costs.device_acc(total) * (G - 1), arrived + [last[0]], device=0))
        root = len(tasks) - 1
    if costs.ranks > 1:
        tasks.append(Task("comm", "network", costs.comm(total), [root]))
        root = len(tasks) - 1
    tasks.append(Task("update", "compute0", model.update_s, [root], device=0))
    have = {0: len(tasks) - 1}
    if costs.typical_pattern == "tree":
        stride = 1
        while stride < G:
            stride *= 2
        while stride > 1:
            stride //= 2
            for d in range(0, G, 2 * stride):
                if d + stride < G:
                    have[d + stride] = _copy(costs, tasks, "bcast", d, d + stride, total, [have[d]])
    elif costs.p2p is not None:
        for d in range(1, G):
            _copy(costs, tasks, "bcast", 0, d, total, [have[0]])
    else:  # through the host: one copy down, one copy up to every other device
        link = _link_of(costs)
        tasks.append(Task("bcast", f"d2h-link{link[0]}", costs.d2h(total), [have[0]], device=0))
        down = len(tasks) - 1
        for d in range(1, G):
            tasks.append(Task("bcast", f"h2d-link{link[d]}", costs.h2d(total), [down], device=d))
    return _finish("typical", model, costs, tasks, last, 0.0)


def ring_allreduce_s(costs: StageCosts, nbytes: float) -> float:
    """One ring allreduce of ``nbytes`` over the G devices: 2(G−1) steps of nbytes/G per link;
    without P2P every step is staged through the host, and devices sharing a link take turns.
    With several machines, the inter-machine part is an α+β allreduce of the whole buffer."""
    G = costs.devices
    t = 0.0
    if G > 1:
        piece = nbytes / G
        if costs.p2p is not None:
            step = costs.p2p(piece)
        else:  # staged copies are pipelined in slices: the slower direction sets the pace
            step = costs.share() * max(costs.d2h(piece), costs.h2d(piece))
        t = 2 * (G - 1) * step
        if costs.p2p is None and costs.dram.per_byte_s:
            # staged through host memory: every piece is written and read once per ring step,
            # 4(G - 1) x the bytes in all, against cgdp's (3G + 1) that ``dram`` prices
            t = max(t, 4 * (G - 1) / (3 * G + 1) * costs.dram(nbytes))
    if costs.ranks > 1:
        t += costs.comm(nbytes)
    return t


def _simulate_ring(model: ModelCosts, costs: StageCosts, plan: Plan) -> SimResult:
    tasks: list[Task] = []
    last, ready = _backward_tasks(model, costs, plan, tasks)
    for c, nbytes in enumerate(_chunk_bytes(model, plan)):
        tasks.append(Task("ring", "ring", ring_allreduce_s(costs, nbytes), list(ready[c]), c))
    return _finish("ring", model, costs, tasks, last, model.update_s)


def predict_step(model: ModelCosts, costs: StageCosts, plan: Plan) -> float:
    """Fast CGDP step prediction: closed form when it is exact, the event simulation otherwise."""
    sizes = sizes_of(model, plan)
    if sizes is None or costs.shared_cores or (costs.device_speed and len(set(costs.device_speed)) > 1):
        return simulate(model, costs, plan).step_s
    phase = max(chain_makespan(stage_times(model, costs, sizes)),
                float(ordered_compute(model, costs).sum()) + len(sizes) * costs.sync_s + model.tail_s)
    return model.forward_s + phase + model.update_s + model.other_s
