"""MPIComm alone (no engine): in-place chunk sums in post order (both progress modes), small
collectives, the start-up check, the α/β probe.

Run by tests/test_mpi.py as ``mpiexec -n 2 python comm_contract.py``; prints ``OK ...`` lines.
"""
import os
import sys
import threading

import numpy as np
from mpi4py import MPI

from cgdp.comm import make_comm
from cgdp.comm.mpi import MPIComm, probe_alpha_beta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from comm_checks import check_small_collectives  # noqa: E402

world = MPI.COMM_WORLD
comm = make_comm("mpi", timeout_s=20)
rank, size = comm.rank, comm.size

# chunks: in-place SUM on slices of one accumulator, on_done in post order on the comm thread
for c in (comm, MPIComm(timeout_s=20, progress="wait")):
    acc = np.random.default_rng(rank).standard_normal(300_000).astype(np.float32)
    every = world.allgather(acc.copy())
    bounds = [(0, 100_000), (100_000, 100_001), (100_001, 299_000), (299_000, 300_000)]
    done = []
    for step in range(2):
        for k, (lo, hi) in enumerate(bounds):
            c.post(k, acc[lo:hi], lambda k=k: done.append((k, threading.current_thread().name)))
        c.fence()
        expect = sum(every) * size**step
        assert np.allclose(acc, expect, rtol=1e-6), "chunk sums are wrong"
    assert [k for k, _ in done] == [0, 1, 2, 3] * 2, done
    assert {n for _, n in done} == {f"cgdp-comm-r{rank}"}, done
    got = world.allgather(acc.tobytes())
    assert all(g == got[0] for g in got), "ranks hold different bits"
    if c is not comm:
        c.close()
print(f"OK chunks rank {rank}", flush=True)

check_small_collectives(comm)
print(f"OK small rank {rank}", flush=True)

alpha, beta = probe_alpha_beta(comm, reps=3)
assert alpha >= 0 and beta > 0
print(f"OK probe rank {rank} alpha={alpha * 1e6:.1f}us beta={1 / beta / 1e9:.2f}GB/s", flush=True)
comm.close()
