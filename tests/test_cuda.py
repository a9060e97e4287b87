"""The engine on CUDA: real GPUs when the machine has them, otherwise one simulated GPU
(``cgdp.testing.simulated_cuda``), so that these tests run in CI too.

Every test trains two replicas on ``cuda:0`` (``share_devices=True``; and every further GPU when
there are several) on *different* parts of the batch: each replica's own gradient differs from the
average, so a copy back that lands late (or not at all) leaves a wrong update, which the
comparison with the single-device reference catches. With one replica on one GPU, the averaged
chunk equals the device's own and such a race writes the same bytes. On a GPU, ``bench/gpu_checks.py``
then runs the same kind of training under cgdp's stream-access checker (every cgdp thread) and
with delays injected at each ordering point (``TORCH_CUDA_SANITIZER=1`` sees none of cgdp's threads).
"""
import contextlib
import ctypes

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.engine.backend import cuda_runtime
from cgdp.testing import simulated_cuda
from helpers import SmallCNN, assert_params_close, assert_replicas_identical, mlp, reference
from cgdp.testing import inside

REAL = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def exact_cudnn():
    # deterministic kernels and no TF32, so that 1e-5 against the reference is a fair test
    with torch.backends.cudnn.flags(enabled=True, deterministic=True, allow_tf32=False):
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        yield
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def gpu():
    """The runtime: the real one on a GPU machine, else one simulated GPU (yields it, or None)."""
    with (contextlib.nullcontext() if REAL else simulated_cuda(1, seed=0, max_delay_s=0.002)) as sim:
        yield sim


SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731


def gpus() -> list[str]:
    """Two replicas on cuda:0, one on every further GPU: G >= 2 with different gradients."""
    n = torch.cuda.device_count() if REAL else 1
    return ["cuda:0"] + [f"cuda:{i}" for i in range(n)]


def on_ref(t):
    return t.cuda() if REAL else t


def split_gradients_differ(model, x, y, g) -> bool:
    """Whether each part's gradient differs from the whole batch's (what makes a race visible)."""
    grads = []
    for xp, yp in [(x, y)] + list(zip(torch.tensor_split(x, g), torch.tensor_split(y, g))):
        model.zero_grad()
        F.cross_entropy(model(xp), yp).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return all((gp - grads[0]).abs().max() > 1e-3 * grads[0].abs().max() for gp in grads[1:])


@pytest.mark.parametrize("mode", ["cgdp", "typical"])
@pytest.mark.parametrize("opt", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize("chunks", [1, 2, "one"])
def test_equivalence_on_cuda(gpu, mode, opt, chunks):
    # seeded: with a random init, Adam's steps on gradients that are rounding noise (a gradient that is
    # zero in exact arithmetic) exceeded 1e-5 about once in 20 runs (1.6e-5)
    torch.manual_seed(0)
    model = SmallCNN()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(10, 1, 8, 8, generator=g), torch.randint(0, 10, (10,), generator=g))
            for _ in range(4)]
    assert split_gradients_differ(SmallCNN(), *data[0], len(gpus()))
    ref, _ = reference(on_ref(model), opt, [(on_ref(x), on_ref(y)) for x, y in data], F.cross_entropy)
    plan = [[2, 1, 0]] if chunks == "one" else chunks
    with cgdp.Trainer(model, opt, gpus(), mode=mode, chunks=plan, segment_bytes=1024,
                      share_devices=True) as tr:
        for x, y in data:
            tr.step(x, y, F.cross_entropy)
            assert_replicas_identical(tr)
        assert_params_close(tr.replicas[0], ref)


class PointerAttributes(ctypes.Structure):
    """``cudaPointerAttributes`` as CUDA 12 and 13's driver_types.h declare it, its reserved words
    included: ``cudaPointerGetAttributes`` writes the whole struct (88 bytes on x86-64)."""
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                ("reserved", ctypes.c_long * 8)]


def test_pointer_attributes_hold_what_the_runtime_writes():
    """The runtime writes 88 bytes: a struct without the reserved words (24) would be overrun."""
    assert ctypes.sizeof(PointerAttributes) == 4 + 4 + 8 + 8 + 8 * 8
    assert PointerAttributes.reserved.offset == 24


def page_locked(ptr: int, sim) -> bool:
    """Whether the byte at ``ptr`` is page-locked host memory, as the CUDA driver sees it
    (``cudaPointerGetAttributes``). Not ``Tensor.is_pinned()``: torch asks about the storage's
    first byte, which for cgdp's rows lies in the unregistered page before them."""
    if sim is not None:
        return sim._pinned_at(ptr) is not None

    attrs = PointerAttributes()
    lib = cuda_runtime._load_cudart()
    assert lib is not None, "libcudart is not loaded"
    assert lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr)) == 0
    return attrs.type == 1  # cudaMemoryTypeHost


def test_host_memory_is_page_locked_and_sized_exactly(gpu):
    model = on_ref(mlp((64, 256, 256, 10)))
    with cgdp.Trainer(model, SGD, gpus(), share_devices=True) as tr:
        host = inside(tr).stream.host._host
        assert host.shape == (len(gpus()) + 1, inside(tr).stream.layout.total)
        first, last = host.data_ptr(), host.data_ptr() + host.numel() * 4 - 1
        assert page_locked(first, gpu) and page_locked(last, gpu)
        # as torch computes it: whether the storage's first byte is page-locked, which it is not
        # when that byte lies in the page before the rows (unless the allocation was page-aligned)
        start = host.untyped_storage().data_ptr()
        assert (host.is_pinned() if REAL else gpu.syncs.is_pinned(host)) == page_locked(start, gpu)
        # the allocation holds the rows, rounded up to whole pages, plus a page of alignment
        page = cuda_runtime.runtime().page_size
        assert host.untyped_storage().nbytes() <= host.numel() * 4 + 2 * page
        if not REAL:
            assert list(gpu.registered.values()) == [host.numel() * 4]


def test_each_replica_draws_its_own_dropout_masks(gpu):
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(12, 5)

        def forward(self, x):
            self.mask = F.dropout(torch.ones_like(x), 0.5, self.training)
            return self.lin(x * self.mask)

    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        with cgdp.Trainer(Drop(), SGD, gpus(), share_devices=True) as tr:
            tr.step(x, y, F.cross_entropy)
            runs.append([r.mask.cpu() for r in tr.replicas])
    assert not torch.equal(runs[0][0], runs[0][1])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.cuda


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

    with cgdp.Trainer(Deep(), SGD, ["cuda:0"], chunks=1) as tr:
        x, y = torch.randn(64, 64, 32, 32), torch.randint(0, 512, (64,))
        tr.step(x, y, F.cross_entropy)  # warm-up
        tr.trace_next()
        tr.step(x, y, F.cross_entropy)
        torch.cuda.synchronize()
        dev = inside(tr).devices[0]
        stream, label, start, done = dev.copies[0]
        assert (stream, label) == ("d2h", "chunk 0")
        end = dev.compute_done  # recorded on the compute stream right after backward was issued
        # positive: the copy started and finished before backward's compute ended
        assert start.elapsed_time(end) > 0
        assert done.elapsed_time(end) > 0, "the D2H copy of chunk 0 did not overlap backward"
        prof_d2h = [c for c in dev.copies if c[0] == "h2d"]
        assert prof_d2h, "H2D copies are timed on CUDA too"


def test_dataparallel_with_two_replicas_on_one_gpu(gpu):
    """``cgdp.DataParallel(..., share_devices=True)``: the one GPU checks that face too, each
    replica on a different part of the batch, against single-device autograd."""
    torch.manual_seed(0)
    model = SmallCNN()
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    ref, _ = reference(on_ref(model), SGD, [(on_ref(x), on_ref(y)) for x, y in data], F.cross_entropy)
    with pytest.raises(ValueError, match="share_devices=True"):
        cgdp.DataParallel(model, ["cuda:0", "cuda:0"])
    with cgdp.DataParallel(model, gpus(), chunks=2, share_devices=True) as dp:
        opt = dp.bind(SGD(dp.parameters()))
        for x, y in data:
            opt.zero_grad()
            out = dp(x)
            F.cross_entropy(out, y.to(out.device)).backward()
            opt.step()
            assert_replicas_identical(dp)
        assert_params_close(dp.module, ref)
