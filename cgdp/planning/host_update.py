"""The cost of ``update="host"``: host DRAM traffic of the optimizer, and the GPU memory it frees.

The host optimizer streams its operands through DRAM once per step. Per float32 element:

* AdamW (and Adam): reads p, g, m, v and writes p, m, v: 7 x 4 = **28 bytes**;
* SGD with momentum: reads p, g, b and writes p, b: 20 bytes; plain SGD: reads p, g, writes p: 12.

Those bytes share DRAM with the gradient path ((3G + 1) x the gradient bytes per step,
:func:`~cgdp.planning.hardware.host_traffic`; with ``update="host"`` the copies back read the
parameters instead of the sum: the same bytes). With overlap (a per-parameter optimizer and no
clipping) each chunk's update runs while the devices compute the layers below, so the update hides
if the host's whole step traffic fits in the backward compute time; only the last chunk's update is
always exposed. Otherwise it all runs after backward.

:class:`HostUpdateCost` *learns* the update's rate from a measured step (``Trainer.stats
["host_update_s"]``: :meth:`HostUpdateCost.observe`) and otherwise assumes the host's DRAM bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass

from cgdp.planning.hardware import Hardware, host_traffic

UPDATE_BYTES = {"adamw": 28, "adam": 28, "sgd_momentum": 20, "sgd": 12}
"""Host DRAM bytes per float32 element of one optimizer step."""
STATE_BYTES = {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}
"""Optimizer state bytes per float32 parameter (what each device holds with ``update="devices"``)."""


def _check(optimizer: str) -> None:
    if optimizer not in UPDATE_BYTES:
        raise ValueError(f"optimizer {optimizer!r}: the cost model knows {sorted(UPDATE_BYTES)}")


@dataclass
class HostUpdateCost:
    """Seconds of one host optimizer step over ``elements`` float32 parameters."""

    optimizer: str = "adamw"
    gbps: float = 100.0
    """The rate the update streams its bytes (GB/s): the host's DRAM bandwidth until measured."""

    def __post_init__(self) -> None:
        _check(self.optimizer)

    @property
    def bytes_per_element(self) -> int:
        return UPDATE_BYTES[self.optimizer]

    def seconds(self, elements: float) -> float:
        return elements * self.bytes_per_element / (self.gbps * 1e9)

    def observe(self, elements: float, seconds: float) -> None:
        """Learn the rate from one measured host update (its bytes over its time)."""
        if elements > 0 and seconds > 0:
            self.gbps = elements * self.bytes_per_element / seconds / 1e9


@dataclass(frozen=True)
class HostUpdateEstimate:
    update_s: float
    """The host optimizer's time per step."""
    dram_s: float
    """The host's whole DRAM traffic per step (gradient path and update) at its bandwidth."""
    backward_s: float
    hidden: bool
    """Whether the update fits under backward (overlapped: the DRAM time of the step within backward)."""
    exposed_s: float
    """Update time left after backward (overlapped: the excess, at least the last chunk's share)."""
    freed_per_gpu_bytes: int
    """Optimizer state no device holds any more."""
    gpu_bytes: dict
    """Per device, parameters + gradients + optimizer state: ``{"devices": ..., "host": ...}``."""
    host_bytes: int
    """Host memory: masters, optimizer state, and the (G + 1) slot rows."""


def estimate(hw: Hardware, params: float, backward_s: float, optimizer: str = "adamw",
             overlap: bool = True, last_chunk_share: float = 0.0, cost: HostUpdateCost | None = None) -> HostUpdateEstimate:
    """What ``update="host"`` costs and saves for a float32 model of ``params`` parameters on ``hw``."""
    _check(optimizer)
    cost = cost or HostUpdateCost(optimizer, hw.host_mem_gbps)
    grad = 4 * params
    update_s = cost.seconds(params)
    dram_s = (host_traffic(hw.gpus) * grad + UPDATE_BYTES[optimizer] * params) / (hw.host_mem_gbps * 1e9)
    if overlap:
        exposed = max(dram_s - backward_s, last_chunk_share * update_s, 0.0)
    else:
        exposed = update_s
    state = int(STATE_BYTES[optimizer] * params)
    base = int(8 * params)  # float32 parameters and the flat gradient buffer
    return HostUpdateEstimate(update_s, dram_s, backward_s, overlap and dram_s <= backward_s, exposed, state,
                              {"devices": base + state, "host": base},
                              int(4 * params + state + (hw.gpus + 1) * grad))
