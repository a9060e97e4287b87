"""Host memory bounded: ``host_memory=`` turns the host slots into a ring that does not grow with
the model, with results bitwise those of full-size slots; the 16-bit path writes no float32 sum."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.testing import simulated_cuda
from helpers import assert_replicas_identical
from cgdp.testing import inside

SEG = 4096  # bytes per segment: many segments for small models
SGD = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731


def net(width=64, depth=6, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])


def ring_bytes(devices, slots, seg=SEG, itemsize=4):
    return slots * (devices + 1) * seg  # (G + 1) rows of one segment per slot (float32)


def train(devices, model, steps=3, dtype=torch.float32, **kw):
    g = torch.Generator().manual_seed(1)
    width = model[0].in_features
    with cgdp.Trainer(model, SGD, devices, chunks=2, segment_bytes=SEG, clip_grad_norm=0.5, **kw) as tr:
        for _ in range(steps):
            x, y = torch.randn(12, width, generator=g).to(dtype), torch.randn(12, width, generator=g).to(dtype)
            tr.step(x, y, F.mse_loss)
            assert_replicas_identical(tr)
        st = inside(tr).stream
        layout = {"segments": len(st.layout.segments), "ring": st.ring}
        return [p.detach().clone() for p in tr.replicas[-1].parameters()], st.host.registered_bytes, layout


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("devices", [2, 3])
def test_ring_is_bitwise_full_size_slots_with_clipping(devices):
    names = [f"cpu:{i}" for i in range(devices)]
    full, full_bytes, lay = train(names, net())
    ring, ring_bytes_, lay = train(names, net(), host_memory=ring_bytes(devices, 3))
    assert lay["ring"] == 3 and lay["segments"] > 3 * 3  # every slot reused several times per step
    assert same(full, ring)
    assert ring_bytes_ == ring_bytes(devices, 3) < full_bytes


def test_ring_under_the_strict_simulator(monkeypatch):
    """The simulated CUDA runtime lands copies late (the copies back very late, here): reusing a
    slot before the copy back read it, or before the host summed it, shows as a wrong result."""
    from cgdp.engine.backend import cuda as cuda_backend
    real = cuda_backend.CudaDevice.give_back

    def late(self, s):
        with self.rt.stream(self.h2d):
            self.rt.cuda._sleep(int(0.004 * 1e9))  # device time on the H2D stream, as on a GPU
        real(self, s)
    monkeypatch.setattr(cuda_backend.CudaDevice, "give_back", late)
    full, _, _ = train(["cpu:0", "cpu:1", "cpu:2"], net())
    with simulated_cuda(3, seed=4, max_delay_s=0.002) as sim:
        ring, reg, _ = train(["cuda:0", "cuda:1", "cuda:2"], net(), host_memory=ring_bytes(3, 2))
        assert sum(sim.registered.values()) == 0  # freed on close
    assert not sim.errors and same(full, ring) and reg == ring_bytes(3, 2)


def test_registered_memory_does_not_grow_with_the_model():
    """A model 4x larger at the same host_memory registers the same bytes (full-size slots: 4x)."""
    small = net(width=64)
    large = net(width=128)
    assert sum(p.numel() for p in large.parameters()) > 3.9 * sum(p.numel() for p in small.parameters())
    budget = ring_bytes(2, 4)
    _, small_ring, _ = train(["cpu:0", "cpu:1"], small, steps=1, host_memory=budget)
    _, large_ring, _ = train(["cpu:0", "cpu:1"], large, steps=1, host_memory=budget)
    _, small_full, _ = train(["cpu:0", "cpu:1"], net(width=64), steps=1)
    _, large_full, _ = train(["cpu:0", "cpu:1"], net(width=128), steps=1)
    assert small_ring == large_ring == budget
    assert large_full > 3.9 * small_full


def test_ring_with_dataparallel_on_one_backward_thread():
    """On emulated devices autograd runs every replica's backward on one thread: a slot that is
    busy must never make that thread wait inside a hook (it would wait for itself)."""
    def run(**kw):
        g = torch.Generator().manual_seed(1)
        with cgdp.DataParallel(net(), ["cpu:0", "cpu:1"], chunks=2, segment_bytes=SEG, timeout_s=30, **kw) as dp:
            opt = dp.bind(torch.optim.SGD(dp.parameters(), lr=0.1))
            for _ in range(3):
                x, y = torch.randn(12, 64, generator=g), torch.randn(12, 64, generator=g)
                opt.zero_grad()
                F.mse_loss(dp(x), y).backward()
                dp.clip_grad_norm_(0.5)
                opt.step()
            return [p.detach().clone() for p in dp.replicas[1].parameters()]
    assert same(run(), run(host_memory=ring_bytes(2, 2)))


@pytest.mark.parametrize("kw", [{"dtype": torch.bfloat16}, {"grad_transfer": "bf16"}])
def test_ring_with_16_bit_gradients(kw):
    dtype = kw.get("dtype", torch.float32)
    extra = {k: v for k, v in kw.items() if k != "dtype"}
    full, _, _ = train(["cpu:0", "cpu:1"], net().to(dtype), dtype=dtype, **extra)
    ring, reg, _ = train(["cpu:0", "cpu:1"], net().to(dtype), dtype=dtype, host_memory=ring_bytes(2, 3, itemsize=2), **extra)
    assert same(full, ring)


def test_16_bit_sum_writes_no_float32_row():
    """Without a comm the kernel rounds the float32 sum in cache: the host holds only the G + 1
    16-bit rows, and moves (6G + 2) bytes per element per step, not 6G + 6."""
    model = net().to(torch.bfloat16)
    with cgdp.Trainer(model, SGD, ["cpu:0", "cpu:1"], chunks=2) as tr:
        host = inside(tr).stream.host
        total = inside(tr).stream.layout.total
        assert host.registered_bytes == 3 * total * 2
        assert host.traffic()["total"] == (6 * 2 + 2) * total


def test_host_memory_too_small_says_what_to_do():
    with pytest.raises(ValueError, match="host_memory=.*needs at least .* or a smaller segment_bytes"):
        cgdp.Trainer(net(), SGD, ["cpu:0", "cpu:1"], segment_bytes=SEG, host_memory=ring_bytes(2, 1))
    with pytest.raises(ValueError, match="host_memory must be a positive int"):
        cgdp.Trainer(net(), SGD, ["cpu:0", "cpu:1"], host_memory=-5)


def test_profile_reports_registered_and_moved_host_bytes():
    with cgdp.Trainer(net(), SGD, ["cpu:0", "cpu:1"], chunks=1, profile=True) as tr:
        tr.step(torch.randn(8, 64), torch.randn(8, 64), F.mse_loss)
        p = tr.last_profile
        total = inside(tr).stream.layout.total
    assert p.host_registered_bytes == 3 * total * 4
    assert p.host_bytes_moved == (3 * 2 + 1) * total * 4  # (3G + 1) x the gradient bytes
    assert np.isfinite(p.step_s)
