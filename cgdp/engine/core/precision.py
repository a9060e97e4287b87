"""Gradient dtypes on the host: what the devices send, what the host sums in, what goes back.

Parameters (and so the devices' flat gradient buffers) are float32, float64, bfloat16 or float16; one dtype per model.
The host receives each device's chunk in the parameters' dtype and sums:

* float32 / float64: in that dtype, in place in the accumulator row, which is also what is copied back (no conversion
  anywhere);
* bfloat16 / float16: widened exactly to float32 by the kernel while it reads (no scratch copy), summed (and allreduced
  across ranks) in float32, then rounded **once** to the parameters' dtype (round to nearest even, as
  ``tensor.to(dtype)``) into the copy-back row. The gradient a replica receives is the float32 average rounded once, not
  a chain of 16-bit additions.

NumPy (and Numba) have no bfloat16: the kernel reads bf16 as its bits (``uint16``); :func:`host_array` gives that view.
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
