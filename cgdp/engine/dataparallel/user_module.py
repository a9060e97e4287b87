"""What ``DataParallel`` keeps on the user's module (replica 0), and what it must not leave there.

* **A load hook that stays in this process**: :class:`cgdp.engine.core.follow.LocalHooks`, shared with ``Trainer``.
* **Buffers that require grad**: every replica reads replica 0's through a differentiable copy made at each forward
  (as ``nn.DataParallel``'s replicate), so autograd adds every part into replica 0's ``.grad``, exactly. The others'
  own copies stand in for it in the mirror optimizers, never getting a gradient.
"""
from __future__ import annotations

import torch
from torch import nn


class GradBuffers:
    def __init__(self, replicas: list[nn.Module]):
        self.names = [name for name, b in replicas[0].named_buffers() if b.requires_grad]
        # per replica: (submodule, attribute) of each such buffer
        self._slots = [[_owner(r, name) for name in self.names] for r in replicas]
        self.stand_ins = [self.current(j) for j in range(len(replicas))]  # the deep copy's (replica 0's: them)

    def __bool__(self) -> bool:
        return bool(self.names)

    def current(self, j: int) -> list[torch.Tensor]:
        return [getattr(m, a) for m, a in self._slots[j]]

    def refresh(self, devices: list[torch.device], used: int) -> None:
        first = self.current(0)
        for j in range(1, used):
            for (m, a), b in zip(self._slots[j], first):
                m._buffers[a] = b.to(devices[j])

    def parameter_maps(self) -> list[dict[int, torch.Tensor]]:
        first = self.current(0)
        return [{id(b): s for b, s in zip(first, stand)} for stand in self.stand_ins[1:]]


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr
