"""The last step of the data path: how the averaged gradient becomes every replica's next parameters.

The engine calls one :class:`Update` object per step and never asks which strategy it is. A
strategy says, before anything is built, how the gradients travel, and after backward it puts the
gradient its optimizer reads in place and applies the update:

* :class:`PerReplica`: every device steps its own optimizer on its own replica (the paper's
  cgdp, §3.1; ``Trainer(mode="cgdp")``, and ``mode="single"`` with one device). The gradient
  each optimizer reads is already the average (the host sent it back during backward), so the
  replicas stay bitwise identical because every one applies the same update to the same values.
* :class:`Typical`: the paper's baseline (§2.3; ``mode="typical"``). Nothing overlaps backward:
  after it, device 0 gathers every device's gradient and sums it in device order, steps its
  optimizer, and broadcasts the parameters to the other replicas. On GPUs both collectives are
  coalesced, as in the paper's baseline and ``nn.DataParallel`` (one NCCL reduce of the flat
  buffers, which are already coalesced, and one bucketed ``broadcast_coalesced`` of the
  parameters), so the comparison does not flatter cgdp. Emulated devices add in device order.

What a third strategy (the host-side optimizer, ``update="host"``) must provide:

* the facts the engine reads before it builds the gradient path, as attributes: ``streams``
  (gradients go through the host during backward: the hooks send chunks, so the chunk plan
  matters and is tuned), ``sums`` (the engine sums the replicas' gradients, so the user's
  gradient hooks wait for the sum, :mod:`cgdp.engine.core.param_hooks`), ``only_first_stepped``
  (only optimizer 0 steps, so the other replicas' schedulers step without their optimizer);
* :meth:`~Update.hook_views`: the replicas' gradient views into which the result of a user's
  gradient hook is written (those whose gradient the update reads);
* :meth:`~Update.begin_step`: before each step's first forward (the host update refreshes its
  masters there and readies its per-chunk updates);
* :meth:`~Update.reduce`: after backward, on the caller's thread, the gradient the update reads
  in place; its NaN/Inf count on this rank, a float or a device's scalar (read with the step's
  losses, in its one host read; the engine agrees on it across ranks and rejects the step before
  :meth:`~Update.step` if it is not zero);
* :meth:`~Update.step`: scale that gradient by the clipping coefficient, apply the update, and
  leave every replica's parameters bitwise identical to replica 0's; per device, the stamps
  (``Device.stamp``) around its update, None where it ran none (``Trainer.stats``, traces);
  :attr:`~Update.figures` for ``Trainer.stats``.

:class:`~cgdp.engine.core.host_update.HostUpdate` (``update="host"``) is that third strategy.

Which thread runs what: :meth:`~Update.reduce` runs on the caller's thread; :meth:`PerReplica.step`
runs each device's update on that device's host thread (``DeviceThreads.run_all``), so a GPU's
optimizer kernels are issued by the thread that owns its streams; :meth:`Typical.step` runs on the
caller's thread. Buffers (BatchNorm statistics) and schedulers are the face's, after the step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch
from torch import nn

from cgdp.engine.backend.base import Device
from cgdp.engine.core.precision import sum_dtype
from cgdp.engine.core.stream import GradientStream
from cgdp.engine.core.threads import DeviceThreads

Stamps = tuple[Any, Any]
"""``(start, end)`` of one device's update, from ``Device.stamp()``."""


class Update(ABC):
    """How every replica gets the next parameters; see the module docstring for the contract."""

    streams: bool
    """Gradients go through the host during backward (the hooks send chunks; the plan is tuned)."""
    sums: bool
    """The engine sums the replicas' gradients: the user's gradient hooks wait for the sum. False
    with one replica whose gradient never leaves its device: autograd runs the hooks itself."""
    only_first_stepped: bool = False
    """Only optimizer 0 steps (the other replicas are overwritten)."""

    def __init__(self, devs: Sequence[Device], optimizers: Sequence[torch.optim.Optimizer],
                 params: Sequence[Sequence[nn.Parameter]]):
        """``params[j]``: replica j's trainable parameters; ``optimizers[j]`` steps them."""
        self.devs = list(devs)
        self.optimizers = list(optimizers)
        self.params = [list(p) for p in params]

    figures: dict[str, float] = {}
    """Figures of the last step for ``Trainer.stats`` (the host update's time, whether it overlapped)."""

    def begin_step(self, hooked: bool = False) -> None:
        """Before a step's first forward, on the caller's thread (nothing in flight); ``hooked``:
        the user's gradient hooks on the parameters will run on the average (:meth:`hook_views`)."""

    def hook_views(self, views: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Of every replica's gradient views (``views[j]``), those a user's gradient hook writes."""
        return views

    @abstractmethod
    def reduce(self, stream: GradientStream) -> float | torch.Tensor:
        """After backward: the gradient the update reads in place; its NaN/Inf count (a device's
        scalar is read with the step's losses)."""

    @abstractmethod
    def step(self, coef: torch.Tensor | None, stream: GradientStream,
             threads: DeviceThreads) -> list[Stamps | None]:
        """Scale the gradient by ``coef`` (clipping; None: not at all), update, replicas identical."""


class PerReplica(Update):
    """Each device steps its own optimizer on the averaged gradient the host sent back.

    ``streams=False``: one replica (``mode="single"``): no gradient leaves the device and nothing
    is summed."""

    def __init__(self, devs: Sequence[Device], optimizers: Sequence[torch.optim.Optimizer],
                 params: Sequence[Sequence[nn.Parameter]], *, streams: bool = True):
        super().__init__(devs, optimizers, params)
        self.streams = self.sums = streams

    def reduce(self, stream: GradientStream) -> float:
        return stream.bad_count()  # counted by the host while it summed

    def step(self, coef: torch.Tensor | None, stream: GradientStream,
             threads: DeviceThreads) -> list[Stamps | None]:
        return threads.run_all(lambda j: self._step_on(j, coef, stream), computing=True)

    def _step_on(self, j: int, coef: torch.Tensor | None, stream: GradientStream) -> Stamps:
        dev = self.devs[j]
        u0 = dev.stamp()
        if coef is not None:
            stream.scale_grads(coef, j)
        self.optimizers[j].step()
        return u0, dev.stamp()


class Typical(Update):
    """Device 0 gathers, sums in device order, steps, and broadcasts the parameters (§2.3)."""

    streams = False
    sums = True
    only_first_stepped = True  # and torch would warn that the others' schedulers step first

    def hook_views(self, views: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        return views[:1]  # replica 0's update is broadcast

    def reduce(self, stream: GradientStream) -> torch.Tensor:
        return gather_on_first(self.devs, stream.flats)

    def step(self, coef: torch.Tensor | None, stream: GradientStream,
             threads: DeviceThreads) -> list[Stamps | None]:
        dev = self.devs[0]
        u0 = dev.stamp()
        if coef is not None:
            stream.scale_grads(coef, 0)
        self.optimizers[0].step()
        broadcast_parameters(self.devs, self.params)
        return [(u0, dev.stamp())] + [None] * (len(self.devs) - 1)


def gather_on_first(devs: Sequence[Device], flats: list[torch.Tensor]) -> torch.Tensor:
    """Device 0's flat buffer ← the sum of every device's, in device order; the NaN/Inf count, on
    device 0 (no host wait: the step reads it with its losses, before the update).
    16-bit gradients are summed in float32 and rounded once, as the host does. On GPUs, float32
    and float64 buffers are reduced with one collective (:func:`~cgdp.engine.backend.cuda.reduce_to_first`)."""
    first = flats[0]
    if devs[0].is_cuda and sum_dtype(first.dtype) == first.dtype:
        from cgdp.engine.backend.cuda import reduce_to_first
        reduce_to_first(devs, flats)
        return (~torch.isfinite(first)).sum()
    total = first.to(sum_dtype(first.dtype))  # first itself for float32/float64
    for flat in flats[1:]:
        total.add_(flat.to(first.device, non_blocking=True))
    if total is not first:
        first.copy_(total)
    return (~torch.isfinite(first)).sum()


def broadcast_parameters(devs: Sequence[Device], params: list[list[nn.Parameter]]) -> None:
    """Every replica's parameters ← replica 0's."""
    if devs[0].is_cuda:
        from cgdp.engine.backend.cuda import broadcast_from_first
        broadcast_from_first(devs, params)
        return
    with torch.no_grad():
        for others in params[1:]:
            torch._foreach_copy_(others, params[0])
