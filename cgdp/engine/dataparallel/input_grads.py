"""Which backward passes through ``DataParallel``'s output: one that trains, or one for input gradients.

The gather's backward (:class:`cgdp.engine.dataparallel.scatter._Gather`) runs at the start of
every backward through the wrapper's output, before any replica's gradient exists. It asks
autograd's engine what this backward will do (:func:`reaches_parameters`):

* ``loss.backward()`` that accumulates into some trainable parameter's ``.grad``: the engine is
  armed and the replicas' gradients stream to the host (the usual path);
* a backward that accumulates into no parameter: ``loss.backward(inputs=[x])``, or any backward of
  a frozen model (saliency maps, adversarial examples, a frozen teacher): the input gradients
  flow back through the scatter by autograd alone, exactly as on one device, and the engine is
  not involved;
* ``torch.autograd.grad``, which never accumulates into ``.grad``: also input gradients only, as
  long as no trainable parameter is among its ``inputs``. That cannot be asked of the engine
  beforehand, so a guard hook on each of replica 0's trainable parameters (:class:`ParamGuard`,
  in place for this one backward) raises if autograd reaches one as an input: it would return
  replica 0's share of the gradient only.

Not supported, with a clear error: input gradients with ``create_graph=True`` while the model has
trainable parameters (a gradient penalty): the backward of that gradient reaches the replicas'
parameters without passing through the gather, where the engine could be armed.
"""
from __future__ import annotations

from typing import Sequence

import torch

AUTOGRAD_GRAD = "autograd.grad"


def trains(trainable: Sequence[torch.Tensor], guard: "ParamGuard") -> bool:
    """In the gather's backward: whether this backward accumulates into the ``.grad`` of the
    model's trainable parameters (replica 0's, ``trainable``); if not, input gradients only, and
    ``guard`` is armed under ``torch.autograd.grad``. Refuses a double backward it cannot do."""
    reach = reaches_parameters(trainable)
    if reach is True:
        return True
    if trainable and torch.is_grad_enabled():  # in a backward, grad mode is create_graph
        refuse_double_backward()
    if reach == AUTOGRAD_GRAD and trainable:
        guard.arm(trainable)
    return False


def reaches_parameters(params: Sequence[torch.Tensor]) -> bool | str:
    """Inside a backward: whether autograd will accumulate into the ``.grad`` of any of ``params``
    (trainable leaves); :data:`AUTOGRAD_GRAD` under ``torch.autograd.grad``. Stops at the first
    parameter it reaches (in a training backward, nearly always the first one asked)."""
    for p in params:
        try:
            if torch._C._will_engine_execute_node(_grad_accumulator(p)):
                return True
        except RuntimeError:  # the engine cannot tell for leaves under autograd.grad
            return AUTOGRAD_GRAD
    return False


def _grad_accumulator(p: torch.Tensor) -> torch.autograd.graph.Node:
    with torch.enable_grad():  # backward runs without grad mode: a view would have no grad_fn
        return p.view_as(p).grad_fn.next_functions[0][0]


class ParamGuard:
    """Hooks that refuse a ``torch.autograd.grad`` whose inputs include one of these parameters."""

    def __init__(self) -> None:
        self._handles: list = []

    def arm(self, params: Sequence[torch.Tensor]) -> None:
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


def refuse_double_backward() -> None:
    raise RuntimeError("input gradients with create_graph=True (a gradient penalty) through cgdp.DataParallel "
                       "are not supported while the model has trainable parameters: the backward of that "
                       "gradient would reach the replicas' parameters without the engine, and give replica "
                       "0's share only. Freeze the model (requires_grad_(False)) if it does not train, or "
                       "compute the penalty on one device")
