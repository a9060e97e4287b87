"""The dense part of a ``DataParallel``'s gradients: the flat buffers that stream through the host.

A part of :class:`cgdp.engine.core.gradients.Gradients` (invariant and states there). After a synced backward every
replica holds the total T (bitwise); the next (:meth:`prepare`) keeps replica 0's and zeroes the others'.
``has_grad``: a gradient since ``zero_grad``. ``versions``: counters at cgdp's last change; replica 0's moving, or
its ``.grad`` no longer its view, is a user edit, which :meth:`follow_edits` copies everywhere before use.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Sequence

import numpy as np
import torch

from cgdp.comm import Comm
from cgdp.engine.backend import host_threads, make_rng
from cgdp.engine.core.drain import quiesce
from cgdp.engine.core.hooks import StepMarks
from cgdp.engine.core.lifetime import Lifetime
from cgdp.engine.core.param_hooks import ParamHooks
from cgdp.engine.core.stream import GradientStream
from cgdp.engine.core.threads import DeviceThreads
from cgdp.engine.sync import Guard
from cgdp.engine.core.gradients import GradPart, Gradients, UserFault
from cgdp.engine.core.user_warning import warn_user


def build_gradients(life: Lifetime, devs: list, params: list, layer_pids: list, dtype: torch.dtype | None,
                    plan: list | None, *, guard: Guard, comm: Comm | None, param_hooks: ParamHooks,
                    initial: Sequence[torch.Tensor | None], keep_grads: bool, sparse: GradPart | None = None,
                    **stream_options: Any) -> tuple[DeviceThreads, Any, GradientStream | None, Gradients]:
    """Either face's device side: the device threads, the random streams, and with a ``plan`` the streaming path
    (the marks, the stream laid out for it, the dense part over them); the gradients' one owner over it and
    ``sparse``. ``life`` closes the threads and the stream (``keep_grads``: as :meth:`GradientStream.close`)."""
    res = life.resources
    threads = life.threads = DeviceThreads(devs, guard)
    res.push(threads.close)
    rng = make_rng(devs)  # one random stream per replica, derived from torch's seed (reproducible)
    if plan is None:  # nothing to stream
        return threads, rng, None, Gradients(GradPart(), sparse, [d.torch_device for d in devs])
    stream = GradientStream(devs, params, layer_pids, dtype, StepMarks(len(devs), len(params[0])), guard=guard,
                            comm=comm, host_threads=host_threads(devs), **stream_options)
    res.drain = functools.partial(quiesce, devs, stream.host, 30.0)  # the host's copies too
    res.push(functools.partial(stream.close, keep_grads))
    stream.set_plan(plan)
    dense = DenseGrads(stream, initial, param_hooks, comm, guard.timeout_s)
    return threads, rng, stream, Gradients(dense, sparse, [d.torch_device for d in devs])


class DenseGrads(GradPart):
    def __init__(self, stream: GradientStream, initial: Sequence[torch.Tensor | None], param_hooks: ParamHooks,
                 comm: Comm | None, timeout_s: float | None):
        self.stream = stream
        self.marks = stream.marks  # the owner's: the stream's hooks write them, the owner resets them
        self.param_hooks = param_hooks
        self._comm, self._timeout_s = comm, timeout_s
        self.has_grad = np.zeros(len(initial), bool)
        self._warned = self._warned_data = False
        self._aside: dict[int, torch.Tensor] = {}  # gradients set aside while hooks run on a sum
        self._window_bits: torch.Tensor | None = None  # replica 0's bits after a backward inside no_sync()
        self._window_sums: list[tuple[torch.Tensor, torch.Tensor]] = []  # (after it, before the next)
        self._mirror(initial)

    def begin(self, sync: bool, whole: bool) -> None:
        """Gather's backward: the user's gradient hooks off (they run on the sum), buffers prepared, hooks armed."""
        hooks = self.param_hooks
        if hooks.take() and not (sync and whole):
            hooks.put_back()
            raise RuntimeError("a parameter of the model has a gradient hook (register_hook), which cgdp "
                               "runs on each backward's summed gradient; inside model.no_sync() that sum "
                               "is never formed. Accumulate outside no_sync(), or remove the hook")
        self.prepare(whole)
        # the host sums this backward's alone; a gradient that came early (its hooks ran in autograd, on this rank's
        # part, as DDP's) is set aside too, and with ranks averaged over them (:meth:`_average_aside`)
        views0 = self.stream.views[0]
        with torch.no_grad():
            for pid in hooks.taken:
                if self.has_grad[pid]:
                    self._aside[pid] = views0[pid].clone()
                    views0[pid].zero_()
        self.marks.reset()  # the early hooks' marks too: their gradients are in ``has_grad``, their hooks ran
        self.stream.arm(sending=sync)

    def end(self, sync: bool) -> bool:
        """Final callback: with ``sync``, flush and wait for every sum; then the user's hooks. Whether hooks ran."""
        st = self.stream
        if sync:
            st.flush_all()
            for j in range(len(st.devs)):
                st.wait_returned(j)  # note: host waits until every summed chunk is back
        touched = self.marks.counts()  # since armed: early gradients' hooks already ran
        if sync and self._comm is not None:
            self._comm.fence(self._timeout_s)
            # a parameter with a gradient on any rank has one on every rank
            touched, ever = np.split(self._comm.allreduce_small(np.concatenate([touched, self.has_grad])), 2)
            self.has_grad |= ever > 0
        if sync and self._window_sums:  # replica 0 must not change inside no_sync(): a part's edit is not the sum's
            pairs, self._window_sums = self._window_sums, []
            if bool(torch.stack([a != b for a, b in pairs]).any()):
                raise UserFault(RuntimeError(_EDITED_IN_NO_SYNC))
        hooked = bool(self.param_hooks.taken)
        if hooked:  # the user's gradient hooks, on the sum (the host's norm is of the sum before them)
            if sync and self._comm is not None:
                self._average_aside()
            aside, self._aside = self._aside, {}
            try:  # each hooked gradient: the one set aside plus what its hooks make of the sum, everywhere
                self.param_hooks.run(touched, st.views, aside)
            except Exception as exc:  # the user's error, after every copy is back: nothing in flight
                raise UserFault(exc) from exc
        self.has_grad |= touched > 0
        self.set_none()
        self.record()
        self._window_bits = None if sync else _bit_sum(st.flats[0])  # on the device, not waited for
        return hooked

    def after(self) -> None:
        self.stream.disarm()
        self.param_hooks.put_back()

    def prepare(self, whole: bool) -> None:
        """Replica 0's ``.grad`` taken into the flat buffers."""
        st = self.stream
        views0 = st.views[0]
        grads = [p.grad for p in st.params[0]]
        # hooks already ran: parameters reached outside the gathered output (only in the loss), not a user edit
        early = self.marks.counts() > 0
        self.has_grad |= early
        edited = st.flats[0]._version != self.versions[0]
        bits, self._window_bits = self._window_bits, None
        if not whole and any(g is not None and g is not v and not e for g, v, e in zip(grads, views0, early)):
            raise RuntimeError(_EDITED_IN_NO_SYNC)  # p.grad = p.grad * 0.5 inside the window
        if bits is not None and not edited and any(g is not None for g in grads):
            self._window_sums.append((bits, _bit_sum(st.flats[0])))
        with torch.no_grad():
            if all(g is None for g in grads):  # zero_grad(): a new accumulation from zero
                for flat in st.flats:
                    flat.zero_()
                self.has_grad[:] = False
                self._window_sums = []
            else:
                if not whole:  # early gradients that replaced a None .grad: zero_grad
                    for pid in np.flatnonzero(early & (np.frombuffer(self.marks.replaced[0], np.uint8) > 0)):
                        for views in st.views[1:]:
                            views[pid].zero_()
                if edited and not whole and not early.any():
                    # inside no_sync the others hold their own parts: only zeroing replica 0 has a meaning for them
                    if bool(st.flats[0].any()):  # note: a CPU-GPU sync point, on this rare path only
                        raise RuntimeError(_EDITED_IN_NO_SYNC)
                    self._window_sums = []
                    for flat in st.flats[1:]:
                        flat.zero_()
                for pid, g in enumerate(grads):
                    if g is None:
                        for views in st.views:
                            views[pid].zero_()
                        self.has_grad[pid] = False
                    elif g is not views0[pid]:
                        views0[pid].copy_(g)
                        self.has_grad[pid] = True
                if whole:  # they hold the total, which replica 0 keeps
                    for flat in st.flats[1:]:
                        flat.zero_()
        self._attach()

    def _average_aside(self) -> None:
        """With ranks: what was set aside, averaged over them (an early part is the rank's own; an earlier backward's
        sum is the same on every rank, and its float64 mean is itself). Sent: the rank count, a flag per hooked
        parameter and its values (zeros where none), the same length on every rank."""
        views0, pids = self.stream.views[0], sorted(self.param_hooks.taken)
        ends = np.cumsum([1 + len(pids)] + [views0[pid].numel() for pid in pids])
        vec = np.zeros(ends[-1])
        vec[0] = 1.0
        for k, pid in enumerate(pids):
            if pid in self._aside:
                vec[1 + k] = 1.0
                vec[ends[k]:ends[k + 1]] = self._aside[pid].detach().double().cpu().numpy().ravel()
        out = self._comm.allreduce_small(vec)
        for k, pid in enumerate(pids):
            if out[1 + k] > 0:  # some rank set one aside
                mean = torch.from_numpy(out[ends[k]:ends[k + 1]] / out[0])
                self._aside[pid] = mean.view_as(views0[pid]).to(views0[pid])

    def undo(self, whole: bool) -> bool:
        """A backward failed: restore what was set aside and, if no gradient arrived, the buffers; whether it could."""
        st = self.stream
        with torch.no_grad():
            for pid, g in self._aside.items():
                st.views[0][pid].add_(g)
            self._aside = {}
            if self.marks.counts().any():
                return False
            if whole:
                for flat in st.flats[1:]:
                    flat.copy_(st.flats[0])
        self.set_none()
        self.record()
        return True

    def drop(self) -> None:
        self._window_bits, self._window_sums = None, []
        with torch.no_grad():
            for flat in self.stream.flats:
                flat.zero_()
        self.has_grad[:] = False
        self.set_none()
        self.record()

    def norm(self, norm_type: float) -> torch.Tensor:
        """Replica 0's (every replica holds the total), on its device, as one device computes it."""
        return torch.linalg.vector_norm(self.stream.flats[0], norm_type, dtype=torch.float64)

    def scale(self, coef: torch.Tensor) -> None:
        self.stream.scale_grads(coef)
        self.record()

    def relaid(self) -> None:
        self.stream.disarm()
        self.set_none()
        self.record()

    def follow_edits(self, whole: bool, data: bool = True) -> bool:
        st = self.stream
        grads = [p.grad for p in st.params[0]]
        changed = st.flats[0]._version != self.versions[0] or not self.attached(grads)
        through_data = (data and not changed and whole and len(st.flats) > 1
                        and not same_bits(st.flats[0], st.flats[1]))
        if not (changed or through_data):
            return False
        if through_data and not self._warned_data:
            self._warned_data = True
            warn_user("replica 0's gradients were changed through .data after backward (e.g. "
                      "p.grad.data.clamp_(-1, 1)), which moves no version counter: cgdp.DataParallel "
                      "found it by comparing them with another replica's and copies them to every "
                      "replica. Make such edits under torch.no_grad() without .data "
                      "(p.grad.clamp_(-1, 1)), or use torch.nn.utils.clip_grad_value_")
        elif changed and not self._warned:
            self._warned = True
            warn_user("replica 0's gradients were changed after backward (for example by "
                      "torch.nn.utils.clip_grad_norm_(model.parameters(), ...)); cgdp.DataParallel "
                      "copies them to every replica, which moves the whole gradient between devices. "
                      "Use model.clip_grad_norm_(max_norm) to clip without that copy")
        self._mirror(grads)
        return True

    def _mirror(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Replica 0's ``grads`` into its views and copied to every replica; ``.grad`` and the record cgdp's."""
        st = self.stream
        views0 = st.views[0]
        with torch.no_grad():
            for pid, g in enumerate(grads):
                if g is None:
                    views0[pid].zero_()
                elif g is not views0[pid]:
                    views0[pid].copy_(g)
                self.has_grad[pid] = g is not None
            for flat in st.flats[1:]:
                flat.copy_(st.flats[0])
        self._attach()
        self.set_none()
        self.record()

    def attached(self, grads: list[torch.Tensor | None] | None = None) -> bool:
        """Whether replica 0's ``.grad`` are still what the record left: views with a gradient, None elsewhere."""
        grads = [p.grad for p in self.stream.params[0]] if grads is None else grads
        return all(map(operator.is_, grads, self._left))  # in C: no bytecode per parameter

    def set_none(self) -> None:
        """Replica 0's ``.grad`` as cgdp leaves them (``_left``): its view where it has a gradient, else None."""
        self.none_pids = np.flatnonzero(~self.has_grad).tolist()
        self._left = list(self.stream.views[0])
        for pid in self.none_pids:
            self._left[pid] = None
            for params in self.stream.params:
                params[pid].grad = None

    def fresh(self, timing: bool, sink: Any) -> None:
        """A ``Trainer`` step starts from zero (its one reset point): views back, buffers zeroed, stream armed."""
        st = self.stream
        if self.none_pids:
            for params, views in zip(st.params, st.views):
                for pid in self.none_pids:
                    params[pid].grad = views[pid]
            self.none_pids = []
        if st.streaming and st.large:
            for params, stolen, small in zip(st.params, self.marks.stolen, st.small_views):
                # large gradients arrive whole (autograd hands them into .grad = None); small ones add into zeros
                if small:
                    torch._foreach_zero_(small)
                for pid in st.large:
                    params[pid].grad = None
                stolen[:] = st.large_mask
        else:
            for flat in st.flats:
                flat.zero_()
        self.marks.reset()
        st.arm(timing, sink)

    def settle(self, touched: np.ndarray) -> None:
        self.has_grad = touched > 0
        if not self.has_grad.all():
            self.set_none()
        else:
            self._left = self.stream.views[0]

    def record(self) -> None:
        """The buffers as they are now are cgdp's doing."""
        self.versions = [f._version for f in self.stream.flats]
        self.marks.reset()  # from here on, a hook that runs is a new backward's

    def _attach(self) -> None:
        for params, views in zip(self.stream.params, self.stream.views):
            for p, view in zip(params, views):
                if p.grad is not view:
                    p.grad = view


_EDITED_IN_NO_SYNC = (
    "replica 0's gradients were changed between backwards inside model.no_sync() (p.grad.data.mul_(...), "
    "p.grad = ..., an in-place edit), where every replica holds its own part of the sum: cgdp cannot make "
    "that edit of the whole gradient, so this backward's gradients were dropped. Edit the gradients after the "
    "backward outside no_sync() (they then hold the sum); inside the window only zero_grad() is supported")


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bits, not values: NaN equals NaN


def _bit_sum(flat: torch.Tensor) -> torch.Tensor:
    """The integer sum of a flat buffer's bits, on its device (an edit changes it but for chance collisions)."""
    return flat.view(_BITS[flat.element_size()]).sum(dtype=torch.int64)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two flat buffers hold the same bits: directly on one device, else by integer sums of the bits."""
    if a.device == b.device:
        bits = _BITS[a.element_size()]
        return torch.equal(a.view(bits), b.view(bits))
    # compared on a's device: one host read
    return bool(_bit_sum(a) == _bit_sum(b).to(a.device, non_blocking=True))  # note: a CPU-GPU sync point
