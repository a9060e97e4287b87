"""Which backward passes through ``DataParallel``'s output: one that trains, or one for input gradients.

The gather's backward runs first and asks autograd what this backward will do (:meth:`BackwardCheck.trains`):

* into some trainable parameter's ``.grad``: the engine is armed; into none (``backward(inputs=[x])``, a frozen
  model): input gradients flow back by autograd alone, as on one device;
* ``torch.autograd.grad``: the engine cannot tell its ``inputs`` beforehand, so guard hooks (:meth:`BackwardCheck.arm`)
  raise if it reaches a trainable parameter (it would get replica 0's share only).

Refused: input gradients with ``create_graph=True`` while training (their backward bypasses the gather).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

AUTOGRAD_GRAD = "autograd.grad"


class BackwardCheck:
    def __init__(self) -> None:
        self._handles: list = []
        self._accs: dict[int, torch.autograd.graph.Node] = {}
        """id(parameter) -> its AccumulateGrad node, held as DDP does (a lookup: 0.1 us; making it: 30 us)."""

    def trains(self, params: Sequence[torch.Tensor], trainable: Sequence[bool]) -> bool:
        """Whether this backward trains; if not, the guard is armed under ``autograd.grad``. Refuses double backward."""
        reach = self.reaches(p for p, t in zip(params, trainable) if t)
        if reach is True:
            return True
        if any(trainable) and torch.is_grad_enabled():  # in a backward, grad mode is create_graph
            raise RuntimeError("input gradients with create_graph=True (a gradient penalty) through cgdp.DataParallel "
                               "are not supported while the model has trainable parameters: the backward of that "
                               "gradient would reach the replicas' parameters without the engine, and give replica "
                               "0's share only. Freeze the model (requires_grad_(False)) if it does not train, or "
                               "compute the penalty on one device")
        if reach == AUTOGRAD_GRAD:  # (reached only through a trainable parameter)
            self.arm([p for p, t in zip(params, trainable) if t])
        return False

    def reaches(self, params: Iterable[torch.Tensor]) -> bool | str:
        """Whether autograd will accumulate into any of ``params``; :data:`AUTOGRAD_GRAD` under ``autograd.grad``."""
        try:
            for i, p in enumerate(params):
                node = self._accs.get(id(p))
                if node is None or (i == 0 and not torch._C._will_engine_execute_node(node)):
                    # new, or the first says no: the node may have changed (p.data = ...); if so, forget all
                    with torch.enable_grad():  # backward runs without grad mode: a view would have no grad_fn
                        fresh = p.view_as(p).grad_fn.next_functions[0][0]
                    if node is not None and fresh is not node:
                        self._accs.clear()
                    self._accs[id(p)] = node = fresh
                if torch._C._will_engine_execute_node(node):
                    return True
        except RuntimeError:  # the engine cannot tell for leaves under autograd.grad
            return AUTOGRAD_GRAD
        return False

    def arm(self, params: Sequence[torch.Tensor]) -> None:
        self.disarm()

        def refuse(grad: torch.Tensor) -> None:
            self.disarm()
            raise RuntimeError("torch.autograd.grad with the model's parameters as inputs is not supported "
                               "through cgdp.DataParallel: it would give replica 0's share of the "
                               "gradient only. Use loss.backward() and read .grad (input gradients, "
                               "torch.autograd.grad(loss, x), are supported)")
        self._handles = [p.register_hook(refuse) for p in params]
        torch.autograd.Variable._execution_engine.queue_callback(self.disarm)

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
