"""R ranks × 2 emulated devices against single-device autograd on the global batch.

Run by tests/test_mpi.py as ``mpiexec -n 2 python equivalence.py``. Every rank builds the same
model and global batches, trains on its ``tensor_split`` part, and checks: parameters equal the
reference to 1e-5, losses equal the global-batch loss, all ranks (and all replicas) hold bitwise
identical parameters and buffers. Prints ``OK <case>`` per case on rank 0.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.nn.functional as F
from mpi4py import MPI

import cgdp
from helpers import (Gated, TokenLM, WithBN, assert_params_close, assert_replicas_identical, mlp, reference,
                     reference_step2, token_batches, token_mean, token_sum)

torch.set_num_threads(1)
world = MPI.COMM_WORLD
rank, size = world.rank, world.size
SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def case(name, model, make_opt, data, chunks, loss_fn=F.cross_entropy, n_parts=None, ref_loss_fn=None,
         micro_batches=1):
    """``ref_loss_fn``: the two-argument form, dict batches, ``loss_fn(model, part)`` on every
    device and ``ref_loss_fn(model, batch)`` for the reference on the whole batch."""
    if ref_loss_fn is None:
        ref, ref_losses = reference(model, make_opt, data, loss_fn, n_parts=n_parts)
    else:
        ref, ref_losses = reference_step2(model, make_opt, data, ref_loss_fn)
    with cgdp.Trainer(model, make_opt, ["cpu:0", "cpu:1"], chunks=chunks, comm="mpi",
                      timeout_s=30, micro_batches=micro_batches) as tr:
        losses = []
        for b in data:
            if ref_loss_fn is None:
                mine = torch.tensor_split(b[0], size)[rank], torch.tensor_split(b[1], size)[rank]
                losses.append(tr.step(*mine, loss_fn))
            else:
                mine = {k: torch.tensor_split(v, size)[rank] for k, v in b.items()}
                losses.append(tr.step(mine, loss_fn))
            assert_replicas_identical(tr)
            digests = world.allgather(digest(tr.replicas[0]))
            assert len(set(digests)) == 1, f"{name}: ranks differ after step {len(losses)}"
        assert_params_close(tr.replicas[0], ref)
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{name}: loss {a} vs reference {b}"
    if rank == 0:
        print(f"OK {name}", flush=True)


def batches(n_steps, n, dim=12, classes=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(n_steps)]


# uneven: 11 samples → rank parts 6 and 5 → device parts 3,3 and 3,2
case("mlp-sgd-k1-uneven", mlp(), SGD, batches(3, 11), chunks=1)
case("mlp-adam-k2", mlp(), ADAM, batches(3, 16), chunks=2)
# a layer used only by the last rank's samples: it must get its gradient on every rank
gated = batches(3, 8, dim=6, classes=4)
for x, _ in gated:
    x[-1, 0] = 500.0
case("gated-layer-used-on-one-rank", Gated(), SGD, gated, chunks=1)
# BatchNorm statistics: batch-weighted mean over all devices of all ranks
case("batchnorm", WithBN(), SGD, batches(3, 12, dim=6, classes=3), chunks=1, n_parts=2 * size)
# (loss_sum, count): padded sequences; the counts of all devices of all ranks make the token mean
case("token-sum-count", TokenLM(), SGD, token_batches(3, 9), chunks=1, loss_fn=token_sum,
     ref_loss_fn=token_mean)
# ... also accumulated over micro-batches: 9 samples -> rank parts 5 and 4 -> device parts 3,2 and
# 2,2 -> micro-batches of 2,1 and 1,1 samples, every one with its own token count
case("token-sum-count-micro-batches", TokenLM(), SGD, token_batches(3, 9), chunks=1, loss_fn=token_sum,
     ref_loss_fn=token_mean, micro_batches=2)
