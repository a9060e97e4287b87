"""``python -m cgdp.mpi_check``: which network the MPI ranks really use, and the allreduce bandwidth.

``python -m cgdp.gloo_check`` is its twin for the gloo tier (:class:`cgdp.comm.gloo.GlooComm`),
started like a gloo training job (``torchrun --nnodes N --nproc-per-node 1 ... -m cgdp.gloo_check``).

Start it exactly as the training job (same launcher, hosts and environment), for instance::

    mpiexec -n 2 -ppn 1 -hosts node1,node2 python -m cgdp.mpi_check

What it reports is what moved, not what was configured: each rank reads the kernel's byte
counters of every network interface (``/proc/net/dev``, and InfiniBand port counters where there
are any) before and after ``--reps`` allreduces of ``--mib`` MiB through cgdp's own chunk path
(:class:`cgdp.comm.mpi.MPIComm`, ``post`` and ``fence``), after checking that their sum is right.
A rank whose data crossed no interface exchanged it through shared memory (ranks on one machine,
or containers and network namespaces that share ``/dev/shm``: UCX picks shared memory by itself),
which is what a test of "several hosts" on one machine must rule out. It also prints the MPI
library, the netmod and the transport settings in the environment (``MPIR_CVAR_*``, ``UCX_*``,
``FI_*``, ...) of every rank.

Exit codes: 0; 1 with ``--require-network`` when some rank's data crossed no network interface,
or when the allreduce gave a wrong sum; 2 for a user error (run alone, bad numbers). A broken
network ends every rank after ``--timeout_s`` instead of hanging (:mod:`cgdp.comm.abort`).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

SETTINGS = ("MPIR_CVAR_", "MPICH_", "UCX_", "FI_", "HYDRA_IFACE", "OMPI_MCA_", "I_MPI_", "GLOO_", "MASTER_ADDR")
"""Environment variables that choose MPI's (or gloo's) transport, shown for every rank."""
SHARE = 0.5
"""An interface 'carried' the allreduce when it moved at least this share of the ring's bytes."""


def counters() -> dict[str, tuple[int, int]]:
    """(received, sent) bytes of every network interface this process can see (its namespace's)."""
    out: dict[str, tuple[int, int]] = {}
    try:
        with open("/proc/net/dev") as f:
            for line in f.readlines()[2:]:
                name, _, rest = line.partition(":")
                cols = rest.split()
                out[name.strip()] = (int(cols[0]), int(cols[8]))
    except (OSError, ValueError, IndexError):
        pass
    for port in glob.glob("/sys/class/infiniband/*/ports/*"):  # RDMA bypasses /proc/net/dev
        try:
            with open(f"{port}/counters/port_rcv_data") as r, open(f"{port}/counters/port_xmit_data") as x:
                dev, num = port.split("/")[-3], port.split("/")[-1]
                out[f"ib:{dev}/{num}"] = (4 * int(r.read()), 4 * int(x.read()))  # counted in 4-byte words
        except (OSError, ValueError):
            pass
    return out


def settings() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTINGS)}


def netmod(library: str, env: dict[str, str]) -> str:
    """The netmod MPICH uses, as far as the settings tell (MPICH's ch4 picks the first it was built with)."""
    if "MPICH" not in library:
        return "not MPICH: see the library's own documentation"
    chosen = env.get("MPIR_CVAR_CH4_NETMOD")
    if chosen:
        return f"{chosen} (MPIR_CVAR_CH4_NETMOD)"
    for line in library.splitlines():
        if line.startswith("MPICH Device:"):
            built = line.split(":", 1)[1].split()
            first = built[0].split(":")[-1] if built else "?"
            return f"{first} (the library's default; built with {' '.join(built)})"
    return "the library's default"


def verdict(moved: dict[str, tuple[int, int]], ring_bytes: float) -> tuple[str, str | None]:
    """('network' | 'loopback' | 'no-network', the busiest interface) for one rank's byte counts."""
    if not moved:
        return "no-network", None
    busiest = max(moved, key=lambda k: max(moved[k]))
    carried = {k for k, v in moved.items() if max(v) >= SHARE * ring_bytes}
    if carried - {"lo"}:
        return "network", max(carried - {"lo"}, key=lambda k: max(moved[k]))
    if "lo" in carried:
        return "loopback", "lo"
    return "no-network", busiest


def summarise(ranks: list[dict[str, Any]], nbytes: int, reps: int, times: list[float]) -> dict[str, Any]:
    """The report: every rank's verdict, the job's verdict and the bandwidth (``times``: seconds
    per allreduce, the slowest rank's, in order)."""
    size = len(ranks)
    ring = 2 * (size - 1) / size * nbytes * reps  # bytes a ring allreduce sends (and receives) per rank
    for r in ranks:
        r["verdict"], r["busiest_interface"] = verdict(r["moved"], ring)
    kinds = {r["verdict"] for r in ranks}
    t = statistics.median(times)
    algbw = nbytes / t
    return {"ranks": ranks, "verdict": kinds.pop() if len(kinds) == 1 else "mixed",
            "allreduce": {"bytes": nbytes, "reps": reps, "median_s": t, "times_s": times,
                          "alg_gbyte_s": algbw / 1e9,
                          "bus_gbit_s": algbw * 2 * (size - 1) / size * 8 / 1e9},
            "ring_bytes_per_rank": ring}


def describe(report: dict[str, Any]) -> str:
    ranks, a = report["ranks"], report["allreduce"]
    head = ranks[0]
    env = " ".join(f"{k}={v}" for k, v in head["env"].items()) or "(no transport variables set)"
    prog = f"cgdp.{report.get('backend', 'mpi')}_check"
    lines = [f"{prog}: {len(ranks)} ranks; {head['library']}; netmod {head['netmod']}",
             f"  transport settings (rank 0): {env}"]
    for r in ranks[1:]:
        if r["env"] != head["env"]:
            lines.append(f"  rank {r['rank']} has other settings: {r['env']}")
    lines.append(f"{'rank':>4}  {'host':<20} {'pid':>7}  {'interface':<12} {'sent MB':>9} {'received MB':>12}  verdict")
    for r in ranks:
        iface = r["busiest_interface"] or "-"
        rx, tx = r["moved"].get(iface, (0, 0))
        lines.append(f"{r['rank']:>4}  {r['host'][:20]:<20} {r['pid']:>7}  {iface:<12} {tx / 1e6:>9.1f} "
                     f"{rx / 1e6:>12.1f}  {r['verdict']}")
    lines.append(f"allreduce of {a['bytes'] / 2**20:g} MiB through cgdp's comm thread, {a['reps']} times: "
                 f"median {a['median_s'] * 1e3:.1f} ms, {a['alg_gbyte_s']:.2f} GB/s of gradient, bus "
                 f"bandwidth {a['bus_gbit_s']:.2f} Gbit/s (each rank sends and receives 2(R-1)/R of it)")
    v = report["verdict"]
    if v == "network":
        names = sorted({r["busiest_interface"] for r in ranks})
        lines.append(f"verdict: every rank's data crossed a network interface ({', '.join(names)})")
    elif v == "loopback":
        lines.append("verdict: the data went through the loopback interface: the transport is TCP, but every "
                     "rank is on this one machine")
    else:
        odd = [r["rank"] for r in ranks if r["verdict"] != "network"]
        lines.append(f"verdict: the data of rank(s) {odd} crossed no network interface: they exchanged it "
                     f"through shared memory (ranks on one machine, or containers/namespaces sharing /dev/shm, "
                     f"where UCX picks shared memory by itself), or over RDMA whose counters are not visible "
                     f"here. To force TCP over an interface: UCX_TLS=tcp,self UCX_NET_DEVICES=<iface>, or "
                     f"MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=<iface> (docs/mpi.md)")
    return "\n".join(lines)


def measure(comm: Any, nbytes: int, reps: int) -> tuple[list[float], dict[str, tuple[int, int]], bool]:
    """(seconds per allreduce on this rank, bytes moved per interface, whether every sum was right)."""
    buf = np.empty(nbytes // 4, np.float32)
    want = comm.size * (comm.size + 1) / 2
    comm.post(0, np.ones(16, np.float32), lambda: None)  # warm-up: connections are made lazily
    comm.fence()
    times, ok = [], True
    before = counters()
    for _ in range(reps):
        buf.fill(comm.rank + 1)
        comm.allreduce_small(np.zeros(1))  # line the ranks up
        t0 = time.perf_counter()
        comm.post(0, buf, lambda: None)
        comm.fence()
        times.append(time.perf_counter() - t0)
        ok = ok and bool(buf[0] == want and buf[-1] == want and (buf == want).all())
    after = counters()
    moved = {k: (after[k][0] - v[0], after[k][1] - v[1]) for k, v in before.items() if k in after}
    return times, {k: v for k, v in moved.items() if max(v) > 0}, ok


def main(argv: list[str] | None = None, backend: str = "mpi") -> int:
    """``backend``: ``"mpi"`` (``python -m cgdp.mpi_check``) or ``"gloo"`` (``python -m cgdp.gloo_check``)."""
    prog = f"cgdp.{backend}_check"
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=64, help="MiB per allreduce (default 64)")
    p.add_argument("--reps", type=int, default=5, help="timed allreduces (default 5)")
    p.add_argument("--timeout_s", type=float, default=60, help="fail instead of waiting longer (default 60)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--require-network", action="store_true",
                   help="exit 1 unless every rank's data crossed a network interface")
    args = p.parse_args(argv)
    if not (args.mib > 0 and args.reps >= 1 and args.timeout_s > 0) or args.mib * 2**20 < 64:
        print(f"{prog}: error: --mib must be >= 1/16384 (64 bytes), --reps >= 1, --timeout_s > 0",
              file=sys.stderr)
        return 2
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        have = None
    if have is not None and args.mib * 2**20 > have / 4:
        print(f"{prog}: error: --mib {args.mib:g} would take more than a quarter of this machine's "
              f"{have / 2**30:.1f} GiB; a few hundred MiB measure the bandwidth well", file=sys.stderr)
        return 2
    try:
        comm, library, net = _comm(backend, args.timeout_s)
    except (ImportError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if comm.size < 2:
        print(f"{prog}: error: this process is alone; start it like the training job, e.g. mpiexec -n 2 -ppn 1 "
              f"-hosts node1,node2 python -m cgdp.mpi_check, or torchrun --nnodes 2 --nproc-per-node 1 ... "
              f"-m cgdp.gloo_check", file=sys.stderr)
        return 2
    nbytes = int(args.mib * 2**20) // 64 * 64
    times, moved, ok = measure(comm, nbytes, args.reps)
    mine = {"rank": comm.rank, "host": socket.gethostname(), "pid": os.getpid(), "env": settings(),
            "library": library.splitlines()[0].strip(), "netmod": net,
            "moved": moved, "sum_ok": ok, "times_s": times}
    ranks = [json.loads(s) for s in comm.allgather_bytes(json.dumps(mine).encode(), f"{prog} report")]
    comm.close()
    for r in ranks:
        r["moved"] = {k: tuple(v) for k, v in r["moved"].items()}
    slowest = [max(ts) for ts in zip(*(r["times_s"] for r in ranks))]
    report = summarise(ranks, nbytes, args.reps, slowest)
    report["sum_ok"] = all(r["sum_ok"] for r in ranks)
    report["backend"] = backend
    if comm.rank == 0:
        print(json.dumps(report, indent=1) if args.json else describe(report), flush=True)
        if not report["sum_ok"]:
            print(f"{prog}: the allreduce gave a wrong sum on some rank", file=sys.stderr)
    if not report["sum_ok"] or (args.require_network and report["verdict"] != "network"):
        return 1
    return 0



def _comm(backend: str, timeout_s: float) -> tuple[Any, str, str]:
    """(the comm, the library's version text, the netmod) of ``backend``."""
    if backend == "gloo":
        import torch

        from cgdp.comm.gloo import GlooComm
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        how = f"TCP on {iface} (GLOO_SOCKET_IFNAME)" if iface else "TCP on the interface of this host's name"
        return GlooComm(timeout_s=timeout_s), f"gloo (torch {torch.__version__})", how
    from cgdp.comm.mpi import MPIComm, load_mpi
    MPI = load_mpi()
    library = MPI.Get_library_version().strip()
    return MPIComm(timeout_s=timeout_s, finalize_timeout_s=60.0), library, netmod(library, settings())
