"""bf16 and fp16 parameters: the host sums their gradients in float32 and rounds once."""
import copy

import pytest
import torch
import torch.nn.functional as F

import cgdp
from helpers import assert_replicas_identical, mlp

SGD = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731


def batches(n_steps, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g))
            for _ in range(n_steps)]


def single_device(model, data, dtype, clip=None):
    """Plain autograd training with parameters and inputs in ``dtype``."""
    model = copy.deepcopy(model).to(dtype)
    opt = SGD(model.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x.to(dtype)).float(), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def cgdp_training(model, data, dtype, g, **kw):
    with cgdp.Trainer(copy.deepcopy(model).to(dtype), SGD, [f"cpu:{i}" for i in range(g)], **kw) as tr:
        for x, y in data:
            tr.step(x.to(dtype), y, lambda out, t: F.cross_entropy(out.float(), t))
            assert_replicas_identical(tr)
        return copy.deepcopy(tr.replicas[0])


def rel_error(a, ref):
    """||a - ref|| / ||ref|| over all parameters (float64)."""
    pa = torch.cat([p.detach().double().reshape(-1) for p in a.parameters()])
    pr = torch.cat([p.detach().double().reshape(-1) for p in ref.parameters()])
    return ((pa - pr).norm() / pr.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["cgdp", "typical"])
def test_one_device_equals_single_device_training_bitwise(dtype, mode):
    model, data = mlp(), batches(4, 10)
    ref = single_device(model, data, dtype)
    got = cgdp_training(model, data, dtype, 1, mode=mode, chunks=2)
    for p, q in zip(got.parameters(), ref.parameters()):
        assert p.dtype == dtype and torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode,g", [("cgdp", 2), ("cgdp", 3), ("cgdp", 4), ("typical", 3)])
def test_error_is_that_of_single_device_low_precision_training(dtype, mode, g):
    """Against float32 training from the same (rounded) start, cgdp's error is no larger than
    single-device training's own rounding error in that dtype."""
    model, data = mlp(), batches(6, 10)  # uneven across 3 and 4 devices
    start = copy.deepcopy(model).to(dtype).float()
    exact = single_device(start, data, torch.float32)
    own = rel_error(single_device(start, data, dtype), exact)
    got = rel_error(cgdp_training(start, data, dtype, g, mode=mode, chunks=1), exact)
    assert own > 1e-4  # low precision really rounds
    assert got <= 1.5 * own, f"cgdp {got:.3g} vs single-device {dtype} {own:.3g}"


@pytest.mark.parametrize("micro", [1, 2])
def test_clipping_and_micro_batches_with_bf16_parameters(micro):
    model, data = mlp(), batches(6, 12)
    start = copy.deepcopy(model).to(torch.bfloat16).float()
    exact = single_device(start, data, torch.float32, clip=0.05)
    own = rel_error(single_device(start, data, torch.bfloat16, clip=0.05), exact)
    got = rel_error(cgdp_training(start, data, torch.bfloat16, 3, clip_grad_norm=0.05,
                                  micro_batches=micro), exact)
    assert got <= 1.5 * own, f"cgdp {got:.3g} vs single-device bf16 {own:.3g}"
    unclipped = rel_error(single_device(start, data, torch.float32), exact)
    assert unclipped > 10 * own  # clipping really changed training


def test_host_rounds_once_from_a_float32_sum():
    """Three devices whose bf16 gradients sum differently in bf16 and in float32: the replica
    gets the float32 sum rounded once."""
    lin = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    # per-sample gradient d(w*x)/dw = x; weights 1/3 each; loss = mean(w * x)
    x = torch.tensor([[1.0], [2 ** -8], [2 ** -8]], dtype=torch.bfloat16)
    with cgdp.Trainer(lin, lambda p: torch.optim.SGD(p, lr=1.0), ["cpu:0", "cpu:1", "cpu:2"]) as tr:
        tr.step(x, torch.zeros(3), lambda out, t: out.mean())
        grad = tr.replicas[0].weight.grad
    w = torch.tensor(1 / 3, dtype=torch.bfloat16)
    parts = [(w * x[i, 0]) for i in range(3)]  # each device's bf16 gradient
    chained = (parts[0] + parts[1]) + parts[2]  # bf16 additions
    once = (parts[0].float() + parts[1].float() + parts[2].float()).to(torch.bfloat16)
    assert not torch.equal(chained, once)  # the case tells the two apart
    assert torch.equal(grad.reshape(()), once)


@pytest.mark.filterwarnings("ignore:Complex modules")
def test_mixed_dtypes_are_refused_clearly():
    model = mlp()
    model[0].to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"share one dtype.*model.to\(torch.bfloat16\)"):
        cgdp.Trainer(copy.deepcopy(model), SGD, ["cpu:0"])
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16"):
        cgdp.Trainer(mlp().to(torch.complex64), SGD, ["cpu:0"])


def test_two_ranks_round_after_the_allreduce_as_one_rank_rounds_after_its_sum():
    """bf16, 2 in-process ranks × 1 device against 1 rank × 2 devices: both sum the two float32
    gradients in the same order and round once, so they train to the same bits (norms too)."""
    from test_comm_inproc import on_ranks
    model, data = mlp().to(torch.bfloat16), batches(3, 10)
    kw = dict(clip_grad_norm=0.05, chunks=1)
    loss = lambda out, t: F.cross_entropy(out.float(), t)  # noqa: E731
    with cgdp.Trainer(copy.deepcopy(model), SGD, ["cpu:0", "cpu:1"], **kw) as tr:
        norms = []
        for x, y in data:
            tr.step(x.bfloat16(), y, loss)
            norms.append(tr.stats["grad_norm"])
        one = {k: v.clone() for k, v in tr.replicas[0].state_dict().items()}

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, ["cpu:0"], comm=comm, timeout_s=30, **kw) as tr:
            got = []
            for x, y in data:
                tr.step(torch.tensor_split(x, 2)[comm.rank].bfloat16(),
                        torch.tensor_split(y, 2)[comm.rank], loss)
                got.append(tr.stats["grad_norm"])
            return {k: v.clone() for k, v in tr.replicas[0].state_dict().items()}, got

    for sd, got in on_ranks(2, rank, timeout_s=30):
        assert got == norms
        for k in sd:
            assert torch.equal(sd[k], one[k]), k
