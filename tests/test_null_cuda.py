"""The null CUDA runtime (cgdp.testing.null_cuda): the CUDA backend's own code with every CUDA call
a no-op, so a step's host cost can be counted and timed for any number of devices."""
import threading

import pytest
import torch
import torch.nn.functional as F

import cgdp
from cgdp.engine.backend import cuda as cuda_backend
from cgdp.engine.backend import cuda_runtime
from cgdp.testing import NullCuda, null_cuda
from helpers import mlp
from cgdp.testing import inside

SGD = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731


def test_runs_the_cuda_backend_and_counts_its_calls_per_step():
    g = 4
    with null_cuda(g) as rt:
        assert cuda_runtime.runtime() is rt and cuda_backend.cuda_count() == g
        with cgdp.Trainer(mlp(), SGD, [f"cuda:{j}" for j in range(g)], chunks=1, segment_bytes=1024) as tr:
            assert all(isinstance(d, cuda_backend.CudaDevice) for d in inside(tr).devices)
            x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
            tr.step(x, y, F.cross_entropy)
            lay = inside(tr).stream.layout
            chunks, segments = len(lay.plan), len(lay.segments)
            assert segments > chunks
            assert rt.registered_bytes == (g + 1) * lay.total * 4
            # no thread per device waits for completions: the host thread polls them all
            assert not [t.name for t in threading.enumerate() if t.name.endswith("-done")]
            rt.counts.clear()
            loss = tr.step(x, y, F.cross_entropy)
            c = dict(rt.counts)
    assert loss == loss
    assert c["copy"] == 2 * g * segments  # every segment out and back, on every device
    assert c["wait_event"] == g * chunks + g  # D2H on each chunk's ready event; compute on the marker
    assert c["event_synchronize"] == g * segments  # the host on each copy (the losses: one read)
    assert c.get("Event", 0) == 0  # untimed steps create no events: they are recorded again
    assert rt.registered_bytes == 0  # freed on close


def test_is_a_runtime_object_for_use_runtime():
    rt = NullCuda(2)
    with cuda_runtime.use_runtime(rt):
        with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks=2) as tr:
            tr.step(torch.randn(6, 12), torch.randint(0, 5, (6,)), F.cross_entropy)
    assert cuda_runtime.runtime() is not rt
    with pytest.raises(ValueError, match="at least one device"):
        NullCuda(0)


def test_profiled_steps_resolve_null_events():
    with null_cuda(2):
        with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks=1, profile=True) as tr:
            tr.step(torch.randn(6, 12), torch.randint(0, 5, (6,)), F.cross_entropy)
            assert tr.last_profile is not None and len(tr.last_profile.chunks) == len(tr.plan)
