"""SGD's momentum flat in two sides on the host (``cgdp.engine.core.host_sgd``): bitwise torch's fused CPU SGD."""
from __future__ import annotations

import copy
import itertools
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import cgdp
from helpers import mlp
from test_host_update import _states_equal, batches, on_capability, steps_bitwise

CONFIGS = [dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1),
           dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3),
           dict(lr=0.2, momentum=0.5, nesterov=True, maximize=True), dict(lr=0.02, momentum=0.95, dampening=0.9,
                                                                           weight_decay=0.2, maximize=True)]


def _flat_sgd_bitwise():
    """FlatSGD against torch's fused SGD over several steps, bit for bit: tensors whose sizes hit every tail (vector
    runs of 16 and 8, AVX-512's vectorised epilogue, scalar remainders), two groups, the first step (the gradient
    becomes the buffer), a parameter skipped in a step, a discarded step."""
    from cgdp.engine.core.host_sgd import FlatSGD, usable
    shapes = [(37,), (5,), (48,), (25,), (9,), (15,), (5, 7), (300, 3), (1,), (64, 65)]
    n = [math.prod(s) for s in shapes]
    offs = [0, *itertools.accumulate(n)][:-1]
    for kw in CONFIGS:
        torch.manual_seed(0)
        ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        flat = torch.cat([p.detach().flatten() for p in ref])
        mine = [torch.nn.Parameter(flat[o:o + k].view(s)) for o, k, s in zip(offs, n, shapes)]
        opts = [torch.optim.SGD([{"params": ps[:5]}, {"params": ps[5:], "lr": kw["lr"] * 3}], fused=True, **kw)
                for ps in (ref, mine)]
        assert usable(opts[1])
        steps_bitwise(FlatSGD(opts[1], mine, offs, flat), opts[0], ref, flat, offs, kw)


def test_flat_sgd_steps_bitwise_as_torch_fused():
    _flat_sgd_bitwise()


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_flat_sgd_steps_bitwise_as_torch_fused_on_other_cpu_capabilities(capability):
    """Each capability's build rounds differently (fused multiply-adds, vector width): the kernel follows it."""
    on_capability(capability, "test_host_flat_sgd", "_flat_sgd_bitwise")


def test_only_what_matches_torch_is_stepped_flat():
    """No momentum (no state to keep), foreach, differentiable, a tensor lr, a subclass, a step of the user's keep
    torch's step."""
    from cgdp.engine.core.host_sgd import usable
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert usable(torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True, nesterov=True, maximize=True))
    assert not usable(torch.optim.SGD(p, lr=0.1, fused=True))
    assert not usable(torch.optim.SGD([{"params": p}, {"params": [torch.nn.Parameter(torch.zeros(1))],
                                                       "momentum": 0}], lr=0.1, momentum=0.9, fused=True))
    assert not usable(torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True))
    assert not usable(torch.optim.SGD(p, lr=0.1, momentum=0.9, differentiable=True))
    assert not usable(torch.optim.SGD(p, lr=torch.tensor(0.1), momentum=0.9, fused=True))
    assert not usable(type("Mine", (torch.optim.SGD,), {})(p, lr=0.1, momentum=0.9, fused=True))
    own = torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True)
    own.step = lambda: None
    assert not usable(own)


@pytest.mark.parametrize("kw", CONFIGS[1:4])
def test_host_update_with_sgd_momentum_steps_bitwise_as_each_device_does(kw):
    """update='host' (flat momentum, a chunk per call while backward runs) against update='devices' (torch's fused
    SGD on each device's replica, as on one device, with the same averaged gradient): the same bits every step."""
    make = partial(torch.optim.SGD, fused=True, **kw)
    model, data = mlp(), batches(5)
    host = cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=3, update="host")
    devices = cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=3, update="devices")
    with host, devices:
        for x, y in data:
            assert host.step(x, y, F.cross_entropy) == devices.step(x, y, F.cross_entropy)
            assert host._update._fast and host.stats["host_update_overlapped"] == 1.0
            a, b = host.replicas[0].state_dict(), devices.replicas[0].state_dict()
            assert all(torch.equal(v, b[k]) for k, v in a.items())
        assert _states_equal(host.optimizers[0].state_dict(), devices.optimizers[0].state_dict())


class _Frozen(torch.nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.e = torch.nn.Embedding(10, 3, sparse=sparse).requires_grad_(sparse)

    def forward(self, x):
        return self.e(x).sum(1)


@pytest.mark.parametrize("sparse", [False, True])
def test_a_model_without_dense_trainable_parameters_is_refused_by_update_host(sparse):
    with pytest.raises(ValueError, match="has none .* use update='devices'"):
        cgdp.DataParallel(_Frozen(sparse), ["cpu:0", "cpu:1"], update="host")
    cgdp.DataParallel(_Frozen(sparse), ["cpu:0", "cpu:1"]).close()


def test_a_none_momentum_buffer_is_no_buffer_as_torch_reads_it():
    """A state entry whose momentum_buffer is None (an SGD state saved with momentum=0, then resumed with momentum):
    torch's step takes the gradient as the buffer; the flat step does the same, bit for bit."""
    from cgdp.engine.core.host_sgd import FlatSGD
    torch.manual_seed(0)
    shapes, kw = [(37,), (5, 7)], {"lr": 0.1, "momentum": 0.9}
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    flat = torch.cat([p.detach().flatten() for p in ref])
    offs = [0, 37]
    mine = [torch.nn.Parameter(flat[o:o + p.numel()].view(p.shape)) for o, p in zip(offs, ref)]
    opts = [torch.optim.SGD(ps, fused=True, **kw) for ps in (ref, mine)]
    for o, ps in zip(opts, (ref, mine)):
        for p in ps:
            o.state[p] = {"momentum_buffer": None}
    fs = FlatSGD(opts[1], mine, offs, flat)
    for _ in range(2):
        row = torch.randn(flat.numel())
        for p, o in zip(ref, offs):
            p.grad = row[o:o + p.numel()].view(p.shape).clone()
        opts[0].step()
        fs.sync(), fs.step([0, 1], [0, 0], row, offs), fs.commit()
        assert all(torch.equal(a, b) and torch.equal(opts[0].state[a]["momentum_buffer"],
                                                    opts[1].state[b]["momentum_buffer"]) for a, b in zip(ref, mine))
