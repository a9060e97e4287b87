"""``comm="gloo"``: R ranks x 2 emulated devices against single-device autograd, and the comm alone.

Run by tests/test_gloo.py as R plain processes with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE`` set (what torchrun sets): the process group is initialised by cgdp from them. Every
rank builds the same model and global batches and trains on its ``tensor_split`` part. Checks:
parameters equal the reference to rtol 1e-5 and every rank (and replica) holds bitwise identical
parameters, with micro-batches, the host ring (``host_memory=``), a bf16 round trip (exactly
the documented rounding of each device's gradient, summed in float32 over all devices of all
ranks), and ``DataParallel`` (the mean over ranks, as DDP). Prints ``OK <case>`` on rank 0; then
runs ``python -m cgdp.gloo_check --json`` in the same processes (its report on rank 0).
"""
import copy
import hashlib
import os
import sys
import threading
import time

T0 = time.monotonic()

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cgdp
from cgdp.comm import make_comm
from comm_checks import check_small_collectives
from helpers import assert_params_close, assert_replicas_identical, mlp, reference

torch.set_num_threads(1)
# the comm alone first: it initialises the default group from the environment
comm = make_comm("gloo", timeout_s=30)
rank, size = comm.rank, comm.size
assert dist.is_initialized() and dist.get_backend() == "gloo"
SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731


def gather(obj):
    out = [None] * size
    dist.all_gather_object(out, obj)
    return out


def digest(module):
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def ok(name):
    if rank == 0:
        print(f"OK {name} at {time.monotonic() - T0:.1f} s", flush=True)


# ---------------------------------------------------------------- the contract, on the comm alone
acc = np.random.default_rng(rank).standard_normal(300_000).astype(np.float32)
every = gather(acc.copy())
bounds = [(0, 100_000), (100_000, 100_001), (100_001, 299_000), (299_000, 300_000)]
done = []
for k, (lo, hi) in enumerate(bounds):
    comm.post(k, acc[lo:hi], lambda k=k: done.append((k, threading.current_thread().name)))
comm.fence()
assert np.allclose(acc, sum(every), rtol=1e-6), "chunk sums are wrong"
assert [k for k, _ in done] == [0, 1, 2, 3] and {n for _, n in done} == {f"cgdp-comm-r{rank}"}, done
assert len(set(gather(acc.tobytes()))) == 1, "ranks hold different bits"
check_small_collectives(comm)
comm.close()
ok("contract")
# the user's own group (comm=group): cgdp's groups are made over its ranks
mine = make_comm(dist.new_group([0, 1], backend="gloo"), timeout_s=30)
check_small_collectives(mine)
mine.close()
ok("user-group")


# ---------------------------------------------------------------- Trainer against one device
def batches(n_steps, n, dim=12, classes=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(n_steps)]


def case(name, make_opt, data, chunks, **kw):
    model = mlp()
    ref, ref_losses = reference(model, make_opt, data, F.cross_entropy)
    with cgdp.Trainer(model, make_opt, ["cpu:0", "cpu:1"], chunks=chunks, comm="gloo", timeout_s=30, **kw) as tr:
        for i, (x, y) in enumerate(data):
            loss = tr.step(torch.tensor_split(x, size)[rank], torch.tensor_split(y, size)[rank], F.cross_entropy)
            assert abs(loss - ref_losses[i]) <= 1e-5 * max(1.0, abs(ref_losses[i])), (name, loss, ref_losses[i])
            assert_replicas_identical(tr)
            assert len(set(gather(digest(tr.replicas[0])))) == 1, f"{name}: ranks differ after step {i}"
        assert_params_close(tr.replicas[0], ref)
    ok(name)


case("mlp-sgd-k1-uneven", SGD, batches(3, 11), chunks=1)  # rank parts 6, 5; device parts 3,3 and 3,2
case("mlp-adam-k2-micro-batches", ADAM, batches(3, 16), chunks=2, micro_batches=2)
# a ring of 2 slots (3 rows of 1 kB) for a 3.4 kB gradient: slots are reused while allreduces are in flight
case("host-ring", SGD, batches(3, 12), chunks=1, segment_bytes=1024, host_memory=2 * 3 * 1024)


# ---------------------------------------------------------------- bf16 round trip
def weighted_grad(model, xd, yd, n):
    """One device's gradient as the engine forms it: backward of its mean loss with weight n_d / n."""
    m = copy.deepcopy(model)
    torch.autograd.backward(F.cross_entropy(m(xd), yd), grad_tensors=torch.full((), xd.shape[0] / n))
    return [p.grad for p in m.parameters()]


model = mlp()
x, y = batches(1, 12)[0]
# device j of rank r holds part j of rank r's part of the global batch (before the trainer moves the model)
parts = [weighted_grad(model, xd, yd, x.shape[0])
         for xr, yr in zip(torch.tensor_split(x, size), torch.tensor_split(y, size))
         for xd, yd in zip(torch.tensor_split(xr, 2), torch.tensor_split(yr, 2))]
with cgdp.Trainer(model, SGD, ["cpu:0", "cpu:1"], chunks=1, comm="gloo", timeout_s=30,
                  grad_transfer="bf16", segment_bytes=1024) as tr:
    tr.step(torch.tensor_split(x, size)[rank], torch.tensor_split(y, size)[rank], F.cross_entropy)
    got = [p.grad.clone() for p in tr.replicas[0].parameters()]
    assert len(set(gather(digest(tr.replicas[0])))) == 1, "bf16: ranks differ"
for k, gk in enumerate(got):
    per_rank = [parts[2 * r][k].bfloat16().float() + parts[2 * r + 1][k].bfloat16().float() for r in range(size)]
    total = per_rank[0]
    for s in per_rank[1:]:
        total = total + s
    assert torch.equal(gk, total.bfloat16().float()), f"bf16: parameter {k} is not the documented rounding"
ok("bf16")

# ---------------------------------------------------------------- DataParallel: the mean over ranks
net = mlp()
ref = copy.deepcopy(net)
opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
dp = cgdp.DataParallel(net, ["cpu:0", "cpu:1"], comm="gloo", timeout_s=30)
opt = dp.bind(torch.optim.AdamW(dp.parameters(), lr=1e-2))
for x, y in batches(3, 12):
    opt_ref.zero_grad()
    halves = zip(torch.tensor_split(x, size), torch.tensor_split(y, size))
    (sum(F.cross_entropy(ref(a), b) for a, b in halves) / size).backward()
    opt_ref.step()
    opt.zero_grad()
    F.cross_entropy(dp(torch.tensor_split(x, size)[rank]), torch.tensor_split(y, size)[rank]).backward()
    opt.step()
    assert_replicas_identical(dp)
    assert len(set(gather(digest(dp.module)))) == 1, "DataParallel: ranks differ"
assert_params_close(dp.module, ref)
dp.close()
ok("dataparallel")

# ---------------------------------------------------------------- python -m cgdp.gloo_check's report
from cgdp.cli.mpi_check import main as check  # noqa: E402

assert check(["--mib", "4", "--reps", "2", "--json"], backend="gloo") == 0
