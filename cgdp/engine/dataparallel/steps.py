"""The model's side of the user's ``optimizer.step()``: every replica takes the same step.

``DataParallel``'s update strategy (per-replica optimizers; ``Trainer``'s are in
:mod:`cgdp.engine.core.update`). :mod:`cgdp.engine.dataparallel.mirror` intercepts the user's
optimizer and asks this object, never the user's module:

* :meth:`ReplicaSteps.begin` before replica 0's step: the model's operation lock (held until
  :meth:`ReplicaSteps.end`, or cleaned up by the model's next operation if torch never calls back
  because the step raised), the gradients checked and made the same on every replica;
* :meth:`ReplicaSteps.submit`: replica j's step on its device thread;
* :meth:`ReplicaSteps.kept` and :meth:`ReplicaSteps.resynced` around a resync;
* :meth:`ReplicaSteps.check_host_step` and :meth:`ReplicaSteps.host_copy_back` (``update="host"``,
  :mod:`cgdp.engine.dataparallel.host_mirror`): the gradients a host step may read, and every
  replica's parameters from the host's masters after it;
* :meth:`ReplicaSteps.end` after every replica stepped: the replicas' parameters recorded, the
  time since the last step given to the chunk-plan tuner (``chunks="auto"``: one iteration of the
  user's loop under the current plan), and the lock given back.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

from torch import nn

from cgdp.engine.core.drain import quiesce
from cgdp.engine.core.host_update import HostMasters
from cgdp.engine.core.lifetime import Lifetime
from cgdp.engine.core.plan import tuned_plan
from cgdp.engine.core.threads import DeviceThreads
from cgdp.engine.core.gradients import Gradients, GradState
from cgdp.engine.dataparallel.host_mirror import HostMirror, lends_to_host
from cgdp.engine.dataparallel.mirror import Mirror
from cgdp.engine.dataparallel.replica_state import ReplicaState


class ReplicaSteps:
    def __init__(self, life: Lifetime, devs: list, threads: DeviceThreads, grads: Gradients, state: ReplicaState,
                 maps: Callable[[], list[dict[int, nn.Parameter]]], stream: Any, comm: Any, tuner: Any,
                 timeout_s: float | None, host_masters: HostMasters | None = None):
        """``maps()``: per replica j > 0, id(replica 0's parameter) -> replica j's; ``tuner``: the
        chunk-plan tuner while it times plans (None: the plan is fixed); ``host_masters``: the
        float32 masters of ``update="host"`` (None: every replica steps its own optimizer)."""
        self.host_masters = host_masters
        self._life, self._devs, self._threads = life, devs, threads
        self._grads, self._state, self._maps = grads, state, maps
        self._stream, self._comm, self._timeout_s = stream, comm, timeout_s
        self.tuner = tuner
        self._t_step: float | None = None
        self.mirrors: weakref.WeakSet = weakref.WeakSet()
        """The :class:`~cgdp.engine.dataparallel.mirror.Mirror` of each optimizer that stepped the model."""

    @property
    def closed(self) -> bool:
        return self._life.closed

    def parameter_maps(self) -> list[dict[int, nn.Parameter]]:
        return self._maps()

    def submit(self, j: int, fn: Callable[[], Any]) -> Future:
        return self._threads.submit(j, fn)

    def begin(self, cleanup: Callable[[], None]) -> None:
        """Before the optimizer steps: the operation lock, held until :meth:`end` (``cleanup`` if
        that never comes)."""
        ops = self._life.ops
        ops.take("optimizer.step()", cleanup=cleanup)
        try:
            self._life.check_usable()
            for d in self._devs:  # the copies back are ordered before the default streams only
                d.check_caller("optimizer.step()")
            self._grads.check_step()
        except BaseException:
            ops.give()
            raise

    def make_mirror(self, opt: Any) -> Any:
        """What steps the replicas for the user's optimizer ``opt``: a mirror optimizer per replica,
        or (``update="host"``) the host's masters lent to ``opt``."""
        if self.host_masters is None or not lends_to_host(opt, self.host_masters):
            return Mirror(opt, self)  # (update="host": an optimizer of sparse parameters only)
        return HostMirror(opt, self)

    def optimizers(self) -> tuple[list[list[Any]], list[Any]]:
        """Per replica, the optimizers that step it on its device; and those that step on the host."""
        mirrors = list(self.mirrors)
        if self.host_masters is not None:
            on_host = [m.opt for m in mirrors if isinstance(m, HostMirror)]
            mirrors = [m for m in mirrors if not isinstance(m, HostMirror)]
            return ([[m.opt for m in mirrors]]
                    + [[m.mirrors[j - 1] for m in mirrors if m.mirrors] for j in range(1, len(self._devs))], on_host)
        return ([[m.opt for m in mirrors]]
                + [[m.mirrors[j - 1] for m in mirrors if m.mirrors] for j in range(1, len(self._devs))], [])

    def check_host_step(self) -> None:
        """A host step reads replica 0's gradient as the total: refused on the parts of ``no_sync()``."""
        if not self._grads.summed:
            raise RuntimeError("update='host' steps on the summed gradient, and this one is still in parts "
                               "(backwards inside model.no_sync()): run the last backward of the step outside "
                               "no_sync() before optimizer.step()")

    def host_sum(self) -> tuple[Any, list[int]] | None:
        """The host's sum row and the flat layout's offsets, when every replica holds that sum as
        is (``SUMMED``: nothing edited since) and it is the total (one machine): the host step reads
        it in place instead of copying replica 0's gradients back to the host."""
        st = self._stream
        if self._grads.state is not GradState.SUMMED or self._comm is not None or st is None or st.host is None:
            return None
        row = st.host.sum_row()
        return None if row is None else (row, st.layout.offsets)

    def host_copy_back(self, pids: list[int]) -> None:
        """Every replica's parameters ``pids`` ← their masters (after the host step)."""
        self.host_masters.to_devices(self._threads, pids)

    def resynced(self) -> None:
        self._state.record_parameters()  # every replica took replica 0's parameters (a step failed)

    def kept(self) -> bool:
        """After the optimizer stepped every replica: whether replica 0's gradients were left as
        its mirrors had them (if not, the mirrors resync and this warns)."""
        return self._grads.kept()

    def end(self) -> None:
        """After the user's optimizer stepped every replica; gives the operation lock back,
        whatever happens."""
        try:
            self._state.record_parameters()
            if self.tuner is not None:
                self._tune()
        finally:
            self._life.ops.give()

    def _tune(self) -> None:
        """The time since the last step is one iteration under the current plan; switch to the
        tuner's next plan."""
        now = time.perf_counter()
        if self._t_step is not None:
            self.tuner.observe(now - self._t_step)
            st = self._stream
            plan, done = tuned_plan(self.tuner, self._comm, len(st.layer_pids))
            if plan != st.plan:  # the flat buffers relaid (contents kept), with nothing in flight
                quiesce(self._devs, st.host, self._timeout_s)
                st.set_plan(plan)
                self._grads.relaid()
            if done:
                self.tuner = None
            now = time.perf_counter()  # the switch is not part of the next iteration
        self._t_step = now
