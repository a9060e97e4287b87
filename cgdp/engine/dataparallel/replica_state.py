"""What the other replicas of a ``DataParallel`` copy from replica 0, outside the optimizer step.

Replica 0 is the user's module (``model.module``): the user changes it between steps, and the
other replicas must follow before they run again. What they follow (modes, ``requires_grad``,
parameters edited in place, ``load_state_dict``, the module tree; and what a forward changes in
place) is :class:`~cgdp.engine.core.follow.Follow`'s, the same for ``Trainer``.
:class:`ReplicaState` holds it and the replicas' floating buffers (all in the same order on every
replica): :meth:`ReplicaState.after_forward` gives every replica the batch-weighted mean of the
buffers a training forward wrote; :meth:`ReplicaState.broadcast` copies the buffers only (after a
forward that failed on some replicas). Parameters are otherwise never copied: each replica takes
the same optimizer step (:mod:`cgdp.engine.dataparallel.binding`), and
:meth:`ReplicaState.record_parameters` notes their version counters after every step.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cgdp.engine.core.buffers import BufferWatch, sync_buffers
from cgdp.engine.core.follow import Follow
from cgdp.engine.core.replicas import batch_weights


UNBOUND = (" of an optimizer bound to the model", "by an optimizer never bound to it, which steps replica 0 alone: "
           "bind it once, opt = model.bind(opt), so that every replica takes each step itself; or ")


class ReplicaState:
    def __init__(self, replicas: list[nn.Module], devices: list[torch.device]):
        self.replicas = replicas
        self.follow = Follow(replicas, devices, "cgdp.DataParallel", "close() and wrap model.module again",
                             after_load=self._loaded, unbound=UNBOUND)
        self.params = self.follow.params
        """Per replica, all its parameters (trainable or not) in ``parameters()`` order."""
        self.rebuild_buffers()

    @property
    def trainable(self) -> list[bool]:
        return self.follow.trainable

    def rebuild_buffers(self) -> None:
        """List the buffers (again: a hook registration changed them, :mod:`cgdp.engine.core.module_hooks`)."""
        self.buffers_f = [[b for b in r.buffers() if b.is_floating_point() and not b.requires_grad]
                          for r in self.replicas]
        """Per replica, its floating buffers that need no gradient (BatchNorm statistics)."""
        self.buffer_watch = BufferWatch(self.buffers_f)  # which of them a forward wrote

    def before_forward(self) -> None:
        if self.follow.before_step():  # a hook registration changed the buffers (prune)
            self.rebuild_buffers()

    def record_parameters(self) -> None:
        """Replica 0's parameters as they are now are every replica's (version counters)."""
        self.follow.stepped()

    def _loaded(self) -> None:
        self.buffer_watch.synced()  # every replica's buffers are the same again

    def broadcast(self, buffers_only: bool = False) -> None:
        """Every replica ← replica 0's buffers (after a forward that failed on some replicas), or
        its whole state."""
        if not buffers_only:
            self.follow.broadcast()
            return
        first = self.replicas[0]
        with torch.no_grad():
            for r in self.replicas[1:]:
                for b, b0 in zip(r.buffers(), first.buffers()):
                    b.data.copy_(b0)
        self.buffer_watch.synced()

    def after_forward(self, sizes: list[int], comm: Any) -> None:
        """After a training forward of ``len(sizes)`` replicas: the floating buffers it wrote
        (BatchNorm's statistics) take their batch-weighted mean (over all ranks with a comm) on
        every replica. Only those the forward wrote: a weighted mean of equal values is not always
        that value, and constant tables (rotary frequencies) must stay bitwise."""
        bufs_f, g, n = self.buffers_f, len(sizes), len(self.replicas)
        if not bufs_f[0] or (n == 1 and comm is None):
            return
        weights, _ = batch_weights(sizes, comm)
        changed = self.buffer_watch.changed(comm)
        # through .data: the graph just built saved these buffers (BatchNorm), and an in-place
        # write through the tensors would bump their version and fail its backward
        sync_buffers([[b.data for b in bufs] for bufs in bufs_f], weights + [0.0] * (n - g), comm, changed)
        self.buffer_watch.synced(changed, others=False)
        if g < n:  # replicas that got no sample: integer buffers (counters) too
            self.broadcast(buffers_only=True)
