"""What an iteration costs: the inputs of :mod:`cgdp.planning.simulator` and :mod:`cgdp.planning.flowshop`.

* :class:`Linear` prices one operation on ``n`` bytes as ``latency_s + n * per_byte_s`` (α + β·n);
  nothing (0 bytes) costs nothing. Every copy, sum, DRAM pass and MPI allreduce is one.
* :class:`ModelCosts` is what one device computes in one iteration, measured by the engine's
  profile: per layer (forward numbering) its gradient bytes and backward time, and ``order``, the
  order backward completes the layers (a permutation of 0..L-1; default L-1, ..., 0). It does not
  depend on the chunk plan.
* :class:`StageCosts` is what synchronising, moving and adding a chunk costs on one machine (and
  between machines): fitted from profiles by :mod:`cgdp.planning.calibrate`, or derived from a
  hardware description by :mod:`cgdp.planning.hardware`. Copy costs are those of one device on an
  unshared link; link sharing (``link_groups``) and cores shared with emulated devices
  (``shared_cores``) are applied by the models that read them.

Data and what follows from it alone (segments per chunk, host CPU per chunk, threads per task
kind, devices per link); what the fields mean in time is the simulator's model (its module
docstring). Not to be confused with :mod:`cgdp.planning.costmodel`, the paper's closed formulas
over per-layer times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Linear:
    """The cost of one operation on ``n`` bytes: ``latency_s + n * per_byte_s``."""

    latency_s: float = 0.0
    """Fixed cost per operation (launch, wake-up, message latency)."""
    per_byte_s: float = 0.0
    """Seconds per byte: 1 / bandwidth."""

    def __call__(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.per_byte_s if nbytes > 0 else 0.0

    @staticmethod
    def from_bandwidth(gb_per_s: float, latency_s: float = 0.0) -> "Linear":
        return Linear(latency_s, 1.0 / (gb_per_s * 1e9) if gb_per_s > 0 else 0.0)


@dataclass
class ModelCosts:
    """The work of one device in one iteration; the chunk plan does not change it."""

    layer_bytes: list[int]
    """Gradient bytes per layer, forward numbering."""
    backward_s: list[float]
    """Backward compute time per layer, forward numbering."""
    order: list[int] | None = None
    """Layers in the order backward completes them; ``None`` means L-1, ..., 0."""
    forward_s: float = 0.0
    """Forward pass and loss."""
    update_s: float = 0.0
    """Optimizer step of one replica."""
    other_s: float = 0.0
    """Per-step cost outside forward/backward/update (splitting the batch, bookkeeping)."""
    tail_s: float = 0.0
    """Backward compute after the last gradient is complete (input gradients, autograd's exit):
    it delays the update but no chunk waits for it."""
    layer_tensors: list[int] | None = None
    """Parameter tensors per layer (one gradient hook each per device); ``None``: no hook cost."""

    def __post_init__(self) -> None:
        if len(self.layer_bytes) != len(self.backward_s):
            raise ValueError(f"layer_bytes has {len(self.layer_bytes)} layers but backward_s has "
                             f"{len(self.backward_s)}; give both per layer in forward numbering")
        if self.order is None:
            self.order = list(range(len(self.layer_bytes) - 1, -1, -1))
        if sorted(self.order) != list(range(len(self.layer_bytes))):
            raise ValueError("order must list every layer exactly once (backward completion order)")

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)


@dataclass
class StageCosts:
    """What synchronising, moving and adding a chunk costs on one machine (and between machines)."""

    devices: int
    """Devices on this machine (G)."""
    sync_s: float = 0.0
    """Compute-stream cost per chunk (the paper's t_as)."""
    d2h: Linear = field(default_factory=Linear)
    """One device's device-to-host copy on an unshared link."""
    h2d: Linear = field(default_factory=Linear)
    """One device's host-to-device copy on an unshared link."""
    acc: Linear = field(default_factory=Linear)
    """Host accumulation of one chunk, all G contributions (bytes = one device's chunk)."""
    ranks: int = 1
    """Machines joined by the MPI tier (R)."""
    comm: Linear = field(default_factory=Linear)
    """MPI allreduce of one chunk between machines (used when ranks > 1)."""
    link_groups: list[list[int]] | None = None
    """Devices that share one link per direction; ``None``: every device has its own."""
    device_speed: list[float] | None = None
    """Compute-time multiplier per device (1.0: as profiled); ``None``: all 1.0."""
    p2p: Linear | None = None
    """Direct device-to-device copy for the baselines; ``None``: staged through the host."""
    device_acc: Linear = field(default_factory=Linear)
    """Adding one contribution on a device (typical training's server)."""
    typical_pattern: str = "star"
    """Typical training's gather/broadcast: "star" (device 0 talks to each) or "tree" (Caffe)."""
    shared_cores: float | None = None
    """Emulated devices: the host cores that compute, copies and accumulation all share;
    ``None``: devices compute on their own hardware and host work never slows them."""
    acc_threads: float = 1.0
    """Threads one accumulation keeps busy (with ``shared_cores``)."""
    dram: Linear = field(default_factory=Linear)
    """Host DRAM time for the traffic of one chunk, all devices together ((3G + 1) x its bytes);
    zero: DRAM never binds."""
    hook_s: float = 0.0
    """Host CPU per parameter tensor per device: its gradient hook, on the issuing thread."""
    segment_bytes: float = 0.0
    """Chunks travel in segments of at most this many bytes (0: one segment per chunk)."""
    segment_s: float = 0.0
    """Host-thread CPU per segment, beyond the sum itself."""
    segment_device_s: float = 0.0
    """Host-thread CPU per segment and device (its copy's wait, its copy back's issue)."""

    def segments(self, nbytes: float) -> float:
        """Segments of a chunk of ``nbytes``."""
        if nbytes <= 0:
            return 0.0
        return max(1.0, math.ceil(nbytes / self.segment_bytes)) if self.segment_bytes > 0 else 1.0

    def host_cpu(self, nbytes: float) -> float:
        """The host thread's own CPU for one chunk of ``nbytes`` (all devices), beyond the sum."""
        return self.segments(nbytes) * (self.segment_s + self.devices * self.segment_device_s)

    def threads(self, kind: str) -> float:
        """Host threads a task of this kind occupies while it runs (with ``shared_cores``)."""
        if kind in ("compute", "sync", "reduce", "update"):
            return 1.0
        if kind in ("d2h", "h2d", "gather", "bcast", "ring"):
            return 1.0  # an emulated copy is a memcpy on the stream's thread
        if kind == "acc":
            return self.acc_threads
        return 0.0

    def groups(self) -> list[list[int]]:
        return self.link_groups if self.link_groups else [[d] for d in range(self.devices)]

    def share(self) -> int:
        """Devices on the most crowded link."""
        return max(len(g) for g in self.groups())
