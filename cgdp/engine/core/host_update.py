"""The optimizer steps on the host (``update="host"``), for both faces: its state once, in host memory.

:class:`HostMasters` holds float32 masters of replica 0's trainable parameters in one (pinned) host allocation, and
their gradients: views of the accumulator's sum row where it holds the averaged float32 gradient (no copy), a float32
buffer the bf16 row is widened into, or copies of replica 0's gradients. One ``torch.optim`` optimizer steps the
masters; every device then copies them into its replica (their bf16 rounding with a bf16 wire:
:mod:`cgdp.engine.core.host_wire`), so replicas are bitwise identical and no device holds optimizer state.

Invariants: between steps the masters equal replica 0's parameters (or their rounding), retaken whenever a version
counter moved (a load, a user's edit); float32 parameters only (16-bit masters would differ from one device: refused).

Threads: all on the caller's thread, except :meth:`HostMasters.to_devices` (each device's thread) and overlapped
updates: the thread that finalises a segment's sum queues each complete chunk to ``cgdp-host-update`` (no device, no
CUDA call), so later sums do not wait; :meth:`HostUpdate.reduce` waits for every chunk's update.
"""
from __future__ import annotations

import functools
import itertools
import operator
import queue
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from cgdp.engine.backend.base import Device
from cgdp.engine.core.host_adam import FlatAdam
from cgdp.engine.core.host_flat import FlatState
from cgdp.engine.core.host_sgd import FlatSGD
from cgdp.engine.core.host_state import StateSnapshot, has_step_hooks, prefer_fused, step_or_undo
from cgdp.engine.core.host_wire import Bf16Wire, masters_in_state_dict
from cgdp.engine.core.lifetime import Resources, weak_call
from cgdp.engine.core.stream import GradientStream
from cgdp.engine.core.threads import DeviceThreads
from cgdp.engine.core.update import Stamps, Update
from cgdp.engine.sync import Guard, Progress, StepAborted


def check_host_update(update: str, dtype: torch.dtype | None) -> bool:
    """Whether ``update`` asks for the host optimizer; a sentence for what is not supported."""
    if update not in ("devices", "host"):
        raise ValueError(f"update must be 'devices' (each device steps its replica) or 'host' (one "
                         f"optimizer over float32 masters in host memory), got {update!r}")
    if update == "host" and dtype is not None and dtype != torch.float32:
        raise ValueError(f"update='host' steps float32 masters and copies them back; these parameters are "
                         f"{dtype}, whose replicas would then differ from one device's training: keep "
                         f"update='devices', or train in float32 (with torch.autocast for 16-bit compute)")
    return update == "host"


class HostMasters:
    """Float32 masters of ``params[0]`` in host memory, their gradients, and the copy back."""

    def __init__(self, devs: Sequence[Device], params: Sequence[Sequence[torch.Tensor]]):
        self.devs = list(devs)
        self.params = [list(p) for p in params]
        if not self.params[0]:
            raise ValueError("update='host' steps float32 masters of the model's dense trainable parameters, and this "
                             "model has none (no parameter requires grad, or only sparse embeddings): use "
                             "update='devices'")
        odd = next((p for p in self.params[0] if not p.is_contiguous()), None)
        if odd is not None:
            raise ValueError(f"update='host' keeps float32 masters laid out row-major on the host, and a parameter "
                             f"of shape {tuple(odd.shape)} is not (strides {odd.stride()}: a channels_last "
                             f"convolution's weight, a transposed tensor): make the parameters contiguous before "
                             f"wrapping (model.to(memory_format=torch.contiguous_format)), or use update='devices'")
        numels = [p.numel() for p in self.params[0]]
        self.offsets = [0, *itertools.accumulate(numels)][:len(numels)]
        total = max(sum(numels), 1)
        self.flat = self.devs[0].host_empty((total,), torch.float32)
        self.masters = [nn.Parameter(self.flat[o:o + n].view(p.shape))
                        for o, n, p in zip(self.offsets, numels, self.params[0])]
        self.pid = {id(p): pid for pid, p in enumerate(self.params[0])}
        self.staged: torch.Tensor | None = None  # replica 0's flat gradient, copied to the host
        self.wide: torch.Tensor | None = None  # the float32 row a bf16 sum row is widened into (HostUpdate's)
        self._attached: tuple | None = None
        self._selected: tuple = (None,)
        self.wire: Any = None  # Bf16Wire with grad_transfer="bf16"
        self.unshown_bytes: Callable[[], int] = lambda: 0
        """Host memory the optimizer holds besides its state (the flat moments' other side)."""
        self._viewed: list[nn.Parameter] = []
        self.refresh()

    def refresh(self) -> None:
        """Masters ← replica 0's parameters (at start, after a failed step)."""
        with torch.no_grad():
            torch._foreach_copy_(self.masters, [p.detach() for p in self.params[0]])
        self.versions = list(map(_VERSION, self.params[0]))
        """Replica 0's version counters when the masters last took or gave them."""

    def follow(self, round_replicas: bool = False) -> None:
        """Masters of parameters written by anything but the engine retake replica 0's (and, with
        ``round_replicas`` and a bf16 wire, the replicas take their rounding)."""
        now = list(map(_VERSION, self.params[0]))
        if now == self.versions:
            return
        moved = [pid for pid, (a, b) in enumerate(zip(now, self.versions)) if a != b]
        with torch.no_grad():
            torch._foreach_copy_([self.masters[pid] for pid in moved], [self.params[0][pid].detach() for pid in moved])
        if round_replicas and self.wire is not None:
            self.wire.round_replicas(moved)  # through .data: no version counter moves
        self.versions = now

    def take_grads(self, row: torch.Tensor | None, offsets: Sequence[int], flat: torch.Tensor,
                   pids: Sequence[int] | None = None) -> None:
        """The masters' gradients (``pids``, or all), for either face: views of the host's sum ``row`` when every
        replica holds it, else of replica 0's ``flat`` gradient copied to the host whole (one copy, one wait: not one
        per tensor); None where replica 0's ``.grad`` is."""
        grads = [grad_of(self.params[0][k]) for k in pids] if pids is not None else list(map(grad_of, self.params[0]))
        if row is None:
            if self.staged is None or self.staged.shape != flat.shape:  # pinned on CUDA, as the masters
                self.staged = self.devs[0].host_empty(flat.shape, flat.dtype)
            with torch.no_grad():
                row = self.staged.copy_(flat)  # note: host waits for replica 0's gradient (D2H, one copy)
        self.grads_from_row(row, offsets, [k for k, g in zip(pids or itertools.count(), grads) if g is None]
                            if any(map(is_none, grads)) else ())

    def grads_from_row(self, row: torch.Tensor, offsets: Sequence[int], none: Sequence[int]) -> None:
        key = (row.data_ptr(), tuple(offsets), tuple(none))
        # views still in place (an optimizer's zero_grad() drops them): no slicing per parameter
        if key == self._attached and not any(map(is_none, map(grad_of, self._viewed))):
            return
        skip = set(none)
        for pid, m in enumerate(self.masters):
            m.grad = None if pid in skip else row[offsets[pid]:offsets[pid] + m.numel()].view(m.shape)
        self._viewed = [m for m in self.masters if m.grad is not None]
        self._attached = key

    def to_devices(self, threads: DeviceThreads, pids: Sequence[int] | None = None) -> list[Stamps]:
        """Every replica's parameters ← the masters (``pids``, or all), on each device's thread."""
        if self.wire is not None and pids is None:  # bf16 over the bus
            stamps = self.wire.to_devices(threads)
            self.versions = list(map(_VERSION, self.params[0]))
            return stamps
        if pids is None:
            masters, params = self.masters, self.params
        else:  # cached for the same ``pids`` object
            if self._selected[0] is not pids:
                self._selected = (pids, [self.masters[k] for k in pids], [[ps[k] for k in pids] for ps in self.params])
            _, masters, params = self._selected

        def copy(j: int) -> Stamps:
            dev = self.devs[j]
            t0 = dev.stamp()
            with torch.no_grad():
                # asynchronous on a GPU: the host writes the masters again only after the next backward (same stream)
                torch._foreach_copy_(params[j], masters, non_blocking=dev.is_cuda)
            return t0, dev.stamp()
        stamps = threads.run_all(copy, computing=True)
        self.versions = list(map(_VERSION, self.params[0]))
        return stamps


_VERSION = operator.attrgetter("_version")
grad_of = operator.attrgetter("grad")
is_none = functools.partial(operator.is_, None)


def after_forward(replicas_follow: Callable[[int], None], update: Update) -> Callable[[int], None]:
    """After each forward the replicas follow replica 0's writes, then the masters do (the host step must start from
    what a forward wrote in place, not overwrite it)."""
    masters = update.masters
    if masters is None:
        return replicas_follow

    def hook(used: int) -> None:
        replicas_follow(used)
        masters.follow()
    return hook


PER_PARAMETER = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
                 torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD)
"""Optimizers whose update reads one parameter, its gradient and state: chunk by chunk is bitwise stepping once
(exactly these classes: a subclass's ``step`` may read every gradient)."""


class HostUpdate(Update):
    """``Trainer(update="host")``: one optimizer over the masters on the host.

    With the sum row read in place, a :data:`PER_PARAMETER` optimizer and no clipping, each chunk is stepped as soon as
    its sum is final, on the host update thread, while devices compute the layers below (``overlap == "with backward"``;
    the optimizer is lent the chunk's masters for one ``step()``); otherwise after backward. A NaN/Inf chunk stops the
    step's overlapped updates; the step is rejected, the masters retake the (unchanged) replicas' parameters, and the
    chunks stepped get their optimizer state back, as after any failure: Adam/AdamW's flat moments and SGD's flat
    momentum forget the side the step wrote (:class:`~cgdp.engine.core.host_flat.FlatState`, every chunk), other
    optimizers' state is restored from a copy (:class:`~cgdp.engine.core.host_state.StateSnapshot`; every chunk but
    the last is saved)."""

    streams = True
    sums = True
    early = True

    def __init__(self, devs: Sequence[Device], optimizers: Sequence[torch.optim.Optimizer],
                 params: Sequence[Sequence[nn.Parameter]], factory: Callable[..., torch.optim.Optimizer]):
        super().__init__(devs, optimizers, params)
        self.masters = HostMasters(devs, params)
        opt = factory(iter(self.masters.masters))
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer, got {type(opt).__name__}")
        prefer_fused(opt)
        self.optimizer = opt
        self.overlap = "after backward"  # or "with backward" (chunk by chunk)
        self._stream: GradientStream | None = None
        self._layout: Any = None
        self._open = False  # an overlapped step began and was not finished (masters maybe ahead)
        self._with_backward = self._hooked = False  # this step's
        self._states = StateSnapshot()  # of the chunks stepped with backward, for a failure
        self._flat: FlatState | None = None  # Adam/AdamW's moments, SGD's momentum in two sides: no copy to undo
        self._fast = False  # this step's chunks go to ``_flat``
        self._seconds = 0.0
        self._rounded: torch.Tensor | None = None  # a bf16 sum row, widened into ``masters.wide``

    def attach(self, stream: GradientStream, grads: Any, clipping: bool, guard: Guard, resources: Resources,
               module: nn.Module | None = None) -> None:
        """Once the stream exists: read the host's sum row in place if possible (then no gradient goes back, only
        parameters), overlap if allowed. With a bf16 wire replica 0's ``state_dict()`` holds the masters."""
        self._stream, self._guard = stream, guard
        m = self.masters
        if stream.stages and stream.transfer == torch.bfloat16 and stream.stages[0].numel() >= m.flat.numel():
            m.wire = Bf16Wire(m, stream.stages)
            m.wire.round_replicas(range(len(m.masters)))  # from the first forward on, the replicas hold their rounding
            resources.push(m.wire.close)
            if module is not None:
                resources.push(masters_in_state_dict(module, m))
        host = stream.host
        if host is None or (host.sum_row() is None and host.rounded_row() is None):
            return
        self._rounded = host.rounded_row()  # a bf16 row widened chunk by chunk; else the float32 sum read in place
        host.send_back = False
        if not clipping and type(self.optimizer) in PER_PARAMETER:
            self.overlap = "with backward"
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._updated = Progress()
            # its own thread (no device, no CUDA call): the accumulator sums the next chunks meanwhile
            thread = threading.Thread(target=_update_loop, args=(self._queue, weak_call(self._update_chunk),
                                                                 guard.fail), name="cgdp-host-update", daemon=True)
            thread.start()
            weakref.finalize(self, self._queue.put, None)
            resources.push(functools.partial(thread.join, 30.0))
            resources.push(functools.partial(self._queue.put, None))  # the stack runs backwards: stopped, then joined
            host.on_summed = weak_call(self._summed)
            flat = next((k for k in (FlatAdam, FlatSGD) if k.usable(self.optimizer)), None)
            if flat is not None:
                self._flat = flat(self.optimizer, m.masters, m.offsets, m.flat)
                m.unshown_bytes = self._flat.unshown_bytes  # the state's other side (the optimizer shows one)

    def shown(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]  # the replicas' are never stepped

    def begin_step(self, hooked: bool = False) -> None:
        """Before the first forward (caller's thread). With gradient hooks (``hooked``, refused after backward) nothing
        is stepped with backward, so the refusal leaves the optimizer untouched."""
        m = self.masters
        if not self.settle():
            raise RuntimeError("the host update thread did not finish a failed step's chunk updates within timeout_s "
                               "(a step hook that never returns?), so the host optimizer's state may be ahead of the "
                               "parameters")
        m.follow(round_replicas=True)
        self._seconds, self.undone = 0.0, False
        # step hooks would run per chunk on part of the parameters: with any, update once after backward
        self._hooked = has_step_hooks(self.optimizer)
        self._with_backward = self.overlap == "with backward" and not self._hooked and not hooked
        if not self._with_backward:
            return
        lay = self._stream.layout
        if lay is not self._layout:  # a plan switch: the chunks' parameters and the row's views
            self._layout = lay
            self._chunk_pids = [[pid for pid, k in enumerate(lay.param_chunk) if k == c] for c in range(len(lay.plan))]
            where = {id(p): k for k, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
            self._group = [where.get(id(p)) for p in m.masters]
        m.grads_from_row(self._sum_row(), lay.offsets, ())  # again if zero_grad() dropped them
        self._chunks = sum(1 for r in lay.chunk_segments if r)  # a layer without parameters of its own has no update
        self._stepped: list[int] = []
        self._states.clear()
        self._fast = self._flat is not None and self._flat.usable(self.optimizer)
        if self._fast:
            self._flat.discard()
            self._flat.sync()
        if m.wire is not None:
            m.wire.forget()
        self._unsaved: int | None = None
        self._poisoned: int | None = None
        self._updated.reset()
        self._open = True

    def settle(self) -> bool:
        """A failed overlapped step: its updates finished and undone (masters and optimizer state as before it), so
        that a checkpoint saved right after the error holds the step before. False: the host update thread did not
        finish them within ``timeout_s`` (the step is left open)."""
        if not self._open:  # only an overlapped step opens
            return True
        done = threading.Event()
        self._queue.put(done.set)
        try:
            self._guard.wait(done, "the host update thread to finish a failed step's updates")
        except StepAborted:  # the failed step's own error, already raised to the caller
            if not done.wait(self._guard.timeout_s):  # note: host waits for the host update thread
                return False
        self._undo()
        self._open = False
        return True

    def _sum_row(self, widen: slice | None = None) -> torch.Tensor:
        """The float32 row the masters' gradients view (a bf16 row's part ``widen`` widened into it now)."""
        if self._rounded is None:
            return self._stream.host.sum_row()
        m = self.masters
        if m.wide is None:  # allocated once (the row is the stream's for good)
            m.wide = torch.empty(self._rounded.shape, dtype=torch.float32)
        if widen is not None:
            m.wide[widen].copy_(self._rounded[widen])
        return m.wide

    def _summed(self, c: int) -> None:
        if self._with_backward:
            self._queue.put(c)

    def _update_chunk(self, c: int) -> None:
        """The host update thread (chunks arrive in the order summed)."""
        lay, st = self._layout, self._stream
        try:
            if self._poisoned is not None:
                return
            host = st.host
            if host.comm is None:
                bad = any(host.bad[t] for t in lay.chunk_segments[c])
            else:  # another rank's NaN arrives through the allreduce: look at the global sum
                lo, hi = lay.chunk_bounds[c]
                bad = not bool(torch.isfinite(
                    (host.sum_row() if self._rounded is None else self._rounded)[lo:hi]).all())
            if bad:
                self._poisoned = c
                return
            if self._rounded is not None:
                self._sum_row(slice(*lay.chunk_bounds[c]))
            t0 = time.perf_counter()
            lent, pids = [[] for _ in self.optimizer.param_groups], []
            masters = self.masters.masters
            for pid in self._chunk_pids[c]:
                k = self._group[pid]
                if k is not None and any(t[pid] for t in st.marks.touched):  # untouched: skipped, as on one device
                    lent[k].append(masters[pid])
                    pids.append(pid)
            if self.masters.wire is not None:  # the replicas hold the masters' rounding: keep the masters
                self.masters.wire.keep(self._chunk_pids[c])
            self._step_lent(c, lent, pids)
            self._stepped.append(c)
            self._seconds += time.perf_counter() - t0
        finally:
            self._updated.advance()

    def _step_lent(self, c: int, lent: list[list[nn.Parameter]], pids: list[int]) -> None:
        """Chunk ``c``'s masters ``lent`` (per group) stepped: out of place into the other side of the flat moments, or
        by the optimizer itself, lent only them, its state saved first unless the chunk is the step's last."""
        if self._fast:
            self._flat.step(pids, [self._group[k] for k in pids], self._sum_row(), self._layout.offsets)
            return
        groups = self.optimizer.param_groups
        if len(self._stepped) < self._chunks - 1:  # a later failure may undo this step: keep its state
            self._states.save(self.optimizer.state, [p for ps in lent for p in ps])
        else:  # the last chunk: every gradient is summed, nothing of this step is left to fail
            self._unsaved = c
        own = [g["params"] for g in groups]
        try:
            for g, ps in zip(groups, lent):
                g["params"] = ps
            self.optimizer.step()
        finally:
            for g, ps in zip(groups, own):
                g["params"] = ps

    def _undo(self) -> None:
        """A failed or rejected overlapped step: masters and stepped chunks' optimizer state as before."""
        m = self.masters  # with a bf16 wire from the masters' own copy (the replicas' are rounded)
        m.wire.put_back() if m.wire is not None else m.refresh()
        self._states.restore(self.optimizer.state)
        if self._flat is not None:
            self._flat.discard()
        if self._unsaved is not None:
            warnings.warn(f"the step failed after the host optimizer stepped its last chunk ({self._unsaved}) "
                          f"while backward ran: that chunk's optimizer state advanced by one step",
                          RuntimeWarning, stacklevel=3)
            self._unsaved = None

    def hook_views(self, views: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        raise NotImplementedError("update='host' steps on the host's gradient, so gradient hooks registered on "
                                  "the parameters (register_hook) do not run there: remove them, or use "
                                  "update='devices'")

    def reduce(self, stream: GradientStream) -> float:
        bad = stream.bad_count()
        if self._open:  # overlapped (nothing else opens a step)
            # note: host waits for the host update thread to step every chunk
            try:
                self._updated.wait(self._chunks, self._guard, "the host's update of every chunk")
            except StepAborted:
                if self._guard.error is None:
                    raise
                raise self._guard.error from None  # the error itself (a step hook's), not the abort it caused
        if self._open and self._poisoned is not None:
            self._open = False
            self._undo()  # no replica was changed: parameters and optimizer state as before the step
            return max(bad, 1.0)
        return bad

    def step(self, coef: torch.Tensor | None, stream: GradientStream,
             threads: DeviceThreads) -> list[Stamps | None]:
        m = self.masters
        overlapped = self._with_backward
        if not overlapped:
            t0 = time.perf_counter()
            host = stream.host
            # else replica 0 holds the averaged gradient (a bf16 wire, a ring of host slots)
            m.take_grads(self._sum_row(slice(None)) if host is not None and not host.send_back else None,
                         stream.layout.offsets, stream.flats[0])
            if coef is not None:
                grads = [g.grad for g in m.masters if g.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, coef.to(torch.float32).cpu())
            self.undone = True  # until it returns: a failure changed nothing (the Trainer stays usable)
            step_or_undo(self.optimizer, self._states, m)
            self.undone = False
            self._seconds = time.perf_counter() - t0
        elif self._fast:
            self._flat.commit()
            self.optimizer._opt_called = True  # what an LR scheduler looks for (torch's step, not run, sets it)
        self._open = False
        self.figures = {"host_update_s": self._seconds, "host_update_overlapped": float(overlapped),
                        "host_update_step_hooks": float(self._hooked)}
        stamps = m.to_devices(threads)
        self.figures["host_update_bytes_back"] = float(m.wire.sent_bytes if m.wire is not None else m.flat.nbytes)
        return stamps


def _update_loop(q: queue.SimpleQueue, update: Callable[[int], None], fail: Callable[[BaseException], None]) -> None:
    """Chunk numbers in (or a callable), until None."""
    for c in iter(q.get, None):
        try:
            c() if callable(c) else update(c)
        except BaseException as exc:
            fail(exc)
