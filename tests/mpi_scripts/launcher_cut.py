"""Ranks that train to the end while their launcher is cut off, then exit.

``mpiexec ... python launcher_cut.py OUT FINALIZE_S``: each rank prints ``rank r started``, trains
40 short steps (the test cuts the launcher's link meanwhile; the ranks still reach each other),
closes its trainer and writes ``OUT/rank<r>.done`` (the time) before the interpreter exits, where
``MPI_Finalize`` waits for the launcher: ``finalize_timeout_s=FINALIZE_S`` bounds that wait.
"""
import sys
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

import cgdp
from cgdp.comm.mpi import MPIComm

out, finalize_s = sys.argv[1], float(sys.argv[2])
torch.set_num_threads(1)
rank = MPI.COMM_WORLD.rank
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
comm = MPIComm(timeout_s=20, finalize_timeout_s=finalize_s if finalize_s > 0 else None)
g = torch.Generator().manual_seed(rank)
with cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0"], chunks=1, comm=comm) as tr:
    print(f"rank {rank} started", flush=True)
    for _ in range(40):
        tr.step(torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g), F.cross_entropy)
        time.sleep(0.05)
with open(f"{out}/rank{rank}.done", "w") as f:
    f.write(f"{time.monotonic()}\n")
