"""Ranks started with different settings are caught at start-up, and the odd rank is named.

``mpiexec -n 2 python mismatch.py``: for each case, rank 1 builds its Trainer with one thing
different; both ranks must raise at construction with words naming rank 1 and the field. Prints
``OK <case> rank <r>: <first line of the error>``; exits non-zero if a mismatch goes unnoticed.
"""
import sys

import torch
from mpi4py import MPI
from torch import nn

import cgdp

rank = MPI.COMM_WORLD.rank
torch.set_num_threads(1)


def model(width):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 3))


cases = {  # name: (field the error must name, kwargs of rank 0, kwargs of rank 1)
    "model": ("layers", {"model": model(16)}, {"model": model(17)}),
    "devices": ("devices_per_rank", {"devices": ["cpu:0", "cpu:1"]}, {"devices": ["cpu:0"]}),
    "optimizer": ("optimizer_defaults", {"opt": 0.1}, {"opt": 0.2}),
}
failed = False
for name, (field, mine0, mine1) in cases.items():
    kw = {"model": model(16), "devices": ["cpu:0", "cpu:1"], "opt": 0.1, **(mine1 if rank == 1 else mine0)}
    lr = kw["opt"]
    try:
        cgdp.Trainer(kw["model"], lambda p: torch.optim.SGD(p, lr=lr), kw["devices"], comm="mpi",
                     timeout_s=20).close()
        print(f"MISSED {name} rank {rank}: no error", flush=True)
        failed = True
    except RuntimeError as exc:
        text = str(exc)
        if "rank 1" in text and field in text:
            print(f"OK {name} rank {rank}: {text.splitlines()[1].strip()}", flush=True)
        else:
            print(f"VAGUE {name} rank {rank}: {text}", flush=True)
            failed = True
sys.exit(1 if failed else 0)
