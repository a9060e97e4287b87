"""A cut link mid-training: how long until every process of the MPI job has ended, per netmod.

Two hosts emulated by network namespaces (cgdp.testing.netns), one rank each, MPICH forced onto TCP
over the hosts' links (UCX: ``UCX_TLS=tcp,self``; OFI: ``FI_PROVIDER=tcp``), launched as on a
cluster without ssh (``mpiexec -launcher manual`` in host 0, a ``hydra_pmi_proxy`` per host).
``python -m cgdp.train --timeout_s T --out DIR`` trains; after 3 logged steps host 1's link goes
down (``ip link set hnet0 down`` in its namespace). Each run records, for every process (mpiexec
and proxy 0 and rank 0 on host 0; proxy 1 and rank 1 on host 1, now cut off), the seconds from the
cut until it ended, and checks first that every rank wrote its error to DIR/rank<r>.error.

    python bench/bench_cut_link.py --runs 3 --timeout_s 5 --out bench/results/cut_link.md

Needs root (network namespaces); about 15 s per run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, fmt, machine, machine_md, table, write_results  # noqa: E402

from cgdp.comm.abort import HARD_EXIT_S  # noqa: E402
from cgdp.testing import netns  # noqa: E402

ROLES = ["host0:mpiexec", "host0:hydra_pmi_proxy", "host0:python", "host1:hydra_pmi_proxy", "host1:python"]
NAMES = {"host0:mpiexec": "mpiexec (host 0)", "host0:hydra_pmi_proxy": "proxy 0", "host0:python": "rank 0",
         "host1:hydra_pmi_proxy": "proxy 1 (cut off)", "host1:python": "rank 1 (cut off)"}


def one_run(netmod: str, timeout_s: float, limit: float) -> dict:
    with netns.Hosts(2) as hosts, tempfile.TemporaryDirectory() as out:
        ended, output = netns.cut_during_training(hosts, netns.job_env(netmod, [str(ROOT)]), out, timeout_s,
                                                  limit=limit)
        errors = {r: (Path(out) / f"rank{r}.error").read_text() if (Path(out) / f"rank{r}.error").exists()
                  else "" for r in (0, 1)}
    by_role = {role: [v for k, v in ended.items() if k.startswith(role + "[")] for role in ROLES}
    missing = [role for role, v in by_role.items() if len(v) != 1]
    if missing:
        raise SystemExit(f"expected one process of each role, missing {missing}: {ended}\n{output}")
    for r, text in errors.items():  # the answer first: each rank kept its own error
        if f"rank {r} of 2" not in text or "TimeoutError" not in text:
            raise SystemExit(f"rank {r} did not write its TimeoutError to rank{r}.error:\n{text}\n{output}")
    return {role: v[0] for role, v in by_role.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout_s", type=float, default=5.0)
    p.add_argument("--netmods", default="ucx,ofi")
    p.add_argument("--limit", type=float, default=90.0, help="give up waiting for a process after this")
    p.add_argument("--out", default=None, help="markdown page (printed if not given)")
    args = p.parse_args()
    why = netns.unavailable()
    if why:
        raise SystemExit(f"cannot emulate hosts here: {why}")
    from mpi4py import MPI
    info = machine()
    info["mpi"] = " ".join(MPI.Get_library_version().split("\n")[0].split())
    bound = args.timeout_s + 1 + HARD_EXIT_S
    results: dict[str, list[dict]] = {}
    rows = []
    for netmod in args.netmods.split(","):
        results[netmod] = []
        for run in range(1, args.runs + 1):
            t = one_run(netmod, args.timeout_s, args.limit)
            results[netmod].append(t)
            last = max((v for v in t.values() if v is not None), default=float("nan"))
            alive = [NAMES[k] for k, v in t.items() if v is None]
            rows.append([netmod.upper() + "/TCP", run, *(fmt(v, 2) if v is not None else f"alive at {args.limit:g}"
                                                         for v in t.values()),
                         fmt(last, 2) if not alive else "never", "yes" if not alive and last <= bound else "no"])
            print(rows[-1], flush=True)
    md = "\n".join([
        "# A cut link mid-training: every process ends (2 hosts as network namespaces, MPICH over TCP)",
        "",
        f"Command: `{command_line()}`",
        "",
        "Machine:", machine_md(info), "",
        f"`python -m cgdp.train --timeout_s {args.timeout_s:g} --out DIR` (digits CNN, 1 CPU-emulated device per "
        "rank, chunks 1) on two hosts emulated by network namespaces joined by a bridge, one rank each, "
        "launched with `mpiexec -launcher manual` in host 0 and one `hydra_pmi_proxy` per host, the netmod "
        "forced onto TCP over `hnet0` (UCX: `UCX_TLS=tcp,self UCX_NET_DEVICES=hnet0`; OFI: "
        "`MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=hnet0`). After 3 logged steps, host 1's "
        "link goes down. Seconds from the cut until each process ended; checked first in every run: "
        "`DIR/rank0.error` and `DIR/rank1.error` each hold that rank's `TimeoutError`.",
        "",
        f"The bound (docs/mpi.md): `timeout_s` + 1 s (detection) + `HARD_EXIT_S` ({HARD_EXIT_S:g} s) = "
        f"{bound:g} s.",
        "",
        table(["transport", "run", *(NAMES[r] for r in ROLES), "last process", "within bound"], rows),
        "",
        "Before this change (the same hosts and launch; a plain training loop with `timeout_s` 5 in three runs "
        "over UCX and one over OFI, and this command with `timeout_s` 3 once over UCX): over UCX/TCP rank 1 "
        "and proxy 1 were still alive when the watch ended (25 to 90 s after the cut), in every run: rank 1 "
        "had written its `TimeoutError` to stderr (lost with the link), called `MPI_Abort`, which returned "
        "since its launcher was behind the cut, and then waited in `MPI_Finalize` for that launcher. Over "
        "OFI/TCP every process had ended 6.1 s after the cut.",
        "",
    ])
    write_results(md, results, info, command_line(), args.out,
                  os.path.splitext(args.out)[0] + ".json" if args.out else None)


if __name__ == "__main__":
    main()
