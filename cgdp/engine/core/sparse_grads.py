"""The sparse part of a ``DataParallel``'s gradients: they travel beside the flat buffer.

``nn.Embedding(..., sparse=True)`` and ``nn.EmbeddingBag(..., sparse=True)`` give their weight a
sparse COO gradient: the rows that the batch looked up, as many as it has lookups. It has no
fixed size, so it has no place in the chunk-ordered flat buffer (:mod:`cgdp.engine.core.flatgrad`)
and takes another path:

* Such parameters are left out of the layers, the chunk plan and the hooks; autograd accumulates
  each replica's part into that replica's own ``.grad``, as on one device.
* After a synced backward (autograd's final callback, once every replica's part is there and the
  dense chunks are back), their gradients are **joined** on ``devices[0]`` in device order:
  indices and values concatenated, uncoalesced, which is the form one device's backward gives
  for the concatenated batch (the batch is split in order, so the rows come in the same order).
  That one tensor is copied to every replica: every replica holds bitwise the same gradient, and
  ``SparseAdam`` (which coalesces) steps them alike. A gradient that arrived dense on some
  replica (the weight tied to a dense layer) makes the joined gradient dense: the replicas'
  gradients summed in device order, as one device's accumulation would hold it.
* It costs one copy of the looked-up rows per device and direction, after backward (not
  overlapped), on the thread that finishes backward: small next to the dense gradient for the
  embedding tables this is meant for.

A part of :class:`cgdp.engine.core.gradients.Gradients`, whose sum invariant holds here too (the true
gradient is the sum of the replicas' ``.grad``): after a synced backward every replica holds the
total, the next backward keeps replica 0's and clears the others', inside ``no_sync()`` every
replica keeps its own part; ``zero_grad()`` (replica 0's ``.grad`` None) clears them all; a
``.grad`` of replica 0 replaced by the user is copied to every replica before the step.

Not with ``comm`` (several machines): refused at construction, since ranks would have to exchange
gradients of different sizes.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from cgdp.engine.core.gradients import GradPart


def sparse_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The trainable weights of ``module``'s embeddings with ``sparse=True``, in module order."""
    out: list[nn.Parameter] = []
    for m in module.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            if all(m.weight is not p for p in out):
                out.append(m.weight)
    return out


class SparseGrads(GradPart):
    def __init__(self, params: Sequence[Sequence[nn.Parameter]], devices: Sequence[torch.device]):
        """``params[j]``: replica j's sparse-gradient parameters, in the same order on every replica."""
        self.params = [list(p) for p in params]
        self.devices = list(devices)
        self._prepared: list[tuple[int, int]] = []
        self._joined: list[torch.Tensor | None] = [p.grad for p in self.params[0]]
        """What the last join (or mirror) put in replica 0's ``.grad``: another object there is a
        change by the user."""
        for j in range(1, len(self.params)):  # the gradients replica 0 held before wrapping
            for p, q in zip(self.params[0], self.params[j]):
                q.grad = None if p.grad is None else _to(p.grad, self.devices[j])

    def begin(self, sync: bool, whole: bool) -> None:
        """Before a backward adds to the gradients (the sum invariant)."""
        for k, p in enumerate(self.params[0]):
            if p.grad is None or whole:
                for params in self.params[1:]:
                    params[k].grad = None
        self._prepared = self._state()

    def _state(self) -> list[tuple[int, int]]:
        return [(id(p.grad), p.grad._version if p.grad is not None else -1)
                for params in self.params for p in params]

    def undo(self, whole: bool) -> bool:
        """After a failed backward: if no gradient arrived since :meth:`begin`, put back what
        it cleared (as one device keeps its gradients); whether it could."""
        if self._state() != self._prepared:
            return False
        if whole:
            self._copy_from_first()
        return True

    def drop(self) -> None:
        """Every gradient dropped (a backward failed partway)."""
        for params in self.params:
            for p in params:
                p.grad = None
        self._joined = [None] * len(self.params[0])

    def end(self, sync: bool) -> bool:
        """After a backward; ``sync``: join the replicas' parts and give every replica the total
        (after the dense chunks: not overlapped). No gradient hooks run here (they are refused)."""
        if sync:
            for k in range(len(self.params[0])):
                total = _join([params[k].grad for params in self.params], self.devices[0])
                for j, params in enumerate(self.params):
                    params[k].grad = total if j == 0 or total is None else _to(total, self.devices[j])
            self._joined = [p.grad for p in self.params[0]]
        return False

    def follow_edits(self, whole: bool) -> bool:
        """Replica 0's ``.grad`` replaced since the last join: copy it to every replica."""
        if all(p.grad is g for p, g in zip(self.params[0], self._joined)):
            return False
        self._copy_from_first()
        return True

    def norm(self, norm_type: float, host: bool) -> float:
        """Of the total gradient, in float64; a sparse one coalesced first (duplicate rows summed:
        ``torch.nn.utils.clip_grad_norm_`` cannot take sparse gradients on one device)."""
        norms = [float(torch.linalg.vector_norm(p.grad.coalesce().values() if p.grad.is_sparse else p.grad,
                                                norm_type, dtype=torch.float64))
                 for p in self.params[0] if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float64), norm_type)) if norms else 0.0

    def scale(self, coef: torch.Tensor) -> None:
        for j, params in enumerate(self.params):
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef.to(self.devices[j]))

    def _copy_from_first(self) -> None:
        for k, p in enumerate(self.params[0]):
            for j in range(1, len(self.params)):
                self.params[j][k].grad = None if p.grad is None else _to(p.grad, self.devices[j])
        self._joined = [p.grad for p in self.params[0]]


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` of its own on ``device`` (emulated devices share the host: still a copy)."""
    return t.clone() if t.device == device else t.to(device)


def _join(grads: Sequence[torch.Tensor | None], dst: torch.device) -> torch.Tensor | None:
    """The replicas' gradients added up on ``dst``, in device order (see the module docstring)."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    if all(g.is_sparse for g in present):
        indices = torch.cat([g._indices().to(dst) for g in present], 1)
        values = torch.cat([g._values().to(dst) for g in present], 0)
        # the indices are the replicas' own, valid for this shape: no invariant check needed
        return torch.sparse_coo_tensor(indices, values, present[0].shape, device=dst, check_invariants=False)
    total = present[0].to(dst).to_dense()
    for g in present[1:]:
        total = total + g.to(dst).to_dense()
    return total
