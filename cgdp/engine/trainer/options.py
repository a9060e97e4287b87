"""``cgdp.Trainer``'s modes, and its arguments checked before anything is built.

A mode is its update strategy (:mod:`cgdp.engine.core.update`, via :data:`UPDATES`); nothing else looks at the mode's
name. ``update="host"`` replaces it by :class:`~cgdp.engine.core.host_update.HostUpdate` (``Checked.strategy``).
:func:`check_arguments` checks every argument that needs no device, first wrong one reported, before anything exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from cgdp.engine.backend import parse_devices
from cgdp.engine.core.clip import check_max_norm
from cgdp.engine.core.host_update import HostUpdate, check_host_update
from cgdp.engine.core.layers import LayerInfo, find_layers, trainable_dtype
from cgdp.engine.core.stream import check_sizes, wire_dtype
from cgdp.engine.core.update import PerReplica, Typical, Update
from cgdp.engine.trainer.batch import check_micro_batches
from cgdp.engine.sync import check_timeout

UPDATES: dict[str, Callable[..., Update]] = {
    "cgdp": PerReplica,                           # host averaging during backward; each device steps
    "typical": Typical,                           # device 0 gathers, steps and broadcasts (§2.3)
    "single": partial(PerReplica, streams=False),  # one device, nothing leaves it
}
MODES = tuple(UPDATES)


@dataclass(frozen=True)
class Checked:
    """What the checks found out about the model and the options."""

    layers: list[LayerInfo]
    """The model's layers (modules that directly own trainable parameters), in forward order."""
    layer_params: list[list[nn.Parameter]]
    dtype: torch.dtype
    """The one dtype of the trainable parameters (the flat buffers')."""
    transfer: torch.dtype | None
    """The dtype gradients travel in, when it is not ``dtype`` (``grad_transfer``)."""
    max_norm: float | None
    micro_batches: int
    host_update: bool
    """``update="host"``: one optimizer over float32 masters in host memory."""
    strategy: Callable[..., Update]
    """The mode's update strategy, or the host optimizer over the factory's optimizer (``update="host"``)."""


def check_arguments(model: Any, optimizer: Any, devices: Sequence[str], *, mode: str, share_devices: bool,
                    grad_transfer: str | None, timeout_s: float | None, segment_bytes: int,
                    clip_grad_norm: float | None, micro_batches: int, update: str = "devices",
                    comm: Any = None) -> Checked:
    """Raise ``ValueError`` or ``TypeError`` for the first argument of ``Trainer(...)`` that is wrong."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a callable that takes parameters and returns an optimizer, "
                        "e.g. lambda params: torch.optim.SGD(params, lr=0.1), so that each replica "
                        "gets its own")
    parse_devices(devices, share_devices)
    if mode != "cgdp" and comm is not None:
        raise ValueError(f"mode={mode!r} averages the gradient on this machine's devices only (nothing of it "
                         f"crosses machines), so ranks would train apart: with comm=, use mode='cgdp', whose "
                         f"host sum is what the ranks allreduce")
    if mode == "single" and len(devices) != 1:
        raise ValueError(f"mode='single' trains on one device; got {len(devices)} devices. "
                         f"Pass one device, or use mode='cgdp' for several")
    infos, layer_params = find_layers(model)
    if not any(info.numel for info in infos):
        raise ValueError("the model has no trainable parameters (none with requires_grad=True); "
                         "there is nothing to train")
    dtype = trainable_dtype(layer_params)
    transfer = wire_dtype(grad_transfer, dtype, mode)
    host_update = check_host_update(update, dtype)
    if host_update and mode != "cgdp":
        raise ValueError(f"update='host' steps on the gradient the host sums during backward, which "
                         f"mode={mode!r} does not stream: use mode='cgdp' (one device or several)")
    check_timeout(timeout_s)
    check_sizes(segment_bytes, None)  # host_memory: where the ring is sized (core.stream.ring_slots)
    return Checked(infos, layer_params, dtype, transfer, check_max_norm(clip_grad_norm),
                   check_micro_batches(micro_batches), host_update,
                   partial(HostUpdate, factory=optimizer) if host_update else UPDATES[mode])


def refusal(what: str, running: str, inside: bool) -> str:
    if inside:
        return (f"{what} was called from a device thread, i.e. from inside loss_fn or the model's forward; "
                f"call it after step() has returned")
    return (f"{what} was called from another thread while one is running; a Trainer takes one call at a "
            f"time: serialise the calls with a lock, or use one Trainer per thread")


def stopped(running: str) -> str:
    return ("Trainer.close() was called from another thread while a call was running; that call stopped "
            "(nothing applied unless its update had begun) and the Trainer is closed")
