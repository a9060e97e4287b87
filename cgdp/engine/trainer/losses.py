"""Step 2 of the data path: each device's loss and the weight its backward starts from.

:func:`parse_step` splits the batch for ``step(inputs, targets, loss_fn)`` (``loss_fn(model(*x_j), y_j)``, a mean over
device j's n_j samples) or ``step(batch, loss_fn)`` (``loss_fn(model, batch_j)`` on a part of a nested batch: a mean
over its samples, or a pair ``(loss_sum, count)`` over its items).

Weights (:func:`loss_weights`): a mean gets w_j = n_j / N (N samples over all devices and ranks); pairs get 1 / C, C = Σ
count over all devices and ranks, so the step's loss is the global batch's mean either way. A count returned as a tensor
stays on its device: C and 1 / C are made on the first device in float64, in Python's ``sum`` order
(:class:`DeviceWeight`), so the host waits for no count before backward; the counts are read and checked with the step's
losses (:func:`cgdp.engine.trainer.passes.loss_values`), and a bad one rejects the step before the update. With MPI one
small allreduce sums them, after each rank reads its own in one read.

The backward weight is made in float64 and rounded once to the loss's dtype (:func:`rounded_once`).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from cgdp.comm import Comm
from cgdp.engine.trainer.batch import split_batch, split_nested, to_device


@dataclass
class DeviceLoss:
    loss: torch.Tensor
    """The scalar backward starts from (a mean over samples, or the pair's ``loss_sum``)."""
    count: float | torch.Tensor | None
    """The pair's count (None for a mean); a device tensor stays there, checked when the losses are read."""


@dataclass
class StepCall:
    parts: list[Any]
    """Device j's part of the batch (still on the caller's device)."""
    sizes: list[int]
    """Samples per device, 0 for a device without a part."""
    nested: bool
    """The two-argument form ``step(batch, loss_fn)``."""
    compute: Callable[[nn.Module, Any, torch.device], DeviceLoss]
    """``compute(replica, part, device)``: forward and loss, on the device's thread."""
    whole: frozenset[int] = frozenset()
    """Ids of the batch's tensors that every part holds whole (micro-batches keep them whole)."""


def parse_step(args: Sequence[Any], g: int, comm: Comm | None = None) -> StepCall:
    """Split for ``g`` devices. A batch refused on one rank is refused on every rank: this rank joins the step's first
    collective (:func:`~cgdp.engine.core.replicas.batch_weights`) with NaN, so no collectives pair across steps."""
    try:
        if len(args) not in (2, 3):
            raise TypeError(f"step takes (batch, loss_fn) or (inputs, targets, loss_fn); got {len(args)} "
                            f"argument(s)")
        loss_fn = args[-1]
        if len(args) == 3:
            if not callable(loss_fn):
                raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {_kind(loss_fn)}")
            parts, sizes = split_batch(args[0], args[1], g)
            return StepCall(parts, sizes, False, partial(_output_loss, loss_fn))
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {_kind(loss_fn)}"
                            f" (step takes (batch, loss_fn) or (inputs, targets, loss_fn))")
        # a torch loss (nn.CrossEntropyLoss(), F.cross_entropy) is called as (output, target)
        if isinstance(loss_fn, nn.modules.loss._Loss) or getattr(loss_fn, "__module__", None) == "torch.nn.functional":
            raise TypeError(f"step(batch, loss_fn) calls loss_fn(model, batch), but {_name(loss_fn)} takes "
                            f"(output, target); pass the targets too: step(inputs, targets, loss_fn)")
        parts, sizes, whole = split_nested(args[0], g)
        return StepCall(parts, sizes, True, partial(_model_loss, loss_fn), whole)
    except Exception:
        if comm is not None:
            with contextlib.suppress(Exception):  # (a comm that fails here: the batch's error is the one to see)
                comm.allreduce_small(np.array([math.nan]))
        raise


def _name(fn: Any) -> str:
    if isinstance(fn, nn.Module):
        return f"{type(fn).__name__}()"
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', type(fn).__name__)}".lstrip(".")


def _output_loss(loss_fn: Callable, model: nn.Module, part: tuple[Any, torch.Tensor],
                 device: torch.device) -> DeviceLoss:
    x, y = part
    out = model(*(to_device(t, device) for t in x)) if isinstance(x, tuple) else model(to_device(x, device))
    loss = loss_fn(out, to_device(y, device))
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"loss_fn must return a scalar tensor (mean-reduced), got {shape}; "
                        f"use reduction='mean' or call .mean() on the loss")
    _check_trainable(loss, "the loss")
    return DeviceLoss(loss, None)


def _model_loss(loss_fn: Callable, model: nn.Module, part: Any, device: torch.device) -> DeviceLoss:
    result = loss_fn(model, to_device(part, device))
    if isinstance(result, (tuple, list)) and len(result) == 2:
        loss_sum, count = result
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
            raise TypeError(f"loss_fn returned a pair; its first element must be a scalar tensor, the "
                            f"sum of the loss over the part's items, got {_kind(loss_sum)}")
        _check_trainable(loss_sum, "the pair's loss_sum")
        return DeviceLoss(loss_sum, _count(count, loss_sum.device))
    if not isinstance(result, torch.Tensor) or result.dim() != 0:
        raise TypeError(f"loss_fn(model, batch) must return a scalar loss tensor (the mean over the "
                        f"part's samples) or a pair (loss_sum, count), got {_kind(result)}; for a "
                        f"Hugging Face model return model(**batch).loss")
    _check_trainable(result, "the loss")
    return DeviceLoss(result, None)


def _check_trainable(loss: torch.Tensor, what: str) -> None:
    if not loss.is_floating_point() or not loss.requires_grad:
        raise ValueError(f"{what} does not depend on any trainable parameter (no grad_fn); "
                         f"check that loss_fn uses the model's output")


def _count(count: Any, device: torch.device) -> float | torch.Tensor:
    """A device tensor stays there as float64 (checked with the losses); a number or host tensor is checked now."""
    if isinstance(count, torch.Tensor) and count.numel() == 1 and count.dtype != torch.bool:
        if count.device == _HOST != device:
            value = float(count.detach())  # host memory: no wait
        else:
            return count.detach().reshape(()).to(torch.float64)
    elif isinstance(count, (int, float, np.integer, np.floating)) and not isinstance(count, bool):
        value = float(count)
    elif isinstance(count, torch.Tensor) and count.dtype == torch.bool:
        raise TypeError(f"loss_fn returned a pair whose count is a bool tensor of shape {tuple(count.shape)}; "
                        f"return the number of items summed, e.g. mask.sum()")
    else:
        raise TypeError(f"loss_fn returned a pair; its second element must be the number of items "
                        f"summed (an int or a one-element tensor), got {_kind(count)}")
    check_counts([value])
    return value


_HOST = torch.device("cpu")


def check_counts(counts: Sequence[float], total: float | None = None) -> None:
    """Every count a finite number >= 0, and their ``total`` (if given) > 0."""
    for value in counts:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"loss_fn returned a count of {value}; it must be a finite number >= 0")
    if total is not None and not total > 0:
        raise ValueError("loss_fn's counts sum to 0 over the global batch: there is nothing to average "
                         "(every item masked out?)")


def _total(counts: Sequence[float | torch.Tensor], device: torch.device) -> float | torch.Tensor:
    """``sum(counts)`` in Python's order, in float64, on ``device`` if a count is a tensor: the host's value."""
    total: float | torch.Tensor = 0
    for c in counts:
        if isinstance(c, torch.Tensor):
            c = c.to(device, non_blocking=True)  # device to device, or the device's own: no host wait
        total = total + c
    return total


def read_at_once(values: Sequence[float | torch.Tensor], device: torch.device) -> list[float]:
    """``values`` as floats, the tensors gathered on ``device`` as float64 and read in one host wait."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    with torch.no_grad():
        gathered = torch.stack([t.detach().reshape(()).to(device, torch.float64, non_blocking=True) for t in tensors])
    read = iter(gathered.tolist())  # note: CPU-GPU sync point, one for all of them
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


@dataclass
class DeviceWeight:
    """1 / C while the counts are on the devices; the step's one read checks them (``passes.loss_values``)."""
    total: torch.Tensor
    """C, float64, on the first device."""
    counts: list[float | torch.Tensor]
    """Every count of the step (each device's, each micro-batch's)."""
    per_device: list[torch.Tensor]
    """1 / C (float64) on each device, for its backward and its held micro-batches' rescale."""


def _kind(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def loss_weights(results: Sequence[DeviceLoss], sample_weights: list[float], comm: Comm | None,
                 nested: bool, held: HeldMicroBatches, read: bool = False) -> list[float | DeviceWeight]:
    """Each device's backward weight once every forward is done; ``held`` adds the earlier micro-batches' counts. The
    counts are read before backward with MPI or ``read`` (``update="host"`` steps its optimizer during backward)."""
    counts = [r.count for r in results if r.count is not None]
    mpi = comm is not None and nested
    if not counts and not held.pairs and not mpi:
        return sample_weights  # means over samples only, on this rank alone: nothing to add up
    first = results[0].loss.device
    vec = np.array([0.0, len(counts) + held.pairs, len(results) + len(held.values)], np.float64)
    count, counts = _total([_total(counts, first), held.count], first), held.counts + counts
    if isinstance(count, torch.Tensor) and (mpi or read):  # read this rank's counts, in one wait
        count, *values = read_at_once([count, *counts], first)
        check_counts(values)
    if mpi:  # every rank passes here: the sum is over all of them
        vec[0] = count
        vec = comm.allreduce_small(vec)
        count = float(vec[0])
    pairs, devices = int(vec[1]), int(vec[2])
    if pairs == 0:
        return sample_weights
    if pairs != devices:
        where = "devices and micro-batches" if held.values else "devices"
        raise TypeError(f"loss_fn returned (loss_sum, count) on {pairs} of {devices} {where} and a scalar "
                        f"on the others; return the same form on every device")
    if not isinstance(count, torch.Tensor):
        check_counts([], count)
        return [1.0 / count] * len(results)
    w = count.reciprocal()  # 1 / C in float64, correctly rounded, as on the host
    per_device = [w.to(r.loss.device, non_blocking=True) for r in results]  # device to device
    return [DeviceWeight(count, counts, per_device)] * len(results)


@dataclass
class HeldMicroBatches:
    """Micro-batches 1..k-1 of a step: their gradients add up in the flat buffers, nothing sent until the k-th backward.

    Pairs need 1 / C, known only after the last forward: device j runs its earlier backwards with 1 / guess_j (its first
    count times k, a scale that keeps 16-bit gradients in range) and multiplies what it holds by guess_j / C before the
    last backward. Device-tensor counts keep all of this on the device.
    """
    devices: int
    k: int
    values: list[float] = field(default_factory=list)
    """Each earlier micro-batch's loss value, per device (round by round): one per earlier loss."""
    used: list[float | torch.Tensor] = field(default_factory=list)
    """The weight each of those backwards ran with, for mean losses (final; pairs' are replaced by 1 / C)."""
    count: float | torch.Tensor = 0.0
    """This rank's summed counts of the earlier micro-batches (on the first device if one is a tensor)."""
    counts: list[float | torch.Tensor] = field(default_factory=list)
    """Each of those counts (checked when read)."""
    pairs: int = 0
    """How many of the earlier micro-batches' losses were pairs."""
    guess: list[float | torch.Tensor] | None = None
    seconds: float = 0.0

    def weights(self, results: Sequence[DeviceLoss], sample_weights: list[float]) -> list[float | torch.Tensor]:
        """The weights one earlier round's backwards run with."""
        pairs = sum(r.count is not None for r in results)
        self.pairs += pairs
        losses = len(self.values) + len(results)  # (this round's values come after its backwards)
        if self.pairs not in (0, losses):
            raise TypeError(f"loss_fn returned (loss_sum, count) on {self.pairs} of {losses} devices "
                            f"and micro-batches and a scalar on the others; return the same form on every device")
        if not pairs:
            self.used += sample_weights
            return sample_weights
        counts = [r.count for r in results]
        if self.guess is None:  # max(count, 1) * k, on the count's device if it is there
            self.guess = [c.clamp(min=1.0) * self.k if isinstance(c, torch.Tensor) else max(c, 1.0) * self.k
                          for c in counts]
        first = results[0].loss.device
        self.count = _total([self.count, _total(counts, first)], first)
        self.counts += counts
        return [g.reciprocal() if isinstance(g, torch.Tensor) else 1.0 / g for g in self.guess]

    def rescale(self, final: float | DeviceWeight) -> list[torch.Tensor | None]:
        """Per device, the factor its held gradients take once 1 / C is known (float64, where a count is)."""
        if self.guess is None:
            return [None] * self.devices
        if isinstance(final, DeviceWeight):
            return [guess * w for guess, w in zip(self.guess, final.per_device)]
        return [guess * final if isinstance(guess, torch.Tensor) else torch.tensor(guess * final, dtype=torch.float64)
                for guess in self.guess]

    def final_weights(self, final: float | DeviceWeight) -> list[float | DeviceWeight]:
        """The weight of each earlier loss value in the step's loss."""
        return [final] * len(self.values) if self.guess is not None else self.used


def backward_weight(w: float | torch.Tensor | DeviceWeight, dtype: torch.dtype, device: torch.device,
                    j: int = 0) -> torch.Tensor:
    """``w`` in the loss's dtype on ``device``, rounded once; a float64 tensor is rounded there, with no host wait."""
    if isinstance(w, DeviceWeight):
        w = w.per_device[j]
    if isinstance(w, torch.Tensor):
        return rounded_once(w, dtype)
    if dtype in _SIXTEEN:  # on the host (host tensors: no wait)
        w = rounded_once(torch.tensor(w, dtype=torch.float64), dtype).item()
    # exact: the value is representable in dtype, so torch.full's conversion does not round it
    return torch.full((), w, dtype=dtype, device=device)


_SIXTEEN = (torch.bfloat16, torch.float16)


def rounded_once(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 scalar ``w`` rounded once to ``dtype`` (nearest, ties to even), where it is.

    torch goes float64 → float32 → 16 bits, two roundings (1 + 2**-8 + 2**-30 ends at 1, not 1 + 2**-7). Rounding to
    float32 *to odd* first (toward zero, last bit set if inexact) makes the second rounding the correct one.
    """
    if dtype not in _SIXTEEN:
        return w.to(dtype)  # one rounding (or none)
    f = w.to(torch.float32)
    away = f.to(torch.float64).abs() > w.abs()  # rounded away from zero: one step back toward it
    bits = f.view(torch.int32) - away.to(torch.int32)  # (sign and magnitude: -1 shrinks the magnitude)
    inexact = bits.view(torch.float32).to(torch.float64) != w
    return (bits | inexact.to(torch.int32)).view(torch.float32).to(dtype)
