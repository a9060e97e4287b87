"""What the other replicas of a ``DataParallel`` copy from replica 0, outside the optimizer step.

The others follow the user's changes to replica 0 before they run again (:class:`~cgdp.engine.core.follow.Follow`,
shared with ``Trainer``). The floating buffers (same order everywhere) take a batch-weighted mean after a training
forward, or replica 0's after a failed one. Parameters are never copied: each replica takes the same step.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cgdp.engine.core.buffers import BufferWatch, copy_from_first, sync_buffers
from cgdp.engine.core.follow import Follow
from cgdp.engine.core.replicas import batch_weights, split_buffers


UNBOUND = (" of an optimizer bound to the model", "by an optimizer never bound to it, which steps replica 0 alone: "
           "bind it once, opt = model.bind(opt), so that every replica takes each step itself; or ")


class ReplicaState:
    def __init__(self, replicas: list[nn.Module], devices: list[torch.device]):
        self.replicas = replicas
        self.follow = Follow(replicas, devices, "cgdp.DataParallel", "close() and wrap model.module again",
                             after_load=lambda: self.buffer_watch.synced(), unbound=UNBOUND)  # buffers equal again
        self.params = self.follow.params  # per replica, all of them in parameters() order
        self.rebuild_buffers()

    def rebuild_buffers(self) -> None:
        """List the buffers (again: a hook registration changed them, :mod:`cgdp.engine.core.module_hooks`)."""
        self.buffers_f = [[b for b in r.buffers() if b.is_floating_point() and not b.requires_grad]
                          for r in self.replicas]
        # which of them a forward wrote; the others (counters) kept too: a forward done again restores them
        self.buffer_watch = BufferWatch(self.buffers_f, split_buffers(self.replicas)[1])

    def broadcast_buffers(self) -> None:
        copy_from_first([[b.data for b in r.buffers()] for r in self.replicas])
        self.buffer_watch.synced()
        self.follow.buffers_synced()

    def after_forward(self, sizes: list[int], comm: Any, rerun: bool) -> None:
        """Buffers a training forward wrote take their batch-weighted mean (only those: constants stay bitwise);
        ``rerun``: a forward may still be done again (:meth:`EmulatedRNG.forward_all`), so the counters' baseline moves
        too."""
        bufs_f, g, n, watch = self.buffers_f, len(sizes), len(self.replicas), self.buffer_watch
        self.follow.buffers_synced()  # what the forward wrote is not the user's change (made equal below)
        if not (bufs_f[0] or watch.others[0]):
            return
        weights, _ = batch_weights(sizes, comm)
        changed = watch.changed(comm)
        # through .data: the graph saved these buffers; writing the tensors would bump versions and fail backward
        sync_buffers([[b.data for b in bufs] for bufs in bufs_f], weights + [0.0] * (n - g), comm, changed)
        watch.synced(changed, rerun)
        if g < n:  # replicas that got no sample: integer buffers (counters) too
            self.broadcast_buffers()
