"""The engine against a plain single-device autograd reference, on CPU-emulated devices."""
import copy
import threading

import pytest
import torch
import torch.nn.functional as F

import cgdp
from cgdp.planning.chunks import one_chunk_plan
from helpers import (Gated, SmallCNN, Tied, WithBN, assert_params_close, assert_replicas_identical,
                     mlp, reference)
from cgdp.testing import inside

SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-4)  # noqa: E731


def batches(n_steps, n, shape=(12,), classes=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(n_steps)]


def run(model, make_opt, devices, data, loss_fn=F.cross_entropy, check_replicas=True, **kw):
    """Trains a copy of ``model`` (the trainer trains the model it gets in place)."""
    with cgdp.Trainer(copy.deepcopy(model), make_opt, devices, **kw) as tr:
        losses = []
        for x, y in data:
            losses.append(tr.step(x, y, loss_fn))
            if check_replicas:
                assert_replicas_identical(tr)
        return copy.deepcopy(tr.replicas[0]), losses


def devs(g):
    return [f"cpu:{i}" for i in range(g)]


@pytest.mark.parametrize("mode", ["cgdp", "typical"])
@pytest.mark.parametrize("g", [1, 2, 3, 4])
@pytest.mark.parametrize("opt", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize("chunks", ["k1", "k2", "one"])
def test_equivalence_mlp(mode, g, opt, chunks):
    model = mlp()
    plan = {"k1": 1, "k2": 2, "one": one_chunk_plan(4)}[chunks]
    data = batches(4, 10)  # 10 samples: uneven across 3 and 4 devices
    ref, ref_losses = reference(model, opt, data, F.cross_entropy)
    got, losses = run(model, opt, devs(g), data, mode=mode, chunks=plan)
    assert_params_close(got, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("plan", [[[2], [1, 0]], [[0, 2], [1]], [[1], [2], [0]]])
def test_equivalence_cnn_explicit_plans(plan):
    model = SmallCNN()
    data = batches(3, 9, shape=(1, 8, 8), classes=10)
    ref, _ = reference(model, SGD, data, F.cross_entropy)
    got, _ = run(model, SGD, devs(3), data, chunks=plan)
    assert_params_close(got, ref)


def test_single_mode():
    model = mlp()
    data = batches(3, 8)
    ref, _ = reference(model, ADAM, data, F.cross_entropy)
    got, _ = run(model, ADAM, ["cpu:0"], data, mode="single")
    assert_params_close(got, ref)


def test_tied_weights():
    model = Tied()
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 11, (7,), generator=g), torch.randint(0, 11, (7,), generator=g))
            for _ in range(3)]
    ref, _ = reference(model, SGD, data, F.cross_entropy)
    got, _ = run(model, SGD, devs(2), data, chunks=1)
    assert_params_close(got, ref)
    assert got.out.weight is got.emb.weight


@pytest.mark.parametrize("mode", ["cgdp", "typical"])
def test_unused_and_frozen_parameters(mode):
    """``extra`` is used only by device 0's samples, ``never`` by nobody, ``frozen`` trains not."""
    model = Gated()
    data = []
    for s in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(s))
        x[1, 0] = 250.0  # sample 1 lands on device 0 of 2 and uses ``extra``
        data.append((x, torch.randn(8, 4, generator=torch.Generator().manual_seed(10 + s))))
    ref, _ = reference(model, SGD, data, F.mse_loss)
    with cgdp.Trainer(model, SGD, devs(2), mode=mode, chunks=1) as tr:
        for x, y in data:
            tr.step(x, y, F.mse_loss)
            assert_replicas_identical(tr)
            for r in tr.replicas:
                assert r.never.weight.grad is None and r.never.bias.grad is None
                assert r.frozen.weight.grad is None
                assert r.extra.weight.grad is not None
        assert_params_close(tr.replicas[0], ref)
        # when no sample needs ``extra``, it gets no gradient anywhere: .grad is None again
        x = torch.randn(8, 6)
        tr.step(x, torch.randn(8, 4), F.mse_loss)
        for r in tr.replicas:
            assert r.extra.weight.grad is None
        tr.step(data[0][0], data[0][1], F.mse_loss)
        assert tr.replicas[1].extra.weight.grad is not None


def test_batchnorm_buffers_identical_and_batch_weighted():
    model = WithBN()
    data = batches(4, 10, shape=(6,), classes=3)
    ref, _ = reference(model, SGD, data, F.cross_entropy, n_parts=3)
    got, _ = run(model, SGD, devs(3), data)
    assert_params_close(got, ref)
    # running_mean: the batch-weighted mean of the devices' statistics is the global batch's
    single, _ = reference(model, SGD, data[:1], F.cross_entropy, n_parts=3)
    initial = copy.deepcopy(model)
    with cgdp.Trainer(model, SGD, devs(3)) as tr:
        tr.step(*data[0], F.cross_entropy)
        x = data[0][0]
        with torch.no_grad():
            h = initial.fc1(x)
        expect = 0.9 * torch.zeros(8) + 0.1 * h.mean(0)
        torch.testing.assert_close(tr.replicas[0].bn.running_mean, expect, rtol=1e-5, atol=1e-7)
        assert int(tr.replicas[2].bn.num_batches_tracked) == 1


def test_two_runs_are_bitwise_identical():
    model = SmallCNN()
    data = batches(3, 10, shape=(1, 8, 8), classes=10)
    a, la = run(model, ADAM, devs(3), data, chunks=2)
    b, lb = run(model, ADAM, devs(3), data, chunks=2)
    assert la == lb
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_cgdp_and_typical_give_the_same_bits():
    # both sum device contributions in device order in float32, then apply the same update
    model = mlp()
    data = batches(3, 12)
    a, _ = run(model, SGD, devs(3), data, mode="cgdp")
    b, _ = run(model, SGD, devs(3), data, mode="typical")
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_plan_switch_keeps_equivalence():
    model = mlp()
    data = batches(6, 10)
    ref, _ = reference(model, ADAM, data, F.cross_entropy)
    with cgdp.Trainer(model, ADAM, devs(2), chunks=1) as tr:
        for i, (x, y) in enumerate(data):
            if i == 2:
                tr.set_plan(2)
            if i == 4:
                tr.set_plan([[3, 2, 1, 0]])
            tr.step(x, y, F.cross_entropy)
        assert tr.plan == [[3, 2, 1, 0]]
        assert_params_close(tr.replicas[0], ref)


def test_grads_are_views_of_one_flat_buffer_in_chunk_order():
    model = mlp()
    with cgdp.Trainer(model, SGD, devs(2), chunks=2) as tr:
        tr.step(*batches(1, 4)[0], F.cross_entropy)
        flat = inside(tr).stream.flats[0]
        base = flat.untyped_storage().data_ptr()
        offsets = {}
        for p in tr.replicas[0].parameters():
            assert p.grad.untyped_storage().data_ptr() == base
            offsets[id(p)] = (p.grad.data_ptr() - flat.data_ptr()) // 4
        # the plan's first chunk (the last layers) sits at the start of the buffer
        last = list(tr.replicas[0].parameters())[-1]
        lo, hi = inside(tr).stream.layout.chunk_bounds[0]
        assert lo <= offsets[id(last)] < hi


def test_state_dict_round_trip_resumes_bitwise():
    model = mlp()
    data = batches(5, 8)
    full, _ = run(model, ADAM, devs(2), data)
    with cgdp.Trainer(model, ADAM, devs(2)) as tr:
        for x, y in data[:3]:
            tr.step(x, y, F.cross_entropy)
        state = copy.deepcopy(tr.state_dict())
    with cgdp.Trainer(mlp(seed=7), ADAM, devs(2)) as tr:
        tr.load_state_dict(state)
        assert tr.step_count == 3
        for x, y in data[3:]:
            tr.step(x, y, F.cross_entropy)
        for p, q in zip(tr.replicas[0].parameters(), full.parameters()):
            assert torch.equal(p, q)


def test_profile_and_trace():
    model = mlp((32, 256, 256, 256, 10))
    with cgdp.Trainer(model, SGD, devs(2), chunks=1) as tr:
        tr.step(*batches(1, 8, shape=(32,), classes=10)[0], F.cross_entropy)
        tr.profile_next()
        tr.trace_next()
        tr.step(*batches(1, 8, shape=(32,), classes=10)[0], F.cross_entropy)
        prof = tr.last_profile
        assert prof is not None and len(prof.chunks) == len(tr.plan) == 4
        assert sum(c.bytes for c in prof.chunks) == inside(tr).stream.layout.total * 4
        assert all(c.d2h_s > 0 and c.acc_s > 0 and c.h2d_s > 0 for c in prof.chunks)
        # layers become ready in backward order
        ready = prof.layer_ready_s
        assert ready[3] <= ready[2] <= ready[1] <= ready[0]
        streams = {(e["device"], e["stream"]) for e in tr.last_trace}
        for d in ("cpu:0", "cpu:1"):
            assert (d, "d2h") in streams and (d, "h2d") in streams
        assert ("host", "accumulate") in streams
        # the first chunk left for the host before the last layer's gradient was ready
        assert prof.chunks[0].sent_s < ready[0]
        tr.step(*batches(1, 8, shape=(32,), classes=10)[0], F.cross_entropy)
        assert tr.last_profile is prof  # profiling was for one step only


def test_close_removes_hooks_threads_and_buffers():
    before = {t.name for t in threading.enumerate()}
    model = mlp()
    tr = cgdp.Trainer(model, SGD, devs(3))
    tr.step(*batches(1, 6)[0], F.cross_entropy)
    replica = tr.replicas[0]
    tr.close()
    tr.close()  # idempotent
    for p in replica.parameters():
        assert not p._post_accumulate_grad_hooks
        assert p.grad is None
    left = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not [n for n in left if n.startswith("cgdp")], left
    with pytest.raises(RuntimeError, match="closed"):
        tr.step(*batches(1, 6)[0], F.cross_entropy)
    # the user's model is replica 0: after close it has neither hooks nor gradient views
    assert replica is model
    assert all(p.grad is None for p in model.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.parametrize("segment_bytes", [1024, 4096])
def test_segmented_chunks_are_exact(segment_bytes):
    """Chunks travel in many small segments, each summed and returned on its own."""
    model = mlp((12, 200, 100, 5))
    data = batches(3, 10)
    ref, _ = reference(model, ADAM, data, F.cross_entropy)
    with cgdp.Trainer(model, ADAM, devs(3), chunks=[[2, 1], [0]], segment_bytes=segment_bytes) as tr:
        assert len(inside(tr).stream.layout.segments) > 2 * len(tr.plan)
        for x, y in data:
            tr.step(x, y, F.cross_entropy)
            assert_replicas_identical(tr)
        assert_params_close(tr.replicas[0], ref)


def test_dropout_is_reproducible_on_emulated_devices_and_leaves_user_rng_alone():
    def run_once():
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 5))
        with cgdp.Trainer(model, SGD, devs(3)) as tr:
            user = torch.get_rng_state()
            for x, y in batches(4, 12):
                tr.step(x, y, F.cross_entropy)
                assert_replicas_identical(tr)
            assert torch.equal(torch.get_rng_state(), user)
            return [p.detach().clone() for p in tr.replicas[0].parameters()]
    a, b = run_once(), run_once()
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_trace_names_compute_spans():
    with cgdp.Trainer(mlp(), SGD, devs(2), chunks=1) as tr:
        tr.trace_next()
        tr.step(*batches(1, 8)[0], F.cross_entropy)
        names = {(e["device"], e["stream"], e["name"]) for e in tr.last_trace}
        for d in ("cpu:0", "cpu:1"):
            for phase in ("forward", "backward", "update"):
                assert (d, "compute", phase) in names


def test_grad_views_survive_a_user_zero_grad():
    """zero_grad(set_to_none=True) on a replica would make autograd store fresh tensors instead of
    adding into the flat buffer; the hooks put the views back and the result stays exact."""
    model = mlp()
    data = batches(4, 10)
    ref, _ = reference(model, SGD, data, F.cross_entropy)
    with cgdp.Trainer(model, SGD, devs(2)) as tr:
        for x, y in data:
            for opt in tr.optimizers:
                opt.zero_grad()  # sets every .grad to None
            tr.step(x, y, F.cross_entropy)
            assert_replicas_identical(tr)
        assert_params_close(tr.replicas[0], ref)


class WithConstant(torch.nn.Module):
    """A floating buffer the forward only reads (as rotary frequencies are), beside BatchNorm."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 64)
        self.bn = torch.nn.BatchNorm1d(64)
        self.register_buffer("freq", torch.rand(64))

    def forward(self, x):
        return self.bn(self.fc(x)) * self.freq


def test_buffers_the_step_does_not_write_stay_bitwise_constant():
    """1/3·v + 1/3·v + 1/3·v is not always v: averaging a constant buffer would make it drift."""
    model = WithConstant()
    freq, mean0 = model.freq.clone(), model.bn.running_mean.clone()
    with cgdp.Trainer(model, SGD, devs(3)) as tr:
        for x, y in batches(3, 9, shape=(6,), classes=64):
            tr.step(x, y, F.cross_entropy)
            assert_replicas_identical(tr)
    assert torch.equal(model.freq, freq)
    assert not torch.equal(model.bn.running_mean, mean0)  # written buffers are still averaged


def test_first_forward_that_draws_random_numbers_counts_once_in_batchnorm():
    """Emulated devices do the forward again, with a random stream each, the first time it
    draws: what that first try wrote into BatchNorm's statistics is undone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 2))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with torch.no_grad():
        h = model[0](x)
    with cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.0), devs(2)) as tr:
        tr.step(x, y, F.cross_entropy)
        assert inside(tr).rng.turns
        assert_replicas_identical(tr)
    assert int(model[1].num_batches_tracked) == 1
    expect = 0.1 * (0.5 * h[:4].mean(0) + 0.5 * h[4:].mean(0))
    torch.testing.assert_close(model[1].running_mean, expect, rtol=1e-5, atol=1e-7)
