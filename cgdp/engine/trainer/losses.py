"""Step 2 of the data path: the loss of each device, and the weight its backward starts from.

``Trainer.step`` has two forms; :func:`parse_step` splits the batch for either and gives the
function each device's thread runs (:attr:`StepCall.compute`, with that device's replica):

* ``step(inputs, targets, loss_fn)``: ``loss_fn(model(*inputs_j), targets_j)``, the mean loss
  over device j's n_j samples.
* ``step(batch, loss_fn)``: ``loss_fn(model, batch_j)``, on the part of a nested batch
  (:func:`cgdp.engine.trainer.batch.split_nested`), moved to the device. It returns either a scalar, the
  mean over the part's samples, or a pair ``(loss_sum, count)``: a sum over the part's items
  (tokens) and how many there are.

Weights (:func:`loss_weights`, after every forward): a mean over samples gets w_j = n_j / N
(N the samples of all devices of all ranks), so Σ_j w_j·loss_j is the mean over the global batch
whatever the split. A pair gets w_j = 1 / C with C = Σ count over all devices and ranks, so
Σ_j loss_sum_j / C is the mean over the global batch's items, exactly the loss one device computes
on the whole batch (a padded language-model loss is a mean over tokens, not samples: weighting it
by samples is exact only when every part has as many tokens per sample as the global batch).
The counts are known only after every forward; with MPI, one small allreduce sums them (and checks
that every rank returned the same form).

The backward weight (:func:`backward_weight`) is computed in float64 and rounded once to the
loss's dtype: autograd needs a gradient of the loss's own dtype, and torch converts a Python float
to bfloat16/float16 through float32, which can round twice.

Autocast (:func:`cgdp.engine.core.threads.caller_context`): autocast state is thread-local, and forwards run on cgdp's
device threads; the caller's state for the devices' type is captured in ``step`` and entered again
around each device's forward and loss, as around a single-device forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
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
    count: float | None
    """The pair's count; None for a mean over the part's samples."""


@dataclass
class StepCall:
    parts: list[Any]
    """Device j's part of the batch (still on the caller's device)."""
    sizes: list[int]
    """Samples per part."""
    nested: bool
    """The two-argument form ``step(batch, loss_fn)``."""
    compute: Callable[[nn.Module, Any, torch.device], DeviceLoss]
    """``compute(replica, part, device)``: forward and loss, on the device's thread."""
    whole: frozenset[int] = frozenset()
    """Ids of the batch's tensors that every part holds whole (micro-batches keep them whole)."""


def parse_step(args: Sequence[Any], g: int) -> StepCall:
    """``step(batch, loss_fn)`` or ``step(inputs, targets, loss_fn)``, split for ``g`` devices."""
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
    if _is_output_loss(loss_fn):
        raise TypeError(f"step(batch, loss_fn) calls loss_fn(model, batch), but {_name(loss_fn)} takes "
                        f"(output, target); pass the targets too: step(inputs, targets, loss_fn)")
    parts, sizes, whole = split_nested(args[0], g)
    return StepCall(parts, sizes, True, partial(_model_loss, loss_fn), whole)


def _is_output_loss(fn: Any) -> bool:
    """A torch loss (``nn.CrossEntropyLoss()``, ``F.cross_entropy``): called as (output, target)."""
    return isinstance(fn, nn.modules.loss._Loss) or getattr(fn, "__module__", None) == "torch.nn.functional"


def _name(fn: Any) -> str:
    if isinstance(fn, nn.Module):
        return f"{type(fn).__name__}()"
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', type(fn).__name__)}".lstrip(".")


def _output_loss(loss_fn: Callable, model: nn.Module, part: tuple[Any, torch.Tensor],
                 device: torch.device) -> DeviceLoss:
    x, y = part
    if isinstance(x, tuple):
        out = model(*(to_device(t, device) for t in x))
    else:
        out = model(to_device(x, device))
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
        return DeviceLoss(loss_sum, _count(count))
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


def _count(count: Any) -> float:
    if isinstance(count, torch.Tensor) and count.numel() == 1 and count.dtype != torch.bool:
        value = float(count.detach())  # note: CPU-GPU sync point; the weights need every count
    elif isinstance(count, (int, float, np.integer, np.floating)) and not isinstance(count, bool):
        value = float(count)
    elif isinstance(count, torch.Tensor) and count.dtype == torch.bool:
        raise TypeError(f"loss_fn returned a pair whose count is a bool tensor of shape {tuple(count.shape)}; "
                        f"return the number of items summed, e.g. mask.sum()")
    else:
        raise TypeError(f"loss_fn returned a pair; its second element must be the number of items "
                        f"summed (an int or a one-element tensor), got {_kind(count)}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"loss_fn returned a count of {value}; it must be a finite number >= 0")
    return value


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def loss_weights(results: Sequence[DeviceLoss], sample_weights: list[float], comm: Comm | None,
                 nested: bool, held: "HeldMicroBatches | None" = None) -> list[float]:
    """Each device's backward weight, once every forward is done (see the module docstring);
    ``held``: the step's earlier micro-batches, whose counts add to the total."""
    pairs = sum(r.count is not None for r in results)
    vec = np.array([sum(r.count or 0.0 for r in results), pairs, len(results)], np.float64)
    if held is not None:
        vec += (held.count, held.pairs, held.results)
    if comm is not None and nested:  # every rank passes here: the sum is over all of them
        vec = comm.allreduce_small(vec)
    count, pairs, devices = float(vec[0]), int(vec[1]), int(vec[2])
    if pairs == 0:
        return sample_weights
    if pairs != devices:
        where = "devices and micro-batches" if held is not None and held.results else "devices"
        raise TypeError(f"loss_fn returned (loss_sum, count) on {pairs} of {devices} {where} and a scalar "
                        f"on the others; return the same form on every device")
    if count <= 0:
        raise ValueError("loss_fn's counts sum to 0 over the global batch: there is nothing to average "
                         "(every item masked out?)")
    return [1.0 / count] * len(results)


@dataclass
class HeldMicroBatches:
    """Micro-batches 1..k-1 of a step (``micro_batches=k``): their gradients add up in the devices'
    flat buffers and nothing is sent; the k-th backward sends the total.

    A mean over samples is weighted as without micro-batches (its samples / N). A pair
    ``(loss_sum, count)`` needs 1 / C, C the count of every micro-batch of every device (and
    rank), known only after the last forward, when the earlier backwards have run. So device j
    runs its earlier backwards with weight 1 / guess_j (its first micro-batch's count times k:
    a scale of the right order, so that 16-bit gradients neither overflow nor underflow) and,
    once C is known, multiplies what it holds by guess_j / C before the last backward (one pass
    over its flat buffer, on the device). The result is sum_i grad(loss_sum_i) / C, the token mean
    of the whole batch, to two roundings; the host sees only the k-th backward, as before.
    """
    devices: int
    k: int
    values: list[float] = field(default_factory=list)
    """Each earlier micro-batch's loss value, per device (round by round)."""
    used: list[float] = field(default_factory=list)
    """The weight each of those backwards ran with (mean losses: final)."""
    count: float = 0.0
    """This rank's summed counts of the earlier micro-batches (pairs)."""
    pairs: int = 0
    """How many of the earlier micro-batches' losses were pairs."""
    results: int = 0
    """How many earlier losses there were (devices x rounds)."""
    guess: list[float] | None = None
    seconds: float = 0.0

    def weights(self, results: Sequence[DeviceLoss], sample_weights: list[float]) -> list[float]:
        """The weights one earlier round's backwards run with."""
        pairs = sum(r.count is not None for r in results)
        self.pairs += pairs
        self.results += len(results)
        if self.pairs not in (0, self.results):
            raise TypeError(f"loss_fn returned (loss_sum, count) on {self.pairs} of {self.results} devices "
                            f"and micro-batches and a scalar on the others; return the same form on every device")
        if not pairs:
            self.used += sample_weights
            return sample_weights
        if self.guess is None:
            self.guess = [max(r.count, 1.0) * self.k for r in results]
        self.count += sum(r.count for r in results)
        w = [1.0 / guess for guess in self.guess]
        self.used += w
        return w

    def rescale(self, final: float) -> list[torch.Tensor | None]:
        """Per device, the factor its held gradients take once the final weight 1 / C is known."""
        if self.guess is None:
            return [None] * self.devices
        return [torch.tensor(guess * final, dtype=torch.float64) for guess in self.guess]

    def final_weights(self, final: float) -> list[float]:
        """The weight of each earlier loss value in the step's loss."""
        return [final] * len(self.values) if self.guess is not None else self.used


def backward_weight(w: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``w`` as a scalar of the loss's dtype, rounded once to nearest (ties to even)."""
    value = w
    if dtype in (torch.bfloat16, torch.float16) and w > 0:
        # torch rounds a float to float32 first, then to 16 bits: a second rounding; pick the
        # nearest of that result and its two neighbours (w > 0: adjacent bit patterns are
        # adjacent values), exactly, ties to the even pattern
        bits = int(torch.tensor(w, dtype=torch.float64).to(dtype).view(torch.int16))
        near = [(v, b) for b in (bits - 1, bits, bits + 1)
                if math.isfinite(v := float(torch.tensor(b, dtype=torch.int16).view(dtype)))]
        value = min(near, key=lambda vb: (abs(Fraction(vb[0]) - Fraction(w)), vb[1] & 1))[0]
    # exact: the value is representable in dtype, so torch.full's conversion does not round it
    return torch.full((), value, dtype=dtype, device=device)
