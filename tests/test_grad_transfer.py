"""``grad_transfer="bf16"``: gradients cross the bus in bf16, the host sums them in float32.

The averaged gradient must equal, bit for bit, round_bf16(sum_j float32(round_bf16(g_j))) in
device order (g_j: device j's weighted gradient), stay within the documented bound of the float32
average, and make runs reproducible; the profile and the simulated bus show half the bytes.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import cgdp
from cgdp.testing import simulated_cuda
from helpers import assert_replicas_identical, mlp

SGD = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731


def batch(n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


def device_grads(model, x, y, g):
    """Each device's weighted gradient, as the engine forms it (backward with w_j)."""
    out = []
    for xp, yp in zip(torch.tensor_split(x, g), torch.tensor_split(y, g)):
        m = copy.deepcopy(model)
        loss = F.cross_entropy(m(xp), yp)
        torch.autograd.backward(loss, grad_tensors=torch.full((), xp.shape[0] / x.shape[0]))
        out.append([p.grad for p in m.parameters()])
    return out


@pytest.mark.parametrize("devices", [["cpu:0", "cpu:1", "cpu:2"], ["cuda:0", "cuda:1", "cuda:2"],
                                     ["cuda:0", "cuda:0"]])
def test_bf16_wire_is_exactly_the_documented_rounding(devices):
    model, (x, y) = mlp(), batch()
    g = len(devices)
    parts = device_grads(model, x, y, g)
    sim = simulated_cuda(len(set(devices)), seed=3) if devices[0].startswith("cuda") else None
    with (sim if sim else torch.no_grad()):
        with cgdp.Trainer(model, SGD, devices, chunks=1, grad_transfer="bf16", segment_bytes=1024,
                          share_devices=True) as tr:
            tr.step(x, y, F.cross_entropy)
            assert_replicas_identical(tr)
            got = [p.grad.clone() for p in tr.replicas[0].parameters()]
    for k, gk in enumerate(got):
        s = parts[0][k].bfloat16().float()
        for j in range(1, g):
            s = s + parts[j][k].bfloat16().float()
        assert torch.equal(gk, s.bfloat16().float()), f"parameter {k}"
        exact = sum(p[k].double() for p in parts)
        mags = sum(p[k].double().abs() for p in parts)
        bound = 2.0 ** -8 * (mags + exact.abs()) + g * 2.0 ** -24 * mags
        assert ((gk.double() - exact).abs() <= bound).all()


def test_bf16_training_is_deterministic_and_close():
    data = [batch(12, s) for s in range(4)]
    runs = []
    for transfer in ("bf16", "bf16", None):
        with cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], chunks=2, grad_transfer=transfer) as tr:
            for x, y in data:
                tr.step(x, y, F.cross_entropy)
            runs.append([p.detach().clone() for p in tr.replicas[0].parameters()])
    for a, b, c in zip(*runs):
        assert torch.equal(a, b)
        assert (a - c).abs().max() <= 1e-2 * c.abs().max()


def test_bf16_halves_the_bytes_on_the_bus_and_in_the_profile():
    x, y = batch()
    seen = {}
    for transfer in (None, "bf16"):
        with simulated_cuda(2, seed=4) as sim:
            with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks=1, profile=True,
                              grad_transfer=transfer) as tr:
                tr.step(x, y, F.cross_entropy)
                seen[transfer] = (dict(sim.copied_bytes), sum(c.bytes for c in tr.last_profile.chunks))
    (bus32, prof32), (bus16, prof16) = seen[None], seen["bf16"]
    assert bus16["d2h"] * 2 == bus32["d2h"] and bus16["h2d"] * 2 == bus32["h2d"]
    assert prof16 * 2 == prof32


def test_bad_grad_transfer():
    with pytest.raises(ValueError, match="grad_transfer must be None or 'bf16'"):
        cgdp.Trainer(mlp(), SGD, ["cpu:0"], grad_transfer="fp8")
    with pytest.raises(ValueError, match="mode='cgdp'"):
        cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:1"], mode="typical", grad_transfer="bf16")
