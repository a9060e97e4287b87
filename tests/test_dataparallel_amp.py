"""cgdp.DataParallel with ``torch.amp.GradScaler`` as PyTorch users write it, with the optimizers
that unscale inside their own step (fused AdamW and SGD, which GradScaler hands ``grad_scale`` and
``found_inf`` for the length of the step) and one it unscales before the step (foreach Adam, whose
unscaled gradients of replica 0 cgdp copies to every replica). Every replica steps as replica 0
does, a step with an inf gradient is skipped on every replica, and the parameters follow one
device's training."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import cgdp
from cgdp.testing import inside

DEVS = ["cpu:0", "cpu:1"]

OPTIMIZERS = {
    "fused AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "fused SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "foreach Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
}


def _step(model, opt, scaler, x, y):
    opt.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.filterwarnings("ignore:replica 0's gradients were changed after backward")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_grad_scaler_steps_every_replica_as_one_device(name):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ref = copy.deepcopy(net)
    model = cgdp.DataParallel(net, DEVS)
    opt, ropt = model.bind(OPTIMIZERS[name](model.parameters())), OPTIMIZERS[name](ref.parameters())
    scaler, rscaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if step == 2:
            x[0, 0] = float("inf")  # an inf gradient: the scaler skips this step and halves its scale
        _step(model, opt, scaler, x, y)
        _step(ref, ropt, rscaler, x, y)
        assert scaler.get_scale() == rscaler.get_scale()
        st = inside(model).stream
        for a, b in zip(st.params[0], st.params[1]):
            assert torch.equal(a, b), f"replicas differ after step {step}"
    assert scaler.get_scale() == 65536.0 / 2
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    model.close()
