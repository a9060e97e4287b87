"""Allreduce bandwidth of gloo and MPICH through cgdp's comm thread, on loopback and on a namespace link.

Two ranks, one run: for each transport, a 2-rank job whose ranks allreduce float32 buffers of
``--sizes`` MiB through cgdp's own chunk path (``post`` + ``fence`` of
:class:`cgdp.comm.gloo.GlooComm` or :class:`cgdp.comm.mpi.MPIComm`, the comm thread included),
``--reps`` times each after one warm-up, lined up before each; the time is the slower rank's.
GB/s is the gradient's bytes per second (algorithm bandwidth); each rank sends and receives
2(R-1)/R = 1x of it (bus bandwidth, in Gbit/s: x 8).

Transports:

* ``gloo lo``: plain ``env://`` processes on 127.0.0.1 (gloo is TCP only);
* ``mpich shm``: ``mpiexec -n 2`` as it comes (shared memory between the two processes);
* ``mpich tcp lo``: the OFI netmod forced onto TCP over ``lo`` (``MPIR_CVAR_CH4_NETMOD=ofi
  FI_PROVIDER=tcp FI_TCP_IFACE=lo``; UCX refuses TCP over ``lo``: "no route");
* MPICH rows run ``MPIComm``'s default progress (the comm thread polls ``MPI_Test``; MPI moves
  data only inside MPI calls) and, marked ``wait``, ``progress="wait"`` (blocking in ``MPI_Wait``);
* ``gloo netns`` and ``mpich tcp netns``: two hosts emulated by network namespaces (a veth pair
  each into a bridge, :mod:`cgdp.testing.netns`), gloo on ``hnet0`` (``GLOO_SOCKET_IFNAME``), UCX
  forced onto TCP over ``hnet0``; the kernel's byte counters of host 1's link are checked to carry
  the data. Needs root; left out (and said so) elsewhere.

    python bench/bench_comm.py --out bench/results/comm.md

About two minutes on the 2-core test machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, fmt, machine, machine_md, table, write_results  # noqa: E402


# ---------------------------------------------------------------------- a rank (run as a worker)
def worker(backend: str, sizes_mib: list[float], reps: int) -> None:
    import numpy as np
    if backend == "gloo":
        from cgdp.comm.gloo import GlooComm
        comm = GlooComm(timeout_s=120)
    else:  # "mpi": MPIComm's default progress (polling MPI_Test); "mpi-wait": blocking in MPI_Wait
        from cgdp.comm.mpi import MPIComm
        comm = MPIComm(timeout_s=120, progress="wait" if backend == "mpi-wait" else "poll")
    comm.post(0, np.ones(16, np.float32), lambda: None)  # connections are made lazily
    comm.fence()
    out = {}
    for mib in sizes_mib:
        buf = np.ones(int(mib * 2**20) // 4, np.float32)
        times = []
        for _ in range(reps + 1):
            comm.allreduce_small(np.zeros(1))  # line the ranks up
            t0 = time.perf_counter()
            comm.post(0, buf, lambda: None)
            comm.fence()
            times.append(time.perf_counter() - t0)
        every = [json.loads(b) for b in comm.allgather_bytes(json.dumps(times[1:]).encode(), "times")]
        out[str(mib)] = [max(ts) for ts in zip(*every)]
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    comm.close()


# ---------------------------------------------------------------------- jobs
def _env(**extra: str) -> dict[str, str]:
    from cgdp.testing.netns import TRANSPORT_VARS
    env = {k: v for k, v in os.environ.items() if k not in TRANSPORT_VARS}
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)
    return env


def _result(outputs: list[str]) -> dict[str, list[float]]:
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
    raise SystemExit("no result; output:\n" + "\n---\n".join(outputs))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_job(args: list[str], run=lambda i, argv: argv, addr: str = "127.0.0.1", **extra: str) -> dict:
    port = str(_port())
    procs = [subprocess.Popen(run(r, [sys.executable, __file__, "--worker", "gloo", *args]),
                              env=_env(MASTER_ADDR=addr, MASTER_PORT=port, RANK=str(r), WORLD_SIZE="2", **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    return _result([p.communicate(timeout=600)[0] for p in procs])


def mpi_job(args: list[str], progress: str = "mpi", **extra: str) -> dict:
    p = subprocess.run(["mpiexec", "-n", "2", sys.executable, __file__, "--worker", progress, *args],
                       env=_env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    return _result([p.stdout])


def netns_jobs(args: list[str], want_mpi: bool) -> dict[str, tuple[dict, int]]:
    """gloo and MPICH across two namespaces: results and the bytes host 1's link carried."""
    from cgdp.testing import netns
    out = {}
    with netns.Hosts(2) as hosts:
        before = hosts.bytes(1)
        res = gloo_job(args, run=hosts.run, addr=hosts.addresses[0], GLOO_SOCKET_IFNAME=netns.IFACE)
        out["gloo netns (hnet0)"] = (res, sum(hosts.bytes(1)) - sum(before))
        for progress in ("mpi", "mpi-wait") if want_mpi else ():
            before = hosts.bytes(1)
            job = netns.Job(hosts, [sys.executable, __file__, "--worker", progress, *args],
                            netns.job_env("ucx", [str(ROOT)]))
            try:
                rc = job.wait(600)
            finally:
                job.kill()
            if rc != 0:
                raise SystemExit(f"the MPI job failed:\n{job.output}")
            name = f"mpich tcp netns (UCX, hnet0{', wait' if progress == 'mpi-wait' else ''})"
            out[name] = (_result([job.output]), sum(hosts.bytes(1)) - sum(before))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=["gloo", "mpi", "mpi-wait"], help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="4,16,64,256", help="MiB per allreduce, comma separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None, help="markdown page (printed if not given)")
    args = p.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker, sizes, args.reps)
        return
    wargs = ["--sizes", args.sizes, "--reps", str(args.reps)]
    have_mpi = shutil.which("mpiexec") is not None
    runs: dict[str, tuple[dict, int | None]] = {"gloo lo": (gloo_job(wargs), None)}
    if have_mpi:
        runs["mpich shm (default)"] = (mpi_job(wargs), None)
        runs["mpich shm (wait)"] = (mpi_job(wargs, "mpi-wait"), None)
        runs["mpich tcp lo (OFI)"] = (mpi_job(wargs, MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp",
                                             FI_TCP_IFACE="lo"), None)
    from cgdp.testing import netns
    why = netns.unavailable()
    if why is None:
        runs.update(netns_jobs(wargs, have_mpi))
    info = machine()
    rows = []
    for name, (res, link) in runs.items():
        med = {mib: sorted(ts)[len(ts) // 2] for mib, ts in res.items()}
        total = sum(float(mib) * 2**20 * (args.reps + 1) for mib in res) + 16 * 4
        crossed = "" if link is None else f"{link / 1e6:.0f} MB ({link / (2 * total):.2f}x)"
        rows.append([name, *(f"{float(mib) * 2**20 / t / 1e9:.2f} ({fmt(t * 1e3, 0)} ms)" for mib, t in med.items()),
                     crossed])
        print(rows[-1], flush=True)
    md = "\n".join([
        "# Allreduce bandwidth: gloo and MPICH, loopback and a namespace link (2 ranks)",
        "",
        f"Command: `{command_line()}`",
        "",
        "Machine:", machine_md(info), "",
        "Two ranks allreduce float32 buffers through cgdp's comm thread (`post` + `fence`; `GlooComm` or "
        f"`MPIComm`), {args.reps} times per size after a warm-up, lined up before each; the median of the "
        "slower rank's times. GB/s: the buffer's bytes per second (each rank sends and receives as much). "
        "`link`: bytes host 1's `hnet0` moved during the job (both directions), and that over the bytes "
        "the allreduces must send and receive (1.00x: all of it crossed the link)."
        + ("" if why is None else f" Network namespaces could not be made here ({why}): no netns rows."),
        "",
        table(["transport", *(f"{s:g} MiB: GB/s (ms)" for s in sizes), "link"], rows),
        "",
    ])
    write_results(md, {k: v[0] for k, v in runs.items()}, info, command_line(), args.out,
                  os.path.splitext(args.out)[0] + ".json" if args.out else None)


if __name__ == "__main__":
    main()
