"""What the other replicas of a ``DataParallel`` copy from replica 0, outside the optimizer step.

Replica 0 is the user's module (``model.module``): the user changes it between steps, and the
other replicas must follow before they run again. :class:`ReplicaState` holds the replicas' lists
(submodules, parameters, floating buffers, all in the same order on every replica) and copies,
before each forward (:meth:`ReplicaState.before_forward`):

* train/eval modes (``net.eval()``, a BatchNorm frozen on ``model.module`` alone);
* ``requires_grad`` (freezing after wrapping; unfreezing what was frozen when wrapped is refused:
  it has no place in the flat buffers);
* parameters changed in place outside ``optimizer.step()`` (``p.clamp_`` under ``no_grad``,
  ``torch.nn.init``), seen through the parameters' version counters, with a warning.

:meth:`ReplicaState.after_forward` gives every replica the batch-weighted mean of the buffers a
training forward wrote. :meth:`ReplicaState.broadcast` copies the whole state (after
``load_state_dict``), or the buffers only (after a forward that failed on some replicas). Parameters are otherwise never copied: each
replica takes the same optimizer step (:mod:`cgdp.engine.dataparallel.mirror`), and
:meth:`ReplicaState.record_parameters` notes their version counters after every step.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cgdp.engine.core.buffers import BufferWatch, sync_buffers
from cgdp.engine.core.replicas import batch_weights
from cgdp.engine.dataparallel.user_warning import warn_user


class ReplicaState:
    def __init__(self, replicas: list[nn.Module]):
        self.replicas = replicas
        self.rebuild_buffers()
        self.submodules = [list(r.modules()) for r in replicas]  # same order on every replica
        self.params = [list(r.parameters()) for r in replicas]
        """Per replica, all its parameters (trainable or not) in ``parameters()`` order."""
        self.wrapped_trainable = [p.requires_grad for p in self.params[0]]
        self.trainable = list(self.wrapped_trainable)
        self.record_parameters()

    def rebuild_buffers(self) -> None:
        """List the buffers (again: a hook registration changed them, :mod:`cgdp.engine.core.module_hooks`)."""
        self.buffers_f = [[b for b in r.buffers() if b.is_floating_point() and not b.requires_grad]
                          for r in self.replicas]
        """Per replica, its floating buffers that need no gradient (BatchNorm statistics)."""
        self.buffer_watch = BufferWatch(self.buffers_f)  # which of them a forward wrote

    def before_forward(self) -> None:
        self.copy_modes()
        self.copy_requires_grad()
        self.copy_edited_parameters()

    def copy_modes(self) -> None:
        """Every replica's modules take replica 0's train/eval modes: ``net.eval()`` or a frozen
        BatchNorm set on ``model.module`` alone must not leave the other replicas training."""
        flags = [m.training for m in self.submodules[0]]
        for mods in self.submodules[1:]:
            for m, f in zip(mods, flags):
                if m.training is not f:
                    m.training = f

    def copy_requires_grad(self) -> None:
        """Parameters frozen on replica 0 after wrapping are frozen on every replica; one that was
        frozen when wrapped has no place in the flat buffers and cannot start training."""
        now = [p.requires_grad for p in self.params[0]]
        if now == self.trainable:
            return
        names = [n for (n, _), was, r in zip(self.replicas[0].named_parameters(), self.wrapped_trainable, now)
                 if r and not was]
        if names:
            raise RuntimeError(f"parameters frozen when cgdp.DataParallel was built now require grad "
                               f"({', '.join(names[:5])}); unfreeze them before wrapping, or wrap "
                               f"model.module again after close()")
        for params in self.params[1:]:
            for q, r in zip(params, now):
                q.requires_grad_(r)
        self.trainable = now

    def record_parameters(self) -> None:
        """Replica 0's parameters as they are now are every replica's (version counters)."""
        self.param_versions = [p._version for p in self.params[0]]

    def copy_edited_parameters(self) -> None:
        """Replica 0's parameters changed in place outside the optimizer (``p.clamp_`` under
        ``no_grad``, ``torch.nn.init``): copy them to every replica, with a warning, so they never
        drift apart. Seen through the version counters, which ``p.data`` does not share."""
        if [p._version for p in self.params[0]] == self.param_versions:
            return
        warn_user("replica 0's parameters were changed outside optimizer.step() (in place under "
                  "torch.no_grad(), e.g. p.clamp_ or torch.nn.init); cgdp.DataParallel copies them "
                  "to every replica before this forward. Changes through p.data are not seen: "
                  "make them on every replica (model.replicas)")
        with torch.no_grad():
            for params in self.params[1:]:
                for q, p in zip(params, self.params[0]):
                    q.copy_(p)
        self.record_parameters()

    def broadcast(self, buffers_only: bool = False) -> None:
        """Every replica ← replica 0's parameters and buffers (after ``load_state_dict``)."""
        first = self.replicas[0]
        with torch.no_grad():
            for r in self.replicas[1:]:
                if buffers_only:
                    for b, b0 in zip(r.buffers(), first.buffers()):
                        b.data.copy_(b0)
                else:
                    r.load_state_dict(first.state_dict())
        self.buffer_watch.synced()  # every replica's buffers are the same again
        if not buffers_only:
            self.record_parameters()

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
