"""Gradient clipping on every replica, exactly as ``torch.nn.utils.clip_grad_norm_`` on one device.

``coef = max_norm / (norm + 1e-6)``, clamped to 1 and multiplied into every gradient (including when it is 1, as torch
does). The norm comes from the host accumulator (:meth:`cgdp.engine.core.stream.GradientStream.grad_norm`) or, without
one, from :func:`device_norm`. Both faces use it: ``Trainer(clip_grad_norm=...)`` and ``DataParallel.clip_grad_norm_``.
"""
from __future__ import annotations

import torch

_HOST = torch.device("cpu")


def check_max_norm(max_norm: float | None) -> float | None:
    if max_norm is None:
        return None
    # inf is allowed, as in torch: the norm is measured (stats["grad_norm"]), nothing is scaled
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm must be a positive number (the max 2-norm; inf to only "
                         f"measure the norm) or None, got {max_norm!r}")
    return float(max_norm)


def clip_coefficient(norm: float, max_norm: float | None) -> torch.Tensor | None:
    """``min(1, max_norm / (norm + 1e-6))``, computed in float32 as torch's clip_grad_norm_ does for float32 gradients;
    ``None`` without clipping (``max_norm`` None)."""
    if max_norm is None:
        return None
    total = torch.tensor(norm, dtype=torch.float32)
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def device_norm(flat: torch.Tensor, read: bool = True) -> float | torch.Tensor:
    """The 2-norm of one flat gradient buffer, accumulated in float64 (no host accumulator); ``read=False``: the float64
    scalar on the buffer's device, for the caller to read with others."""
    norm = torch.linalg.vector_norm(flat, dtype=torch.float64)
    return float(norm) if read else norm  # note: CPU-GPU sync point where read


def scale_gradients(flat: torch.Tensor, coef: torch.Tensor) -> None:
    """``flat *= coef`` on its device (every gradient is a view into ``flat``)."""
    if coef.device != flat.device:
        # from the host: made on the device, its value a kernel argument (a host tensor copied with non_blocking=True
        # comes from pageable memory, blocking the host until the stream has caught up: a hidden sync in every clipped
        # step); device to device: no host synchronisation
        coef = (torch.full((), coef.item(), dtype=coef.dtype, device=flat.device) if coef.device == _HOST
                else coef.to(flat.device, non_blocking=True))
    flat.mul_(coef)
