"""The sparse part of a ``DataParallel``'s gradients: sparse embeddings' COO gradients have no fixed size, so no place
in the flat buffer; they travel beside it:

* They are left out of the layers, plan and hooks; autograd accumulates each replica's part into its own ``.grad``.
* After a synced backward (dense chunks back) they are **joined** on ``devices[0]`` in device order: indices and
  values concatenated, uncoalesced, as one device's backward gives, and copied to every replica (bitwise the same). A
  part that arrived dense (a tied weight) makes the join the dense sum in device order.
* Cost: one copy of the looked-up rows per device and direction, after backward (not overlapped).

A part of :class:`cgdp.engine.core.gradients.Gradients` (its invariant holds). Refused with ``comm`` (varying sizes).
"""
from __future__ import annotations

import functools
import operator
from typing import Sequence

import torch
from torch import nn

from cgdp.engine.core.gradients import GradPart


def sparse_parameters(module: nn.Module) -> list[nn.Parameter]:
    weights = (m.weight for m in module.modules()
               if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad)
    return list({id(w): w for w in weights}.values())  # each once, where it first appears


class SparseGrads(GradPart):
    def __init__(self, params: Sequence[Sequence[nn.Parameter]], devices: Sequence[torch.device]):
        self.params = [list(p) for p in params]
        self.devices = list(devices)
        self._prepared: list[tuple[int, int]] = []
        self._copy_from_first()  # the gradients replica 0 held before wrapping

    def begin(self, sync: bool, whole: bool) -> None:
        for k, p in enumerate(self.params[0]):
            if p.grad is None or whole:
                for params in self.params[1:]:
                    params[k].grad = None
        self._prepared = self._state()

    def _state(self) -> list[tuple[int, int]]:
        return [(id(p.grad), p.grad._version if p.grad is not None else -1)
                for params in self.params for p in params]

    def undo(self, whole: bool) -> bool:
        if self._state() != self._prepared:
            return False
        if whole:
            self._copy_from_first()
        return True

    def drop(self) -> None:
        for p in self.params[0]:
            p.grad = None
        self._copy_from_first()

    def end(self, sync: bool) -> bool:
        """``sync``: join the parts and give every replica the total. No gradient hooks here (refused)."""
        if sync:
            for k, p in enumerate(self.params[0]):
                p.grad = _join([params[k].grad for params in self.params], self.devices[0])
            self._copy_from_first()
        return False

    def follow_edits(self, whole: bool, data: bool = True) -> bool:
        if all(p.grad is g for p, g in zip(self.params[0], self._joined)):
            return False
        self._copy_from_first()
        return True

    def norm(self, norm_type: float) -> float:
        """Of the total, in float64; sparse ones coalesced first (duplicate rows summed)."""
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
        self._joined: list[torch.Tensor | None] = [p.grad for p in self.params[0]]
        """What the last join (or mirror) put in replica 0's ``.grad``: another object there is a user change."""


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` of its own on ``device`` (emulated devices share the host: still a copy)."""
    return t.clone() if t.device == device else t.to(device)


def _join(grads: Sequence[torch.Tensor | None], dst: torch.device) -> torch.Tensor | None:
    present = [g for g in grads if g is not None]
    if not present:
        return None
    if all(g.is_sparse for g in present):
        indices = torch.cat([g._indices().to(dst) for g in present], 1)
        values = torch.cat([g._values().to(dst) for g in present], 0)
        # the indices are the replicas' own, valid for this shape: no invariant check needed
        return torch.sparse_coo_tensor(indices, values, present[0].shape, device=dst, check_invariants=False)
    return functools.reduce(operator.add, (g.to(dst).to_dense() for g in present))  # in device order
