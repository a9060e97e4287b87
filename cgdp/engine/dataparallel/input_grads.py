"""Which backward passes through ``DataParallel``'s output: one that trains, or one for input gradients.

The gather's backward (:class:`cgdp.engine.dataparallel.scatter._Gather`) runs at the start of
every backward through the wrapper's output, before any replica's gradient exists. It asks
autograd's engine what this backward will do (:meth:`BackwardCheck.trains`):

* ``loss.backward()`` that accumulates into some trainable parameter's ``.grad``: the engine is
  armed and the replicas' gradients stream to the host (the usual path);
* a backward that accumulates into no parameter: ``loss.backward(inputs=[x])``, or any backward of
  a frozen model (saliency maps, adversarial examples, a frozen teacher): the input gradients
  flow back through the scatter by autograd alone, exactly as on one device, and the engine is
  not involved;
* ``torch.autograd.grad``, which never accumulates into ``.grad``: also input gradients only, as
  long as no trainable parameter is among its ``inputs``. That cannot be asked of the engine
  beforehand, so a guard hook on each of replica 0's trainable parameters
  (:meth:`BackwardCheck.arm`, in place for this one backward) raises if autograd reaches one as an input: it would return
  replica 0's share of the gradient only.

Not supported, with a clear error: input gradients with ``create_graph=True`` while the model has
trainable parameters (a gradient penalty): the backward of that gradient reaches the replicas'
parameters without passing through the gather, where the engine could be armed.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

AUTOGRAD_GRAD = "autograd.grad"


class BackwardCheck:
    """One ``DataParallel``'s view of the backwards through its output: which kind each is
    (:meth:`trains`), and the guard hooks of an ``autograd.grad`` (removed when it is done)."""

    def __init__(self) -> None:
        self._handles: list = []
        self._accs: dict[int, torch.autograd.graph.Node] = {}
        """id(parameter) -> its AccumulateGrad node, held (as DDP holds them) so that every graph
        uses the same one: a lookup costs 0.1 us, making the node again inside backward 30 us."""

    def trains(self, params: Sequence[torch.Tensor], trainable: Sequence[bool]) -> bool:
        """In the gather's backward: whether this backward accumulates into the ``.grad`` of the
        model's trainable parameters (replica 0's ``params`` where ``trainable``); if not, input
        gradients only, and the guard is armed under ``torch.autograd.grad``. Refuses a double
        backward."""
        reach = self.reaches(p for p, t in zip(params, trainable) if t)
        if reach is True:
            return True
        if any(trainable) and torch.is_grad_enabled():  # in a backward, grad mode is create_graph
            refuse_double_backward()
        if reach == AUTOGRAD_GRAD and any(trainable):
            self.arm([p for p, t in zip(params, trainable) if t])
        return False

    def reaches(self, params: Iterable[torch.Tensor]) -> bool | str:
        """Whether autograd will accumulate into the ``.grad`` of any of ``params`` (trainable
        leaves); :data:`AUTOGRAD_GRAD` under ``torch.autograd.grad``. Stops at the first one it
        reaches (in a training backward, nearly always the first one asked)."""
        try:
            for i, p in enumerate(params):
                node = self._accs.get(id(p))
                if node is None or (i == 0 and not torch._C._will_engine_execute_node(node)):
                    # new, or the first one says no: make it again, in case the parameter's node
                    # changed (p.data = ...); if it did, forget every node held
                    fresh = _grad_accumulator(p)
                    if node is not None and fresh is not node:
                        self._accs.clear()
                    self._accs[id(p)] = node = fresh
                if torch._C._will_engine_execute_node(node):
                    return True
        except RuntimeError:  # the engine cannot tell for leaves under autograd.grad
            return AUTOGRAD_GRAD
        return False

    def arm(self, params: Sequence[torch.Tensor]) -> None:
        """Hooks that refuse this ``torch.autograd.grad`` if its inputs include one of ``params``."""
        self.disarm()

        def refuse(grad: torch.Tensor) -> None:
            self.disarm()
            raise RuntimeError("torch.autograd.grad with the model's parameters as inputs is not supported "
                               "through cgdp.DataParallel: it would give replica 0's share of the "
                               "gradient only. Use loss.backward() and read .grad (input gradients, "
                               "torch.autograd.grad(loss, x), are supported)")
        self._handles = [p.register_hook(refuse) for p in params]
        # removed when this backward is done (autograd's final callback), or at the next forward
        torch.autograd.Variable._execution_engine.queue_callback(self.disarm)

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _grad_accumulator(p: torch.Tensor) -> torch.autograd.graph.Node:
    with torch.enable_grad():  # backward runs without grad mode: a view would have no grad_fn
        return p.view_as(p).grad_fn.next_functions[0][0]


def refuse_double_backward() -> None:
    raise RuntimeError("input gradients with create_graph=True (a gradient penalty) through cgdp.DataParallel "
                       "are not supported while the model has trainable parameters: the backward of that "
                       "gradient would reach the replicas' parameters without the engine, and give replica "
                       "0's share only. Freeze the model (requires_grad_(False)) if it does not train, or "
                       "compute the penalty on one device")
