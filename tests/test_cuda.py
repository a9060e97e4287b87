"""The engine on real CUDA streams and pinned memory (skipped without a GPU).

With one GPU, ``["cuda:0"]`` in mode 'cgdp' still makes the full host round trip: every chunk is
copied to pinned memory on the D2H stream, summed on the host, and copied back on the H2D stream.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from helpers import SmallCNN, assert_params_close, assert_replicas_identical, mlp, reference

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def exact_cudnn():
    # deterministic kernels and no TF32, so that 1e-5 against the reference is a fair test
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, allow_tf32=False):
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        yield
        torch.backends.cuda.matmul.allow_tf32 = old

SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731


def gpus():
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


@pytest.mark.parametrize("mode", ["cgdp", "typical"])
@pytest.mark.parametrize("opt", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize("chunks", [1, 2, "one"])
def test_equivalence_on_cuda(mode, opt, chunks):
    model = SmallCNN()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(10, 1, 8, 8, generator=g), torch.randint(0, 10, (10,), generator=g))
            for _ in range(4)]
    ref, _ = reference(model.cuda(), opt, [(x.cuda(), y.cuda()) for x, y in data], F.cross_entropy)
    plan = [[2, 1, 0]] if chunks == "one" else chunks
    with cgdp.Trainer(model, opt, gpus(), mode=mode, chunks=plan) as tr:
        for x, y in data:
            tr.step(x, y, F.cross_entropy)
            assert_replicas_identical(tr)
        assert_params_close(tr.replicas[0], ref)


def test_host_memory_is_pinned_and_sized_g_plus_one():
    model = mlp((64, 256, 256, 10)).cuda()
    with cgdp.Trainer(model, SGD, gpus()) as tr:
        host = tr._stream.host._host
        assert host.is_pinned()
        assert host.shape[0] == len(gpus()) + 1


def test_d2h_copy_overlaps_later_backward_work():
    """Device events: the first chunk (a large output layer) is copied to the host while the
    convolutions below it are still being differentiated."""
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.Sequential(*[nn.Conv2d(64, 64, 3, padding=1) for _ in range(8)])
            self.fc = nn.Linear(64 * 32 * 32, 512)

        def forward(self, x):
            return self.fc(torch.relu(self.convs(x)).flatten(1))

    with cgdp.Trainer(Deep(), SGD, gpus(), chunks=1) as tr:
        x, y = torch.randn(64, 64, 32, 32), torch.randint(0, 512, (64,))
        tr.step(x, y, F.cross_entropy)  # warm-up
        tr.trace_next()
        tr.step(x, y, F.cross_entropy)
        torch.cuda.synchronize()
        dev = tr._devs[0]
        stream, label, start, done = dev.copies[0]
        assert (stream, label) == ("d2h", "chunk 0")
        end = dev.compute_done  # recorded on the compute stream right after backward was issued
        # positive: the copy started and finished before backward's compute ended
        assert start.elapsed_time(end) > 0
        assert done.elapsed_time(end) > 0, "the D2H copy of chunk 0 did not overlap backward"
        prof_d2h = [c for c in dev.copies if c[0] == "h2d"]
        assert prof_d2h, "H2D copies are timed on CUDA too"
