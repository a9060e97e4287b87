"""The user's gradient hooks on parameters (``p.register_hook``): run once, on the summed gradient.

A hook run on each replica's part would be right only if it were linear. So replica 0's parameters' hooks are set aside
for the backward (:meth:`ParamHooks.take`; handles keep working) and run once the sum is back
(:meth:`ParamHooks.apply`): once per backward, on ``devices[0]``, in registration order, the result written into every
replica's gradient, as one device computes. A parameter with no gradient on any device runs no hook.

Hooks on other replicas' parameters, and post-accumulate hooks, are refused. Which parameters have hooks is looked at
again only when a hook was registered since the last look (:func:`~cgdp.engine.core.module_hooks.hook_count`).
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch import nn

from cgdp.engine.core.module_hooks import hook_count

_HOOKS = operator.attrgetter("_backward_hooks")
_POST = operator.attrgetter("_post_accumulate_grad_hooks")


class ParamHooks:
    def __init__(self, params: Sequence[Sequence[nn.Parameter]], unsupported: Sequence[nn.Parameter] = ()):
        """``params[j]``: replica j's parameters (engine order); ``unsupported``: replica 0's sparse ones (no hooks)."""
        self.params = [list(p) for p in params]
        self._others = [p for ps in self.params[1:] for p in ps] + list(unsupported)
        self._seen = -1
        self._watched: list[int] = []  # parameters of replica 0 whose hook dictionary exists
        self.taken: dict[int, dict] = {}
        """Per parameter whose hooks are taken off for this backward: its hook dictionary."""

    def take(self) -> list[int]:
        """Before a backward: take the hooks off replica 0's parameters; the parameters taken."""
        seen = hook_count()
        if seen != self._seen:
            self._look()
            self._seen = seen
        first = self.params[0]
        for pid in self._watched:
            hooks = first[pid]._backward_hooks
            if hooks:
                self.taken[pid] = hooks
                first[pid]._backward_hooks = None  # autograd calls no hook of it in this backward
        return list(self.taken)

    def put_back(self) -> None:
        """After the backward (also one that failed): every hook dictionary where it was."""
        first = self.params[0]
        for pid, hooks in self.taken.items():
            added = first[pid]._backward_hooks  # registered during the backward: keep them too
            if added:
                hooks.update(added)
            first[pid]._backward_hooks = hooks
        self.taken = {}

    def run(self, touched: Sequence[float], views: Sequence[Sequence[torch.Tensor]],
            kept: dict[int, torch.Tensor]) -> None:
        """After the backward, with the sum in ``views[0]``: every taken parameter gets, in every replica, ``kept[pid]``
        (taken out) plus its hooks' result on the sum if ``touched[pid]``; then the hooks are put back."""
        with torch.no_grad():  # as autograd calls them
            for pid in self.taken:
                new = self.apply(pid, views[0][pid].clone()) if touched[pid] else None
                old = kept.pop(pid, None)
                if new is None and old is None:
                    continue
                total = new if old is None else old if new is None else old.add_(new)
                for v in views:
                    v[pid].copy_(total)
        self.put_back()

    def apply(self, pid: int, grad: torch.Tensor) -> torch.Tensor:
        """Parameter ``pid``'s hooks on the summed ``grad``, in order; a hook's non-None result replaces it."""
        for hook in list(self.taken[pid].values()):
            out = hook(grad)
            if out is not None:
                if not isinstance(out, torch.Tensor) or out.shape != grad.shape:
                    raise RuntimeError(f"a gradient hook of parameter {pid} returned "
                                       f"{getattr(out, 'shape', type(out).__name__)}, not a tensor of shape "
                                       f"{tuple(grad.shape)}")
                if out.dtype != grad.dtype or out.device != grad.device:  # torch's words
                    raise RuntimeError(f"hook '{getattr(hook, '__name__', hook)}' has changed the type of value "
                                       f"(was {grad.type()} got {out.type()})")
                grad = out
        return grad

    def _look(self) -> None:
        if any(map(_HOOKS, self._others)):  # one pass in C; which one, only to say so
            n = len(self.params[0])
            k = next(i for i, p in enumerate(self._others) if p._backward_hooks)
            if k >= n * (len(self.params) - 1):
                raise RuntimeError("a gradient hook (register_hook) is registered on a parameter with sparse "
                                   "gradients (nn.Embedding(sparse=True)), which cgdp cannot run on the summed "
                                   "gradient: use sparse=False, or remove the hook")
            raise RuntimeError(f"a gradient hook (register_hook) is registered on a parameter of replica "
                               f"{k // n + 1}; register it on the model's own parameter (replica 0): cgdp runs it "
                               f"once per backward on the summed gradient and gives every replica the result")
        first = self.params[0]
        if sum(map(len, filter(None, map(_POST, first)))) > len(first):  # cgdp's own: one per parameter
            raise RuntimeError("a hook registered with register_post_accumulate_grad_hook on a parameter of "
                               "the model would run in the middle of backward on replica 0's part of the "
                               "gradient; cgdp does not support it: use p.register_hook (cgdp runs it on the "
                               "summed gradient), or act on p.grad after backward()")
        self._watched = [pid for pid, h in enumerate(map(_HOOKS, first)) if h is not None]
