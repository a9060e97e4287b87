"""Hardware descriptions: what a machine (or several) can move, and the simulator costs they imply.

A :class:`Hardware` names the parts that bound CGDP: the PCIe generation, width and topology of the
device links (which devices share a switch uplink), host memory bandwidth and accumulation threads,
and, for several machines, the network. :func:`stage_costs` turns it into the simulator's
:class:`~cgdp.planning.costs.StageCosts`; :func:`emulated_costs` does the same for CPU-emulated devices
from a :mod:`cgdp.planning.probe` measurement. Presets cover the paper's machine and common PCIe boxes.

Bandwidths are GB/s (1e9 bytes/s) per direction unless named otherwise; a PCIe link moves data in
both directions at once.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from cgdp.planning.costs import Linear, StageCosts
from cgdp.planning.probe import ProbeResult

PCIE_GT_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
"""Transfer rate per lane, GT/s."""
PCIE_ENCODING = {1: 0.8, 2: 0.8, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 242 / 256}
"""Line-code efficiency (8b/10b up to gen 2, 128b/130b from gen 3, FLIT for gen 6)."""


def pcie_gbps(gen: int, lanes: int = 16) -> float:
    """Raw bandwidth per direction of a PCIe link, GB/s (gen 3 x16: 15.75)."""
    if gen not in PCIE_GT_S:
        raise ValueError(f"unknown PCIe generation {gen}; use one of {sorted(PCIE_GT_S)}")
    return PCIE_GT_S[gen] * PCIE_ENCODING[gen] * lanes / 8


@dataclass
class Hardware:
    """One kind of machine, possibly several of them joined by a network."""

    name: str = "custom"
    """Label for reports."""
    gpus: int = 4
    """Devices per machine (G)."""
    pcie_gen: int = 4
    """PCIe generation of the device links."""
    pcie_lanes: int = 16
    """Lanes per device link."""
    link_efficiency: float = 0.8
    """Pinned-copy bandwidth over raw link bandwidth (protocol overhead): 0.75-0.85 measured."""
    link_gbps: float | None = None
    """Measured per-direction copy bandwidth per device; overrides the PCIe figures (D2H)."""
    h2d_gbps: float | None = None
    """Measured host-to-device bandwidth when it differs from D2H."""
    devices_per_switch: int = 1
    """Devices sharing one uplink to the host per direction (1: each has its own root port)."""
    p2p_gbps: float | None = None
    """Direct device-to-device bandwidth (NVLink, PCIe P2P) for the baselines; ``None``: none."""
    host_mem_gbps: float = 100.0
    """Host memory bandwidth (all channels, all sockets the devices use)."""
    host_threads: int = 8
    """Threads accumulating on the host."""
    thread_gbps: float = 10.0
    """Bytes one accumulation thread streams per second (reads + writes)."""
    copy_latency_s: float = 10e-6
    """Fixed cost of one copy (launch, DMA set-up)."""
    sync_s: float = 20e-6
    """Host CPU per chunk per device on the thread that issues backward (t_as): the hook's send
    (cgdp's Python: 3-11 us measured on null CUDA devices, bench/results/host_cost.md) and its
    CUDA calls (record an event, a stream wait, a stream context, a copy and its event per
    segment: about 15 us on a current driver; an estimate, not measured here)."""
    hook_s: float = 2e-6
    """Host CPU per parameter tensor per device: its gradient hook on the issuing thread (1-4 us
    measured on null CUDA devices)."""
    segment_bytes: int = 4 << 20
    """The engine's ``segment_bytes``: chunks travel (and are summed) in segments of this size."""
    segment_s: float = 10e-6
    """Host-thread CPU per segment beyond the sum: the wake-up and the kernel's launch."""
    segment_device_s: float = 12e-6
    """Host-thread CPU per segment and device: waiting on its copy's event, issuing its copy back
    (a stream context and a copy: mostly CUDA calls; cgdp's own Python is about 2-5 us of it on
    null CUDA devices)."""
    acc_latency_s: float = 20e-6
    """Fixed cost of one host accumulation (wake-up, thread fork/join)."""
    device_mem_gbps: float = 900.0
    """Device memory bandwidth (typical training adds gradients on device 0)."""
    typical_pattern: str = "star"
    """Typical training's gather/broadcast: "star" or "tree"."""
    nodes: int = 1
    """Machines (R), joined by MPI between their host accumulators."""
    network_gbps: float = 100.0
    """Network bandwidth per machine, Gbit/s (as NICs are sold)."""
    network_latency_s: float = 5e-6
    """One message's latency between machines."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.nodes < 1:
            raise ValueError(f"gpus and nodes must be >= 1 (got gpus={self.gpus}, nodes={self.nodes})")
        if self.devices_per_switch < 1:
            raise ValueError("devices_per_switch must be >= 1 (1 means every device has its own link)")
        pcie_gbps(self.pcie_gen, self.pcie_lanes)  # validates the generation

    def d2h_gbps(self) -> float:
        """Per-device D2H copy bandwidth on an unshared link."""
        return self.link_gbps or pcie_gbps(self.pcie_gen, self.pcie_lanes) * self.link_efficiency

    def acc_gbps(self) -> float:
        """What the host accumulation streams: thread-limited or memory-limited, whichever is lower."""
        return min(self.host_mem_gbps, self.host_threads * self.thread_gbps)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Hardware":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown hardware field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d)


def host_traffic(devices: int) -> int:
    """Host DRAM bytes per gradient byte and step: G copies in, G reads and one write by the sum,
    G reads by the copies back."""
    return 3 * devices + 1


def stage_costs(hw: Hardware) -> StageCosts:
    """Simulator costs for ``hw``.

    Host memory is a stage of its own (``dram``): each chunk's (3G + 1) x bytes of traffic pass
    through it while the chunk's copies and sum run, so on a machine whose DRAM is slower than
    its links the DRAM, not PCIe, sets the pace. The host CPU's per-hook, per-chunk and
    per-segment costs come from the fields of the same names.
    """
    G = hw.gpus
    groups = [list(range(i, min(i + hw.devices_per_switch, G))) for i in range(0, G, hw.devices_per_switch)]
    d2h = hw.d2h_gbps()
    h2d = hw.h2d_gbps or hw.d2h_gbps()
    acc = hw.acc_gbps() / (G + 1)  # G parts read, one result written, per byte of chunk
    R = hw.nodes
    net = hw.network_gbps / 8  # Gbit/s -> GB/s
    comm = Linear(2 * (R - 1) * hw.network_latency_s, 2 * (R - 1) / R / (net * 1e9)) if R > 1 else Linear()
    return StageCosts(
        devices=G, sync_s=hw.sync_s,
        d2h=Linear.from_bandwidth(d2h, hw.copy_latency_s), h2d=Linear.from_bandwidth(h2d, hw.copy_latency_s),
        acc=Linear.from_bandwidth(acc, hw.acc_latency_s), ranks=R, comm=comm,
        link_groups=groups if hw.devices_per_switch > 1 else None,
        p2p=Linear.from_bandwidth(hw.p2p_gbps, hw.copy_latency_s) if hw.p2p_gbps else None,
        device_acc=Linear.from_bandwidth(hw.device_mem_gbps / 3),  # read two, write one
        typical_pattern=hw.typical_pattern,
        dram=Linear.from_bandwidth(hw.host_mem_gbps / host_traffic(G)),
        hook_s=hw.hook_s, segment_bytes=hw.segment_bytes, segment_s=hw.segment_s,
        segment_device_s=hw.segment_device_s)


def emulated_costs(probe: ProbeResult, devices: int, sync_s: float = 30e-6, acc_threads: int | None = None) -> StageCosts:
    """Simulator costs for ``devices`` CPU-emulated devices on the probed machine.

    Every copy is a one-thread memcpy; one accumulation streams (G+1)·bytes with ``acc_threads``
    threads at the probed add bandwidth each; and all of it shares the machine's cores with the
    devices' compute threads (``shared_cores``).
    """
    threads = acc_threads or probe.cores
    acc_gbps = probe.add_gbps * threads / (devices + 1)
    return StageCosts(devices=devices, sync_s=sync_s,
                      d2h=Linear.from_bandwidth(probe.memcpy_gbps, 5e-6),
                      h2d=Linear.from_bandwidth(probe.memcpy_gbps, 5e-6),
                      acc=Linear.from_bandwidth(acc_gbps, 20e-6),
                      shared_cores=float(probe.cores), acc_threads=float(threads))


PRESETS: dict[str, Hardware] = {
    # The paper's machine (§5.1): POWER8 + 4 P100, NVLink 1.0 to the CPUs. Copy and accumulation
    # rates are those implied by Table 4's largest layer (fc6, 37.8M float32 = 151 MB): D2H
    # 12.146 ms, accumulation of 4 parts 13.074 ms, H2D 5.538 ms.
    # t_as = (111 - 104) ms / 8 layers: Table 3's backward with and without CGDP's syncs.
    "paper-p100": Hardware(name="paper-p100", gpus=4, link_gbps=151.2e6 / 12.146e-3 / 1e9,
                           h2d_gbps=151.2e6 / 5.538e-3 / 1e9, host_mem_gbps=230.0,
                           host_threads=16, thread_gbps=5 * 151.2e6 / 13.074e-3 / 1e9 / 16,
                           p2p_gbps=None, typical_pattern="tree", sync_s=0.875e-3, device_mem_gbps=732.0),
    "pcie3-4gpu": Hardware(name="pcie3-4gpu", gpus=4, pcie_gen=3, host_mem_gbps=60.0, host_threads=8),
    "pcie4-8gpu-switch": Hardware(name="pcie4-8gpu-switch", gpus=8, pcie_gen=4, devices_per_switch=2,
                                  host_mem_gbps=200.0, host_threads=16),
    "pcie4-8gpu": Hardware(name="pcie4-8gpu", gpus=8, pcie_gen=4, host_mem_gbps=200.0, host_threads=16),
    "pcie5-8gpu": Hardware(name="pcie5-8gpu", gpus=8, pcie_gen=5, host_mem_gbps=300.0, host_threads=32),
    "pcie4-4gpu-2node-100g": Hardware(name="pcie4-4gpu-2node-100g", gpus=4, pcie_gen=4, host_mem_gbps=150.0,
                                      host_threads=16, nodes=2, network_gbps=100.0),
    "nvlink-8gpu": Hardware(name="nvlink-8gpu", gpus=8, pcie_gen=4, p2p_gbps=150.0, host_mem_gbps=200.0,
                            host_threads=16),
}
"""Named machines for ``python -m cgdp.plan --hardware NAME``."""


def preset(name: str) -> Hardware:
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; choose from {sorted(PRESETS)} or give a JSON file")
    return Hardware.from_dict(PRESETS[name].to_dict())
