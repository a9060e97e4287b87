"""One rank per (emulated) host, 2 CPU-emulated devices each, against single-device autograd.

Run by tests/test_multihost.py across network namespaces: ``mpiexec ... python multihost.py STEPS``.
Every rank builds the same MLP (about 0.6 M parameters, so that the gradients dwarf the launcher's
own traffic on the link) and the same global batches (11 samples: uneven parts), trains on its
``tensor_split`` part, and checks after every step that all ranks hold bitwise identical
parameters; at the end, that they equal the reference to 1e-5. Rank 0 prints
``OK multihost ranks=R steps=S grad_bytes=B max_rel_err=E``: B is the gradient bytes each rank
allreduced, which the test compares with the bytes counted on the interface.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.nn.functional as F
from mpi4py import MPI

import cgdp
from helpers import assert_params_close, assert_replicas_identical, mlp, reference

torch.set_num_threads(1)
world = MPI.COMM_WORLD
rank, size = world.rank, world.size
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
g = torch.Generator().manual_seed(1)
data = [(torch.randn(11, 64, generator=g), torch.randint(0, 8, (11,), generator=g)) for _ in range(steps)]
model = mlp((64, 512, 512, 512, 8))
ref, _ = reference(model, SGD, data, F.cross_entropy)


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for v in module.state_dict().values():
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


with cgdp.Trainer(model, SGD, ["cpu:0", "cpu:1"], chunks=2, comm="mpi", timeout_s=60) as tr:
    for x, y in data:
        tr.step(torch.tensor_split(x, size)[rank], torch.tensor_split(y, size)[rank], F.cross_entropy)
        assert_replicas_identical(tr)
        assert len(set(world.allgather(digest(tr.replicas[0])))) == 1, "ranks differ"
    assert_params_close(tr.replicas[0], ref)
    err = max(((p - q).abs().max() / q.abs().max()).item()
              for p, q in zip(tr.replicas[0].parameters(), ref.parameters()))
grad_bytes = steps * sum(p.numel() * 4 for p in model.parameters())
if rank == 0:
    print(f"OK multihost ranks={size} steps={steps} grad_bytes={grad_bytes} max_rel_err={err:.2g}", flush=True)
