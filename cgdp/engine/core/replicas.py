"""One replica of the model, one optimizer, per device; and what every MPI rank must agree on.

The user's model is replica 0, moved to the first device in place, as DDP trains the module it wraps; every other device
gets a deep copy made before training, so all begin bitwise identical, each with an optimizer from the user's factory.
Parameters are listed in engine order (layers in forward order), the order of the flat buffer's views.
"""
from __future__ import annotations

import copy
import hashlib
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from cgdp.comm import Comm
from cgdp.engine.backend.base import Device
from cgdp.engine.core.layers import LayerInfo, find_layers
from cgdp.engine.core.user_warning import warn_user


class Replicas:
    """``modules[j]``, ``params[j]`` (engine order), ``optimizers[j]``, ``buffers[j]`` (floating), ``other_buffers[j]``.
    """

    def __init__(self, model: nn.Module, devs: Sequence[Device],
                 optimizer: Callable[..., torch.optim.Optimizer]):
        self.modules: list[nn.Module] = make_replicas(model, devs)
        self.params: list[list[nn.Parameter]] = [[p for layer in find_layers(r)[1] for p in layer]
                                                 for r in self.modules]
        self.optimizers: list[torch.optim.Optimizer] = []
        for r in self.modules:
            opt = optimizer(r.parameters())
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizer(params) must return a torch.optim.Optimizer, got "
                                f"{type(opt).__name__}")
            self.optimizers.append(opt)
        self.buffers, self.other_buffers = split_buffers(self.modules)


def make_replicas(model: nn.Module, devs: Sequence[Device]) -> list[nn.Module]:
    """``model`` moved to ``devs[0]`` in place, and a deep copy on every other device (made first: none on devs[0])."""
    copies = [copy.deepcopy(model).to(dev.torch_device) for dev in devs[1:]]
    leaves = {n: b for n, b in model.named_buffers() if b.is_leaf and b.requires_grad}
    model.to(devs[0].torch_device)
    moved = [n for n, b in model.named_buffers() if n in leaves and b is not leaves[n] and not b.is_leaf]
    if moved:  # torch's own Module.to does this silently; the user would find .grad None after backward
        warn_user(f"buffer(s) {', '.join(moved)} require grad and were moved to {devs[0].name} by wrapping, as "
                  f"model.to() moves them, which makes each a non-leaf tensor: the gradient goes to the tensor it "
                  f"was moved from, and the buffer's own .grad stays None. Create them on {devs[0].name} before "
                  f"wrapping, or make them nn.Parameter")
    return [model, *copies]


def split_buffers(modules: Sequence[nn.Module]) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Per replica: its floating buffers, and the others."""
    return ([[b for b in r.buffers() if b.is_floating_point()] for r in modules],
            [[b for b in r.buffers() if not b.is_floating_point()] for r in modules])


def signature(face: str, model: nn.Module, layers: Sequence[LayerInfo], devices: int, dtype: torch.dtype | None,
              **more: str) -> dict[str, str]:
    """What every MPI rank must share (``Comm.check_same``): face, devices per rank, parameters, layers, dtype, more."""
    return {"face": face, "devices_per_rank": str(devices),
            "initial_parameters": state_digest(model) + " (seed every rank the same)",
            "layers": ";".join(f"{i.name}:{i.numels}" for i in layers), "dtype": str(dtype), **more}


def settings(**values: Any) -> dict[str, str]:
    """Constructor settings for :func:`signature`, under their argument names (what a mismatch error names)."""
    return {f"setting {k}": repr(v) for k, v in values.items()}


def state_digest(module: nn.Module) -> str:
    """A short hash of the module's parameters and buffers (names and bits)."""
    digest = hashlib.sha256()
    for name, t in module.state_dict().items():
        digest.update(name.encode())
        digest.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def batch_weights(sizes: list[int], comm: Comm | None) -> tuple[list[float], int]:
    """Each device's share of the global batch (over all ranks), and the global batch size."""
    total = sum(sizes)
    if comm is not None:
        reduced = float(comm.allreduce_small(np.array([total], np.float64))[0])
        if math.isnan(reduced):  # a rank that refused its batch joined with NaN (trainer.losses.parse_step)
            raise ValueError("another rank refused this step's batch (an empty batch, or one it could not "
                             "split: its own error says which): every rank refuses this step")
        total = int(reduced)
    return [n / total for n in sizes], total
