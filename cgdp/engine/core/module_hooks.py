"""Module hooks on every replica: replica 0's hook dictionaries are every replica's.

``nn.DataParallel`` copies hooks with the module at every forward; cgdp's replicas live for the whole run, so every
replica's submodule holds the *same* hook dictionaries as replica 0's (:func:`share_hooks`): a forward, forward-pre or
backward hook registered on the user's model, before or after wrapping, or removed, acts on every replica at once, at no
cost per step. Each replica runs it on its own thread with its part of the batch (G calls, in no fixed order).
State-dict and load hooks are not shared.

:class:`ModuleHooks` follows what a registration changes outside those dictionaries, before a forward when a hook was
registered since the last look (:func:`hook_count`) or replica 0's tensors changed: ``_is_full_backward_hook``, and
parameters and buffers renamed or added (``torch.nn.utils.prune``: ``weight`` → ``weight_orig`` plus a mask buffer). A
parameter replica 0 did not have when wrapped is a clear error.
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from itertools import chain
from typing import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_FULL = operator.attrgetter("_is_full_backward_hook")
_PARAMS = operator.attrgetter("_parameters")
_BUFFERS = operator.attrgetter("_buffers")
SHARED = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
          "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
"""The hook dictionaries of ``nn.Module`` that every replica shares with replica 0."""


def hook_count() -> int:
    """How many hook handles torch has made in this process (every ``register_*hook`` makes one)."""
    return RemovableHandle.next_id


def share_hooks(replicas: Sequence[nn.Module]) -> None:
    """Every replica's submodules take replica 0's hook dictionaries (the same objects)."""
    first = list(replicas[0].modules())
    for r in replicas[1:]:
        for m0, m in zip(first, r.modules()):
            for name in SHARED:
                if name in m0.__dict__:
                    m.__dict__[name] = m0.__dict__[name]
            m._is_full_backward_hook = m0._is_full_backward_hook


class ModuleHooks:
    """Shares replica 0's hooks with the other replicas and follows what a registration changes. ``params[j]``: replica
    j's parameters, in engine order; ``devices[j]``: where its buffers live."""

    def __init__(self, replicas: Sequence[nn.Module], params: Sequence[Sequence[nn.Parameter]],
                 devices: Sequence[torch.device]):
        share_hooks(replicas)
        self.modules = [list(r.modules()) for r in replicas]
        self.params = [list(p) for p in params]
        self.devices = list(devices)
        self._pos = {id(p): i for i, p in enumerate(self.params[0])}
        self._layout = [_layout_of(m) for m in self.modules[0]]
        self._print = fingerprint(self.modules[0])
        self._flags = list(map(_FULL, self.modules[0]))
        self._seen = hook_count()

    def follow(self, moved: bool = False) -> bool:
        """Before a forward, on the caller's thread: whether some replica's buffers changed. ``moved``: replica 0's
        module tree changed (look even without a hook registration)."""
        seen = hook_count()
        if seen == self._seen and not moved:
            return False
        first = self.modules[0]
        flags = list(map(_FULL, first))
        if flags != self._flags:
            for mods in self.modules[1:]:
                for m, flag in zip(mods, flags):
                    m._is_full_backward_hook = flag
            self._flags = flags
        now = fingerprint(first)
        changed = now != self._print
        if changed:  # names or objects of some parameters or buffers: which modules?
            for i, m0 in enumerate(first):
                layout = _layout_of(m0)
                if layout != self._layout[i]:
                    self._restructure(i, m0)
                    self._layout[i] = layout
            self._print = now
        self._seen = seen
        return changed

    def _restructure(self, i: int, m0: nn.Module) -> None:
        """Replica 0's submodule i changed: every replica renames its own parameters alike and copies new buffers."""
        old_buffers = dict(self._layout[i][1])
        for name, p in m0._parameters.items():
            if p is not None and id(p) not in self._pos:
                raise RuntimeError(
                    f"the parameter {name!r} of {type(m0).__name__} is not one the model had when it was "
                    f"wrapped (a layer replaced, or torch.nn.utils.prune.remove): cgdp cannot train a new "
                    f"parameter object on every device. Make such changes before wrapping, or close() "
                    f"and wrap the model again")
        for j, mods in enumerate(self.modules[1:], start=1):
            m = mods[i]
            m._parameters = OrderedDict(
                (name, None if p is None else self.params[j][self._pos[id(p)]])
                for name, p in m0._parameters.items())
            buffers = OrderedDict()
            for name, b in m0._buffers.items():
                if b is not None and (old_buffers.get(name) != id(b) or m._buffers.get(name) is None):
                    b = b.detach().to(self.devices[j], copy=True)
                elif b is not None:
                    b = m._buffers[name]
                buffers[name] = b
            m._buffers = buffers
            m._non_persistent_buffers_set = set(m0._non_persistent_buffers_set)
            for name in list(m.__dict__):  # an attribute now held as a parameter or buffer
                if name in m._parameters or name in m._buffers:
                    del m.__dict__[name]


def _layout_of(m: nn.Module) -> tuple:
    return (tuple((k, id(v)) for k, v in m._parameters.items()),
            tuple((k, id(v)) for k, v in m._buffers.items()))


def fingerprint(modules: list[nn.Module]) -> tuple[list, ...]:
    """The names and objects of all the modules' parameters and buffers, in one pass in C."""
    params, buffers = list(map(_PARAMS, modules)), list(map(_BUFFERS, modules))
    return (list(chain.from_iterable(map(dict.keys, params))),
            list(map(id, chain.from_iterable(map(dict.values, params)))),
            list(chain.from_iterable(map(dict.keys, buffers))),
            list(map(id, chain.from_iterable(map(dict.values, buffers)))))
