"""The model's side of a bound ``optimizer.step()``: every replica takes the same step.

The bound optimizer (:mod:`~.binding`) asks this, never the user's module. :meth:`ReplicaSteps.begin` takes the
operation lock (given back by :meth:`ReplicaSteps.end` in ``finally``) and makes the gradients the same everywhere;
:meth:`~ReplicaSteps.end` records the parameters and gives the ``chunks="auto"`` tuner one iteration's time.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable

from torch import nn

from cgdp.engine.core.drain import quiesce
from cgdp.engine.core.host_update import HostMasters
from cgdp.engine.core.lifetime import Lifetime
from cgdp.engine.core.plan import tuned_plan
from cgdp.engine.core.threads import DeviceThreads
from cgdp.engine.core.gradients import Gradients
from cgdp.engine.dataparallel.replica_state import ReplicaState


class ReplicaSteps:
    def __init__(self, life: Lifetime, devs: list, threads: DeviceThreads, grads: Gradients, state: ReplicaState,
                 maps: Callable[[], list[dict[int, nn.Parameter]]], stream: Any, comm: Any, tuner: Any,
                 timeout_s: float | None, host_masters: HostMasters | None = None):
        """``maps()``: per replica j > 0, id(replica 0's parameter) -> replica j's; ``tuner``: None once fixed."""
        self.host_masters = host_masters
        self._life, self.devs, self.threads = life, devs, threads
        self.grads, self._state, self.parameter_maps = grads, state, maps
        self.kept = grads.kept  # whether replica 0 stepped on the gradients its mirrors hold
        self._stream, self._comm, self._timeout_s = stream, comm, timeout_s
        self.ranks = 1 if comm is None else comm.size
        self.tuner = tuner
        self._t_step: float | None = None
        self.bindings: weakref.WeakSet = weakref.WeakSet()

    def unusable(self, why: str) -> None:
        self._life.broken = f"{why}; load a checkpoint into model.module and wrap it again"

    def begin(self) -> None:
        ops = self._life.ops
        ops.take("optimizer.step()")
        try:
            self._life.check_usable()
            for d in self.devs:  # the copies back are ordered before the default streams only
                d.check_caller("optimizer.step()")
            self.grads.check_step()
        except BaseException:
            ops.give()
            raise

    def optimizers(self) -> tuple[list[list[Any]], list[Any]]:
        held = [b.optimizers() for b in self.bindings if b.opt() is not None]
        return ([[per[j] for per, _ in held if j < len(per)] for j in range(len(self.devs))],
                [o for _, host in held for o in host])

    def end(self) -> None:
        """After every replica stepped; gives the operation lock back, whatever happens."""
        try:
            self._state.follow.stepped()
            if self.tuner is not None:
                self._tune()
        finally:
            self._life.ops.give()

    def _tune(self) -> None:
        now = time.perf_counter()
        if self._t_step is not None:
            self.tuner.observe(now - self._t_step)
            st = self._stream
            plan, done = tuned_plan(self.tuner, self._comm, len(st.layer_pids))
            if plan != st.plan:  # the flat buffers relaid (contents kept), with nothing in flight
                quiesce(self.devs, st.host, self._timeout_s)
                st.set_plan(plan)
                self.grads.relaid()
            if done:
                self.tuner = None
            now = time.perf_counter()  # the switch is not part of the next iteration
        self._t_step = now
