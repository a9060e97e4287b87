"""The host path's shortcuts change no bit: emulated copies made inline or by the stream workers,
large gradients handed over whole instead of added into a zeroed flat buffer."""

import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.engine.backend import cpu as cpu_backend
from cgdp.engine.core import stream as stream_mod
from helpers import assert_replicas_identical


class Net(nn.Module):
    """Large and small layers, exact zeros (dead units, zero inputs: gradients of -0.0), and a
    large layer used only on samples whose first feature is > 100 (idle on some devices)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(160, 160)
        self.b = nn.Linear(160, 8)
        self.rare = nn.Linear(160, 160)
        self.s = nn.Parameter(torch.randn(1 << 14))
        with torch.no_grad():
            self.a.weight[:7] = 0.0

    def forward(self, x):
        h = torch.relu(self.a(x))
        idx = (x[:, 0] > 100).nonzero().squeeze(1)
        if idx.numel():
            h = h.index_add(0, idx, self.rare(x[idx] / 100))
        return self.b(h)


def bits(tensors):
    return [t.detach().clone().view(torch.int32) for t in tensors]


C = torch.where(torch.arange(1 << 14) % 3 == 0, -0.0, 0.5)
"""The gradient of (s * C).sum(): exactly C, so -0.0 on every device in a third of the elements."""


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y) + (model.s * C).sum()


def train(devices=3, steps=4, **kw):
    g = torch.Generator().manual_seed(1)
    with cgdp.Trainer(Net(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), [f"cpu:{i}" for i in range(devices)],
                      chunks=1, **kw) as tr:
        for step in range(steps):
            x = torch.randn(9, 160, generator=g)
            x[:, 1:4] = -0.0
            if step % 2:
                x[0, 0] = 500.0  # the rare layer runs on device 0's part only
            tr.step((x, torch.randint(0, 8, (9,), generator=g)), loss_fn)
            assert_replicas_identical(tr)
        r = tr.replicas[-1]
        return bits(r.parameters()) + bits(p.grad for p in r.parameters() if p.grad is not None)


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_large_gradients_handed_over_give_the_bits_of_a_zeroed_buffer(monkeypatch):
    assert Net().a.weight.numel() >= stream_mod.LARGE_ELEMS  # the shortcut is taken
    handed = train()
    monkeypatch.setattr(stream_mod, "LARGE_ELEMS", 1 << 40)  # every gradient added into zeros
    added = train()
    assert same(handed, added)
    monkeypatch.setattr(stream_mod, "LARGE_ELEMS", 1)  # every gradient handed over
    assert same(train(micro_batches=3), (monkeypatch.undo(), train(micro_batches=3))[1])


def test_copies_inline_or_on_the_stream_workers_give_the_same_bits(monkeypatch):
    """Emulated copies up to INLINE_BYTES run on the thread that issues them, larger ones on the
    stream workers: results must not depend on which."""
    inline = train(devices=2, segment_bytes=4096)
    monkeypatch.setattr(cpu_backend, "INLINE_BYTES", 0)  # every copy through a worker
    assert same(inline, train(devices=2, segment_bytes=4096))


def test_one_default_for_both_faces():
    """chunks="auto" for Trainer and DataParallel; modes that send nothing during backward tune nothing."""
    import inspect
    assert inspect.signature(cgdp.Trainer).parameters["chunks"].default == "auto"
    assert inspect.signature(cgdp.DataParallel).parameters["chunks"].default == "auto"
    with cgdp.Trainer(Net(), lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"]) as tr:
        assert tr.tuner is not None and tr.tuner.name == "auto"
    with cgdp.Trainer(Net(), lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"], mode="typical") as tr:
        assert tr.tuner is None and len(tr.plan) == len(tr.layers)
