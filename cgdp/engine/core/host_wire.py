"""``update="host"`` with ``grad_transfer="bf16"``: the updated parameters go back in bf16.

After each update the host rounds its float32 masters (:class:`~cgdp.engine.core.host_update.HostMasters`) once to bf16
into a host buffer; every device copies it into its bf16 stage (idle after backward) and widens it into its parameters.
Half the bytes cross the bus, and every replica holds ``float32(bf16(master))``, bitwise identical.

* The masters are the parameters of training: replica 0's ``state_dict()`` holds them, so a resumed run equals an
  uninterrupted one; a load sets the masters and rounds the replicas (:meth:`Bf16Wire.round_replicas`).
* ``close()`` gives replica 0, the user's model, the masters themselves.
* The masters never retake replica 0's (rounded) values after a failed step: :meth:`Bf16Wire.keep` copies them aside.

Threads: :meth:`Bf16Wire.to_devices` on each device's thread; the rest on the caller's, with nothing in flight.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from cgdp.engine.core.threads import DeviceThreads
from cgdp.engine.core.update import Stamps


class Bf16Wire:
    """The masters' bf16 copy on the host and each device's views of its stage."""

    def __init__(self, masters: Any, stages: Sequence[torch.Tensor]):
        """``stages[j]``: device j's bf16 stage (at least as many elements as the masters)."""
        self.masters = masters
        total = masters.flat.numel()
        self.flat16 = masters.devs[0].host_empty((total,), torch.bfloat16)
        self.stages = [st[:total] for st in stages]
        shapes = [(o, m.numel(), m.shape) for o, m in zip(masters.offsets, masters.masters)]
        self.views = [[st[o:o + n].view(s) for o, n, s in shapes] for st in self.stages]
        self._backup: torch.Tensor | None = None
        self._aside: list[torch.Tensor] = []
        self._kept: Sequence[int] = []
        self.sent_bytes = self.flat16.nbytes
        """Bytes each device receives in a copy back."""

    def to_devices(self, threads: DeviceThreads) -> list[Stamps]:
        """Every replica's parameters ← float32(bf16(masters)), half the bytes over the bus."""
        with torch.no_grad():
            self.flat16.copy_(self.masters.flat)  # rounded once, on the host
        params, devs = self.masters.params, self.masters.devs

        def copy(j: int) -> Stamps:
            dev = devs[j]
            t0 = dev.stamp()
            with torch.no_grad():
                # page-locked source: asynchronous on a GPU; the host writes it again only after the next backward,
                # which runs after this copy on the same stream
                self.stages[j].copy_(self.flat16, non_blocking=dev.is_cuda)
                torch._foreach_copy_(params[j], self.views[j])  # widened on the device
            return t0, dev.stamp()
        return threads.run_all(copy, computing=True)

    def close(self) -> None:
        """Replica 0 (the user's model) takes the masters themselves, not their rounding; the wire is dropped."""
        m = self.masters
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in m.params[0]], m.masters)
        m.wire = None

    def round_replicas(self, pids: Sequence[int]) -> None:
        """Parameters ``pids`` on every replica ← the masters' rounding, between steps; through ``.data``, every replica
        alike, so nothing for the follower to copy."""
        masters = [self.masters.masters[k].to(torch.bfloat16) for k in pids]
        with torch.no_grad():
            for ps in self.masters.params:
                torch._foreach_copy_([ps[k].data for k in pids], masters)

    def keep(self, pids: Sequence[int] | None = None) -> None:
        """Copy the masters ``pids`` (None: all) aside before an update that may fail after writing them."""
        m = self.masters
        if self._backup is None:
            self._backup = torch.empty_like(m.flat)
            self._aside = [self._backup[o:o + x.numel()].view(x.shape) for o, x in zip(m.offsets, m.masters)]
        with torch.no_grad():
            if pids is None:
                self._backup.copy_(m.flat)
                self._kept = range(len(m.masters))
            else:
                torch._foreach_copy_([self._aside[k] for k in pids], [m.masters[k] for k in pids])
                self._kept = [*self._kept, *pids]

    def put_back(self) -> None:
        """The masters :meth:`keep` copied aside since :meth:`forget`, as they were."""
        m, kept = self.masters, self._kept
        with torch.no_grad():
            if len(kept) == len(m.masters):
                m.flat.copy_(self._backup)
            elif kept:
                torch._foreach_copy_([m.masters[k] for k in kept], [self._aside[k] for k in kept])
        self._kept = []

    def forget(self) -> None:
        self._kept = []


def masters_in_state_dict(module: nn.Module, masters: Any) -> Callable[[], None]:
    """``state_dict()`` of the module or any submodule holds copies of the float32 masters, not the rounded replica
    values (``keep_vars=True`` keeps the parameters): a post-hook per module owning parameters; returns the remover."""

    def hook_for(mod: nn.Module) -> Any:
        keys = [(name, masters.pid[id(p)]) for name, p in mod.named_parameters(recurse=False) if id(p) in masters.pid]
        own = weakref.ref(mod)

        def hook(m: nn.Module, state: dict, prefix: str, meta: Any) -> None:
            if m is not own():  # a deep copy of the module, which copied its hooks: its own values
                return
            params, seen = masters.params[0], masters.versions
            for name, k in keys:
                # a parameter written since the masters last took it (a load, an edit, before the next step's follow):
                # its own value, which the master will take
                if params[k]._version == seen[k] and not isinstance(state.get(prefix + name), nn.Parameter):
                    state[prefix + name] = masters.masters[k].detach().clone()
        return mod.register_state_dict_post_hook(hook) if keys else None

    handles = [h for h in map(hook_for, module.modules()) if h is not None]

    def remove() -> None:
        for h in handles:
            h.remove()
    return remove
