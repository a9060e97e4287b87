"""``cgdp.DataParallel(comm="mpi")``: R ranks x 2 emulated devices, each rank its own loop.

Run by tests/test_mpi.py as ``mpiexec -n 2 python dataparallel.py``. Every rank builds the same
model and global batches and runs the user's loop (AdamW, clipping, a no_sync micro-batch) on its
half; the gradient is the mean over ranks, as with DDP, so training equals one device on the
global batch with the loss averaged over the ranks' halves. Checks: parameters equal that
reference to 1e-5, every rank and replica bitwise identical. Prints ``OK dataparallel`` on rank 0.
"""
import contextlib
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.nn.functional as F
from mpi4py import MPI

import cgdp
from helpers import assert_params_close, assert_replicas_identical, bound, mlp

torch.set_num_threads(1)
world = MPI.COMM_WORLD
rank, size = world.rank, world.size
ADAMW = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
g = torch.Generator().manual_seed(1)
data = [(torch.randn(12, 12, generator=g), torch.randint(0, 5, (12,), generator=g)) for _ in range(3)]


def run(model, batches, mean_over):
    """The loop; ``mean_over`` ranks' halves (the reference computes them all in one process)."""
    opt = bound(model, ADAMW(model.parameters()))
    dp = isinstance(model, cgdp.DataParallel)
    for x, y in batches:
        opt.zero_grad()
        for i, (xm, ym) in enumerate(zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2))):
            with model.no_sync() if dp and i == 0 else contextlib.nullcontext():
                if dp:
                    loss = F.cross_entropy(model(xm), ym) / 2
                else:  # each rank's half of this micro-batch, averaged over the ranks
                    loss = sum(F.cross_entropy(model(a), b) for a, b in
                               zip(torch.tensor_split(xm, mean_over), torch.tensor_split(ym, mean_over))) / (2 * mean_over)
                loss.backward()
        if dp:
            model.clip_grad_norm_(0.5)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if dp:
            assert_replicas_identical(model)
            states = world.allgather([v.clone() for v in model.module.state_dict().values()])
            assert all(torch.equal(a, b) for s in states[1:] for a, b in zip(states[0], s)), "ranks differ"


net = mlp()
ref = copy.deepcopy(net)
run(ref, data, size)  # each micro-batch split as the ranks split it, each rank's part a mean
mine = []
for x, y in data:  # this rank's half of every micro-batch, in micro-batch order
    mine.append((torch.cat([torch.tensor_split(m, size)[rank] for m in torch.tensor_split(x, 2)]),
                 torch.cat([torch.tensor_split(m, size)[rank] for m in torch.tensor_split(y, 2)])))
with cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=1, comm="mpi", timeout_s=30) as model:
    run(model, mine, size)
assert_params_close(net, ref)
if rank == 0:
    print("OK dataparallel", flush=True)
