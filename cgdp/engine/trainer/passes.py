"""Steps 2 and 3 of the data path on the devices' host threads (``Trainer.step`` decides on the caller's thread):
:meth:`DevicePasses.forward_all` (in each replica's random stream and the caller's autocast),
:meth:`DevicePasses.hold_micro_batches` (micro-batches 1..k-1, nothing sent) and :meth:`DevicePasses.backward_all` (the
hooks send; each device then flushes and waits for its gradients to be back). Each backward takes its loss out of its
list so its graph is freed there. Every pass returns stamps on the device's clock (:mod:`cgdp.engine.trainer.timing`).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from cgdp.engine.backend.base import Device
from cgdp.engine.core.buffers import copy_from_first
from cgdp.engine.core.stream import GradientStream
from cgdp.engine.core.threads import DeviceThreads
from cgdp.engine.trainer.losses import (DeviceLoss, DeviceWeight, HeldMicroBatches, backward_weight, check_counts,
                                        read_at_once)
from cgdp.engine.trainer.timing import Timing

Forward = tuple[DeviceLoss, Any, Any]
"""(loss, forward start, forward end) of one device."""
Backward = tuple[float, Any, Any, Any]
"""(loss value, backward start, backward end, gradients back) of one device."""


class DevicePasses:
    def __init__(self, devs: Sequence[Device], replicas: Sequence[nn.Module], rng: Any, threads: DeviceThreads,
                 stream: GradientStream, timing: Timing, after_forward: Callable[[int], None]):
        self.devs = list(devs)
        self.replicas = list(replicas)
        self.rng = rng
        self.threads = threads
        self.stream = stream
        self.timing = timing
        self.after_forward = after_forward
        """Called after every forward pass: what the forwards changed in the parameters is made the same everywhere."""
        self.used = len(self.devs)
        """Devices with samples in this step's last forward (the first ones)."""

    def forward_all(self, parts: list[Any], compute: Callable, amp: Callable,
                    restore: Callable[[], None]) -> list[Forward]:
        """Forward and loss of ``parts[j]`` on every device j (the rest run nothing, :meth:`_idle`); ``restore``:
        buffers back before a forward is rerun."""
        used = self.used = len(parts)

        def run() -> list[Forward]:
            return self.threads.run_all(lambda j: self._forward_on(j, parts[j], compute, amp) if j < used
                                        else (None, self.devs[j].stamp(), self.devs[j].stamp()), computing=True)
        out = self.rng.forward_all(run, restore)
        if used < len(self.devs):
            out = self._idle(out, used)
        self.after_forward(used)
        return out

    def _idle(self, out: list[Forward], used: int) -> list[Forward]:
        """Devices ``used``.. got no sample and run no forward: each gets a loss of 0 in the others' form (so its
        backward sends zeros) and replica 0's counters; its buffers weigh 0 in the step's mean."""
        first = out[0][0]
        for j in range(used, len(self.devs)):
            zero = torch.zeros((), dtype=first.loss.dtype, device=first.loss.device)
            out[j] = (DeviceLoss(zero, None if first.count is None else 0.0), *out[j][1:])
        copy_from_first([[b for b in r.buffers() if not b.is_floating_point()]
                         for r in (self.replicas[0], *self.replicas[used:])])
        return out

    def _forward_on(self, j: int, part: Any, compute: Callable, amp: Callable) -> Forward:
        dev = self.devs[j]
        f0 = dev.stamp()

        def forward() -> DeviceLoss:
            with amp():
                return compute(self.replicas[j], part, dev.torch_device)
        loss = self.rng.on_device(j, forward)
        return loss, f0, dev.stamp()

    def hold_micro_batches(self, rounds: list[tuple[list[Any], list[float]]], compute: Callable, amp: Callable,
                           restore: Callable[[], None]) -> HeldMicroBatches:
        """Forward and backward of micro-batches 1..k-1 on every device, gradients kept on the devices."""
        held = HeldMicroBatches(len(self.devs), len(rounds) + 1)
        t0 = time.perf_counter()
        for parts, w in rounds:
            fw = self.forward_all(parts, compute, amp, restore)
            w = held.weights([f[0] for f in fw], w)
            held.values += self.threads.run_all(lambda j: self._held_backward_on(j, fw[j][0].loss, w[j]), turns=True)
        held.seconds = time.perf_counter() - t0
        return held

    def _held_backward_on(self, j: int, loss: torch.Tensor, w: float | torch.Tensor) -> torch.Tensor:
        with self.stream.holding(j), self.threads.computing(loss.device.type == "cpu"):  # as in _backward_on
            torch.autograd.backward(loss, grad_tensors=backward_weight(w, loss.dtype, loss.device))
        return loss.detach()  # read with the step's other losses (loss_values): one host wait

    def backward_all(self, losses: list[torch.Tensor | None], weights: list[float | DeviceWeight],
                     rescale: list[torch.Tensor | None]) -> list[Backward]:
        """Backward of ``losses[j]`` weighted ``weights[j]`` on every device, until its gradients are back;
        ``rescale[j]`` first."""
        return self.threads.run_all(lambda j: self._backward_on(j, losses, weights[j], rescale[j]), turns=True)

    def _backward_on(self, j: int, losses: list[torch.Tensor | None], w: float | DeviceWeight,
                     rescale: torch.Tensor | None = None) -> Backward:
        """``losses[j]`` is taken out (its graph is freed here)."""
        dev, loss, losses[j] = self.devs[j], losses[j], None
        b0 = dev.stamp()
        if rescale is not None:
            self.stream.scale_grads(rescale, j)
        # backward of a CPU loss runs on this thread (a GPU's runs on autograd's thread for that device): a turn, since
        # its hooks only enqueue and never wait for another device. A device without samples runs none: the flush below
        # sends its zeroed buffer
        busy = j < self.used
        with self.threads.computing(busy and loss.device.type == "cpu"):
            if busy:
                torch.autograd.backward(loss, grad_tensors=backward_weight(w, loss.dtype, loss.device, j))
        if self.timing.events is not None:
            dev.backward_issued()
        self.stream.flush(j)
        value, loss = loss.detach(), None  # read with the others (loss_values): one host wait per step
        b1 = dev.stamp()
        self.stream.wait_returned(j)
        return value, b0, b1, dev.stamp()


def loss_values(losses: Sequence[Any], weights: Sequence[float | DeviceWeight],
                flags: Sequence[float | torch.Tensor | None], device: torch.device) -> tuple[float, list[float]]:
    """The step's loss Σ w·loss and ``flags`` as floats (None: 0), from one host read: losses, device counts
    (:class:`DeviceWeight`, checked here) and device-scalar flags, gathered on ``device`` as float64, read at once."""
    dw = next((w for w in weights if isinstance(w, DeviceWeight)), None)
    counts = [dw.total, *dw.counts] if dw is not None else []
    flags = [0.0 if f is None else f for f in flags]
    read = read_at_once([*losses, *counts, *flags], device)  # the step's one host read
    n = len(losses)
    if dw is not None:
        check_counts(read[n + 1:n + len(counts)], read[n])  # [total, *counts] as read; raises if a count is bad
        final = 1.0 / read[n]
        weights = [final if isinstance(w, DeviceWeight) else w for w in weights]
    return math.fsum(w * v for w, v in zip(weights, read[:n])), read[len(read) - len(flags):]
