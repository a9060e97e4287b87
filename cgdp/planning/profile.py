"""What one iteration cost, as the engine measured it: the paper's Tables 3 and 4 for any model.

Filled by the engine when profiling is on (``Trainer(profile=True)`` or ``trainer.profile_next()``),
from device events on CUDA and ``time.perf_counter`` on emulated devices. Planning code (tuner,
simulator, planner) reads it; it never touches the runtime.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class ChunkTiming:
    index: int
    """Position in the plan (send order)."""
    layers: list[int]
    """Layer indices (forward numbering) in this chunk."""
    bytes: int
    """Gradient bytes of the chunk (one device's copy)."""
    d2h_s: float = 0.0
    """Device-to-host copy time, mean over devices."""
    acc_s: float = 0.0
    """Host accumulation time (all devices' contributions)."""
    comm_s: float = 0.0
    """Allreduce time between machines (0 on one machine)."""
    h2d_s: float = 0.0
    """Host-to-device copy time, mean over devices."""
    sent_s: float = 0.0
    """When the chunk's D2H copy started, seconds after backward started (mean over devices)."""
    back_s: float = 0.0
    """When the chunk was back on every device, seconds after backward started."""


@dataclass
class StepProfile:
    devices: int
    """Devices on this machine."""
    ranks: int
    """Machines (MPI ranks)."""
    mode: str
    layer_bytes: list[int]
    """Gradient bytes per layer, forward numbering."""
    layer_ready_s: list[float]
    """Per layer: seconds from the start of backward until its gradient was complete (its hook
    fired), max over devices; ``nan`` for a layer that got no gradient."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    """Backward compute (max over devices), from the backward call to the last hook."""
    exposed_comm_s: float = 0.0
    """From the end of backward until the averaged gradient was back on every device."""
    update_s: float = 0.0
    step_s: float = 0.0
    plan: list[list[int]] = field(default_factory=list)
    chunks: list[ChunkTiming] = field(default_factory=list)
    host_registered_bytes: int = 0
    """Host memory registered (pinned) for the slots and the sum."""
    host_bytes_moved: int = 0
    """Host memory traffic of one step's gradient path: the devices' writes into the slots, the
    sum's reads and writes, the copies back's reads ((3G + 1) x the gradient bytes in float32)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepProfile":
        d = dict(d)
        d["chunks"] = [ChunkTiming(**c) for c in d.get("chunks", [])]
        return cls(**d)
