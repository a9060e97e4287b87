"""``memory_report()`` of both faces: bytes each device, and the host, hold for training, counted from the tensors
(emulated devices live in host memory, where ``torch.cuda.memory_allocated`` says nothing).

* ``"parameters"``: the replica's trainable parameters (host: ``update="host"``'s float32 masters);
* ``"gradients"``: the flat buffer and gradients outside it (sparse); on the host, buffers besides the rows;
* ``"optimizer_state"``: the state of the optimizers stepping this replica (host: the host optimizer's, with both
  sides of its flat moments);
* ``"transfer"``: the bf16 stage on a device; the registered slots, sum row and bf16 masters' copy on the host.

A GPU also reports ``"allocated"`` (``torch.cuda.memory_allocated``: everything the process holds there; so far run only
with a stand-in, never on a GPU). Keys: the device strings as given, and ``"host"``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return _nbytes([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])


def _nbytes(ts: Sequence[torch.Tensor | None]) -> int:
    return sum(t.nbytes for t in ts if t is not None)


def grad_bytes(params: Sequence[torch.Tensor], flat: torch.Tensor | None) -> int:
    """The flat buffer, and every ``.grad`` that is not a view into it."""
    total = _nbytes([flat])
    ptr = flat.untyped_storage().data_ptr() if flat is not None and flat.numel() else None
    for g in [p.grad for p in params if p.grad is not None]:
        if g.is_sparse:
            g = g.coalesce()
            total += _nbytes([g._values(), g._indices()])
        elif ptr is None or g.untyped_storage().data_ptr() != ptr:
            total += _nbytes([g])
    return total


def allocated(name: Any) -> int | None:
    """``torch.cuda.memory_allocated`` of ``"cuda:N"`` from cgdp's runtime; None for other devices or without one."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        return None
    if dev.type != "cuda":
        return None
    from cgdp.engine.backend.cuda_runtime import runtime
    rt = runtime()
    fn = getattr(rt.cuda, "memory_allocated", None)
    return None if fn is None else int(fn(rt.torch_device(dev.index or 0)))


def memory_report(devices: Sequence[str], params: Sequence[Sequence[torch.Tensor]],
                  optimizers: Sequence[Sequence[torch.optim.Optimizer]], stream: Any,
                  host_update: Any = None) -> dict[str, dict[str, int]]:
    """``optimizers[j]``: those stepping replica j; ``stream``: or None; ``host_update``: ``(HostMasters, host
    optimizers)``."""
    flats = stream.flats if stream is not None and stream.flats else [None] * len(devices)
    stages = stream.stages if stream is not None and stream.stages else [None] * len(devices)
    out: dict[str, dict[str, int]] = {}
    for j, name in enumerate(devices):
        out[str(name)] = {
            "parameters": _nbytes(list(params[j])),
            "gradients": grad_bytes(params[j], flats[j]),
            "optimizer_state": sum(optimizer_state_bytes(o) for o in optimizers[j]),
            "transfer": _nbytes([stages[j]]),
        }
        gpu = allocated(name)
        if gpu is not None:
            out[str(name)]["allocated"] = gpu
    host = {"parameters": 0, "gradients": 0, "optimizer_state": 0,
            "transfer": stream.host.registered_bytes if stream is not None and stream.host is not None else 0}
    if host_update is not None:
        masters, opts = host_update
        host.update(parameters=masters.flat.nbytes, gradients=_nbytes([masters.staged, masters.wide]),
                    optimizer_state=sum(optimizer_state_bytes(o) for o in opts) + masters.unshown_bytes())
        if masters.wire is not None:  # the masters' bf16 rounding, sent to the devices
            host["transfer"] += _nbytes([masters.wire.flat16])
    out["host"] = host
    return out
