"""Step 1 of the data path: split the global batch across devices, and weight each part.

The batch is split in device order as ``torch.tensor_split`` does. Device j gets weight
``w_j = n_j / N``, N the global batch over all ranks, so that the sum of the devices' weighted
gradients is the gradient of the global mean loss, also for uneven splits.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cgdp.comm import Comm

Part = tuple[Any, torch.Tensor]
"""One device's ``(inputs, targets)``; inputs a tensor or a tuple of tensors."""


def split_batch(inputs: Any, targets: Any, g: int) -> tuple[list[Part], list[int]]:
    """``(inputs, targets)`` split in device order into ``g`` parts, and each part's size."""
    xs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not xs or not all(isinstance(x, torch.Tensor) for x in xs):
        raise TypeError("inputs must be a tensor (or a tuple of tensors passed as model(*inputs)) "
                        "whose first dimension is the batch")
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a tensor whose first dimension is the batch, got "
                        f"{type(targets).__name__}")
    n = xs[0].shape[0] if xs[0].dim() else 0
    for x in (*xs, targets):
        if x.dim() == 0 or x.shape[0] != n:
            raise ValueError(f"inputs and targets must share the batch dimension; got shapes "
                             f"{[tuple(t.shape) for t in (*xs, targets)]}")
    if n < g:
        raise ValueError(f"a batch of {n} sample(s) cannot be split across {g} devices; "
                         f"use a batch of at least {g} (one sample per device)")
    split_x = [torch.tensor_split(x, g) for x in xs]
    split_y = torch.tensor_split(targets, g)
    parts = []
    for j in range(g):
        xj = tuple(s[j] for s in split_x)
        parts.append((xj if isinstance(inputs, (tuple, list)) else xj[0], split_y[j]))
    return parts, [int(s.shape[0]) for s in split_y]


def batch_weights(sizes: list[int], comm: Comm | None) -> tuple[list[float], int]:
    """Each device's share of the global batch (over all ranks), and the global batch size."""
    total = sum(sizes)
    if comm is not None:
        total = int(comm.allreduce_small(np.array([total], np.float64))[0])
    return [n / total for n in sizes], total
