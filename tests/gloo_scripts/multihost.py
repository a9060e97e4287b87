"""One rank per (emulated) host under torchrun, 2 CPU-emulated devices each; then a cut link.

Run by tests/test_gloo_multihost.py in each network namespace as ``torchrun --nnodes 2
--nproc-per-node 1 --node-rank I --master-addr 10.231.0.1 ... multihost.py STEPS TIMEOUT_S OUT``
with ``GLOO_SOCKET_IFNAME=hnet0``. Every rank builds the same 0.6 M-parameter MLP (its gradients
dwarf the launcher's traffic) and the same global batches, trains STEPS steps on its part and
checks that the ranks are bitwise identical and equal one device (rtol 1e-5); rank 0 then prints
``OK multihost steps=S grad_bytes=B`` (B: the gradient bytes each rank allreduced). Then both
ranks go on training, printing ``rank r step s``, until the test cuts a link: each rank's error
goes to OUT/rank<r>.error and the error leaves the script.
"""
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cgdp
from cgdp.comm.gloo import GlooComm
from helpers import assert_params_close, assert_replicas_identical, mlp, reference

torch.set_num_threads(1)
steps, timeout_s, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
g = torch.Generator().manual_seed(1)
data = [(torch.randn(11, 64, generator=g), torch.randint(0, 8, (11,), generator=g)) for _ in range(steps)]
model = mlp((64, 512, 512, 512, 8))
ref, _ = reference(model, SGD, data, F.cross_entropy)


def digest(module):
    h = hashlib.sha256()
    for v in module.state_dict().values():
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


comm = GlooComm(timeout_s=timeout_s, error_file=os.path.join(out, "rank{rank}.error"))
rank, size = comm.rank, comm.size
with cgdp.Trainer(model, SGD, ["cpu:0", "cpu:1"], chunks=2, comm=comm, timeout_s=timeout_s) as tr:
    for x, y in data:
        tr.step(torch.tensor_split(x, size)[rank], torch.tensor_split(y, size)[rank], F.cross_entropy)
        assert_replicas_identical(tr)
        every = [None] * size
        dist.all_gather_object(every, digest(tr.replicas[0]))
        assert len(set(every)) == 1, "ranks differ"
    assert_params_close(tr.replicas[0], ref)
    if rank == 0:
        print(f"OK multihost steps={steps} grad_bytes={steps * sum(p.numel() * 4 for p in model.parameters())}",
              flush=True)
    x, y = data[0]
    for s in range(10 ** 9):  # until the link is cut
        tr.step(torch.tensor_split(x, size)[rank], torch.tensor_split(y, size)[rank], F.cross_entropy)
        print(f"rank {rank} step {s}", flush=True)
        time.sleep(0.05)
