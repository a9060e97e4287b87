"""The last step of the data path: how the averaged gradient becomes every replica's next parameters.

The engine calls one :class:`Update` per step and never asks which strategy it is:

* :class:`PerReplica` (paper §3.1; ``mode="cgdp"``/``"single"``): every device steps its own optimizer on the average
  the host sent back during backward; replicas stay bitwise identical (same update, same values).
* :class:`Typical` (paper §2.3 baseline; ``mode="typical"``): after backward device 0 gathers and sums in device order,
  steps, and broadcasts the parameters; on GPUs both collectives are coalesced, as ``nn.DataParallel``'s, so the
  comparison does not flatter cgdp.
* :class:`~cgdp.engine.core.host_update.HostUpdate` (``update="host"``).

The contract: the attributes ``streams``, ``sums``, ``only_first_stepped`` (read before the gradient path is built);
:meth:`~Update.hook_views`; :meth:`~Update.begin_step`; :meth:`~Update.reduce` (after backward, the gradient in place
and its NaN/Inf count, agreed across ranks; nonzero rejects the step before :meth:`~Update.step`); :meth:`~Update.step`
(scale, update, every replica bitwise replica 0's; per device the stamps, None where none ran); :attr:`~Update.figures`.

Threads: ``reduce`` and :meth:`Typical.step` on the caller's thread; :meth:`PerReplica.step` on each device's thread (a
GPU's kernels are issued by the thread owning its streams). Buffers and schedulers are the face's, after the step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import torch
from torch import nn

from cgdp.engine.backend.base import Device
from cgdp.engine.core.precision import sum_dtype
from cgdp.engine.core.stream import GradientStream
from cgdp.engine.core.threads import DeviceThreads

Stamps = tuple[Any, Any]  # (start, end) of one device's update, Device.stamp()


class Update(ABC):
    """How every replica gets the next parameters (the contract: the module)."""

    streams: bool  # gradients go through the host during backward (the plan is tuned)
    sums: bool  # the user's gradient hooks wait for the engine's sum (else autograd runs them)
    only_first_stepped: bool = False  # the other replicas are overwritten

    def __init__(self, devs: Sequence[Device], optimizers: Sequence[torch.optim.Optimizer],
                 params: Sequence[Sequence[nn.Parameter]]):
        self.devs = list(devs)
        self.optimizers = list(optimizers)
        self.params = [list(p) for p in params]

    figures: dict[str, float] = {}  # the last step's, for Trainer.stats
    masters: Any = None  # the float32 masters it steps (HostMasters), if any
    undone = False  # the last step raised and was undone: nothing changed, the face stays usable
    early = False  # it steps during backward: (loss_sum, count) counts are read before backward

    def shown(self) -> list[torch.optim.Optimizer]:
        """The optimizers the face shows (``Trainer.optimizers``)."""
        return self.optimizers

    def attach(self, stream: GradientStream, grads: Any, clipping: bool, guard: Any, resources: Any,
               module: nn.Module | None = None) -> None:
        """Once the gradient path exists."""

    def settle(self) -> bool:
        """After a failed step (caller's thread, nothing else running): whatever it began is finished or undone;
        False if that did not end within ``timeout_s``."""
        return True

    def begin_step(self, hooked: bool = False) -> None:
        """Before the first forward (caller's thread); ``hooked``: user gradient hooks will run."""

    def hook_views(self, views: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """The gradient views a user's gradient hook writes (those the update reads)."""
        return views

    @abstractmethod
    def reduce(self, stream: GradientStream) -> float | torch.Tensor:
        """After backward: the gradient in place; its NaN/Inf count (a device scalar is read with the losses)."""

    @abstractmethod
    def step(self, coef: torch.Tensor | None, stream: GradientStream,
             threads: DeviceThreads) -> list[Stamps | None]:
        """Scale the gradient by ``coef`` (clipping; None: not at all), update, replicas identical."""


class PerReplica(Update):
    """Each device steps its own optimizer on the average sent back. ``streams=False``: ``mode="single"``."""

    def __init__(self, devs: Sequence[Device], optimizers: Sequence[torch.optim.Optimizer],
                 params: Sequence[Sequence[nn.Parameter]], *, streams: bool = True):
        super().__init__(devs, optimizers, params)
        self.streams = self.sums = streams

    def reduce(self, stream: GradientStream) -> float:
        return stream.bad_count()  # counted by the host while it summed

    def step(self, coef: torch.Tensor | None, stream: GradientStream,
             threads: DeviceThreads) -> list[Stamps | None]:
        return threads.run_all(lambda j: self._step_on(j, coef, stream), computing=True)

    def step_bound(self, first: Callable[[], Any], threads: DeviceThreads) -> tuple[Any, list[tuple[int, Any]]]:
        """``DataParallel``'s bound step: replica 0's is ``first()`` (the user's call, on the caller's thread; its
        optimizer is not held here) while every other replica steps on its own; ``first``'s result and the replicas
        whose step raised (``first``'s own error is raised once every replica finished)."""
        return threads.run_beside(first, [opt.step for opt in self.optimizers[1:]])

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
    """Device 0's flat ← the sum of all, in device order (16-bit summed in float32, rounded once, as the host does);
    the NaN/Inf count on device 0, read with the losses (no host wait)."""
    first = flats[0]
    if devs[0].is_cuda and sum_dtype(first.dtype) == first.dtype:
        from cgdp.engine.backend.cuda import reduce_to_first
        reduce_to_first(devs, flats)
    else:
        total = first.to(sum_dtype(first.dtype))  # first itself for float32/float64
        for flat in flats[1:]:
            total.add_(flat.to(first.device, non_blocking=True))
        if total is not first:
            first.copy_(total)
    return (~torch.isfinite(first)).sum()


def broadcast_parameters(devs: Sequence[Device], params: list[list[nn.Parameter]]) -> None:
    if devs[0].is_cuda:
        from cgdp.engine.backend.cuda import broadcast_from_first
        broadcast_from_first(devs, params)
        return
    with torch.no_grad():
        for others in params[1:]:
            torch._foreach_copy_(others, params[0])
