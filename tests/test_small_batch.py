"""A batch smaller than the devices (a data loader's last batch with ``drop_last=False``): both faces
run it on the first n devices, one sample each, and the result is one device's. The devices without
samples run no forward (BatchNorm would refuse an empty batch), send zeros to the host sum and step
their replicas with the others."""
import copy
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.testing import simulated_cuda
from helpers import (assert_params_close, assert_replicas_identical, bound, mlp, reference_step2, token_batches,
                     token_mean, token_sum, TokenLM)

SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731


def devs(g):
    return [f"cpu:{i}" for i in range(g)]


def data(n, steps=3, shape=(12,), classes=5):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(n, *shape, generator=gen), torch.randint(0, classes, (n,), generator=gen))
            for _ in range(steps)]


class BNNet(nn.Module):
    """BatchNorm2d: one sample per device still has 16 values per channel."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def train(face, net, g, batches, **kw):
    """``net`` trained in place on g emulated devices (or the device list g) by ``face``; replicas
    checked identical after every step; the losses."""
    losses = []
    devices = devs(g) if isinstance(g, int) else g
    if face == "trainer":
        with cgdp.Trainer(net, SGD, devices, **kw) as tr:
            for x, y in batches:
                losses.append(tr.step(x, y, F.cross_entropy))
                assert_replicas_identical(tr)
        return losses
    with cgdp.DataParallel(net, devices, **kw) as model:
        return loop(model, batches)


def loop(model, batches):
    """The user's own loop, for an ``nn.Module`` and a ``cgdp.DataParallel`` alike."""
    opt, losses = bound(model, SGD(model.parameters())), []
    for x, y in batches:
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y.to(out.device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if isinstance(model, cgdp.DataParallel):
            assert_replicas_identical(model)
    return losses


def plain(net, batches):
    net = copy.deepcopy(net)
    return net, loop(net, batches)


def assert_states_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs"


@pytest.mark.parametrize("face, kw", [("trainer", {}), ("trainer", {"mode": "typical"}),
                                      ("trainer", {"update": "host"}), ("dataparallel", {})])
@pytest.mark.parametrize("g, n", [(2, 1), (3, 1), (3, 2)])
def test_a_batch_smaller_than_the_devices_trains_as_one_device(face, kw, g, n):
    """Equal to one device (to float32 rounding, as any split; bitwise for one sample, which one
    device computes alone with weight 1 while the others add zeros), and bitwise equal to the
    same face on n devices: the idle devices change nothing."""
    batches = data(n)
    net, on_n = mlp(), mlp()
    ref, ref_losses = plain(net, batches)
    losses = train(face, net, g, batches, **kw)
    assert train(face, on_n, n, batches, **kw) == losses
    assert_states_equal(net, on_n)
    assert_params_close(net, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    if n == 1 and kw.get("update") != "host":  # (the host's optimizer is fp32 masters' own kernel)
        assert_states_equal(net, ref)
        assert losses == ref_losses


@pytest.mark.parametrize("face", ["trainer", "dataparallel"])
@pytest.mark.parametrize("n", [1, 2])
def test_devices_without_samples_change_nothing(face, n):
    """BatchNorm's statistics and counter included: 3 devices with n samples train bitwise as n
    devices do (n = 1: as one device)."""
    batches = data(n, shape=(1, 4, 4))
    on_n, on_3 = BNNet(), BNNet()
    train(face, on_n, n, batches)
    train(face, on_3, 3, batches)
    assert_states_equal(on_3, on_n)
    assert int(on_3.bn.num_batches_tracked) == len(batches)
    if n == 1:
        assert_states_equal(on_3, plain(BNNet(), batches)[0])


@pytest.mark.parametrize("loss_fn, g, n", [(token_sum, 3, 2), (token_sum, 2, 1), (token_mean, 2, 1)])
def test_weighted_losses_with_a_batch_smaller_than_the_devices(loss_fn, g, n):
    """``(loss_sum, count)`` pairs: the idle device's count is 0, the weight 1 / (the others' counts).
    A model's own token mean: exact on one sample (and no warning about padding: one part)."""
    batches = token_batches(3, n)
    model = TokenLM()
    ref, ref_losses = reference_step2(model, SGD, batches, loss_fn)
    with warnings.catch_warnings(), cgdp.Trainer(model, SGD, devs(g)) as tr:
        warnings.simplefilter("error")
        losses = []
        for b in batches:
            losses.append(tr.step(b, loss_fn))
            assert_replicas_identical(tr)
    assert_params_close(model, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_micro_batches_need_as_many_samples_on_every_device_with_samples_as_on_one():
    x, y = data(1)[0]
    said = []
    for g in (1, 2):
        with cgdp.Trainer(mlp(), SGD, devs(g), micro_batches=2) as tr:
            with pytest.raises(ValueError, match="micro_batches=2 needs at least 2 samples") as e:
                tr.step(x, y, F.cross_entropy)
            said.append(str(e.value))
            tr.step(*data(4)[0], F.cross_entropy)  # still usable
    assert said[0] == said[1]


def test_an_empty_batch_is_refused_by_both_faces():
    x, y = data(0)[0]
    with cgdp.Trainer(mlp(), SGD, devs(2)) as tr:
        with pytest.raises(ValueError, match="empty batch"):
            tr.step(x, y, F.cross_entropy)
        with pytest.raises(ValueError, match="empty batch"):
            tr.step({"x": x}, lambda m, b: m(b["x"]).sum())
    with cgdp.DataParallel(mlp(), devs(2)) as model:
        with pytest.raises(ValueError, match="empty batch"):
            model(x)


def test_devices_without_samples_on_the_cuda_backend():
    """The same rule on the CUDA backend (the strict simulated runtime): an idle device's chunks
    are sent by its flush, ordered as any other copy; bitwise as on n devices."""
    batches = data(2, shape=(1, 4, 4))
    got = {}
    for g in (2, 3):
        with simulated_cuda(g, seed=1) as sim:
            for face in ("trainer", "dataparallel"):
                got[face, g] = BNNet()
                train(face, got[face, g], [f"cuda:{i}" for i in range(g)], batches)
        assert not sim.errors
    for face in ("trainer", "dataparallel"):
        assert_states_equal(got[face, 3], got[face, 2])


def test_an_empty_batch_on_one_rank_is_refused_on_every_rank_at_once():
    """Rank 1 gets no sample (then a batch it cannot split): both ranks refuse the step in its
    first collective (rank 0 waited for timeout_s before), nothing is applied, and the next step
    trains on both, in step."""
    from test_comm_inproc import on_ranks
    model, x, y = mlp(), torch.randn(4, 12), torch.randint(0, 5, (4,))

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, ["cpu:0", "cpu:1"], comm=comm, timeout_s=120) as tr:
            before = [p.detach().clone() for p in tr.replicas[0].parameters()]
            t0 = time.monotonic()
            with pytest.raises(ValueError, match="empty batch" if comm.rank else "another rank refused"):
                tr.step(x if comm.rank == 0 else x[:0], y if comm.rank == 0 else y[:0], F.cross_entropy)
            waited = time.monotonic() - t0
            with pytest.raises(TypeError if comm.rank else ValueError):  # one it cannot split, too
                tr.step(x if comm.rank == 0 else x.tolist(), y, F.cross_entropy)
            assert all(torch.equal(a, b) for a, b in zip(before, tr.replicas[0].parameters()))
            tr.step(x, y, F.cross_entropy)
            return waited, [p.detach().clone() for p in tr.replicas[0].parameters()]
    (w0, p0), (w1, p1) = on_ranks(2, rank, timeout_s=120)
    assert max(w0, w1) < 60  # at once, not after timeout_s
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
