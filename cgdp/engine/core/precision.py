"""Gradient dtypes on the host: what the devices send, what the host sums in, what goes back.

float32/float64 are summed in place in their dtype, no conversion anywhere. bfloat16/float16 are widened exactly by the
kernel, summed (and allreduced) in float32 and rounded **once** to nearest even into the copy-back row. NumPy has no
bfloat16: the kernel reads its bits (``uint16``, :func:`host_array`).
"""
from __future__ import annotations

import numpy as np
import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
PARAMETER_DTYPES = (torch.float32, torch.float64, *LOW_PRECISION)


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the host sums gradients of ``dtype`` in."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def host_array(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as the array the kernel reads (bf16 as ``uint16`` bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def kernel_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of parts of ``dtype`` as the kernel sees them."""
    return host_array(torch.empty(0, dtype=dtype)).dtype
