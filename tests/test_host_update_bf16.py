"""``Trainer(update="host", grad_transfer="bf16")``: float32 masters on the host, the updated
parameters sent back to every device in bf16 (half the bytes); every replica holds the masters'
bf16 rounding, bitwise, and training equals one device that keeps float32 masters, runs forward
and backward on their rounding and reads the gradient the bf16 wire documents (docs/cuda.md)."""
from __future__ import annotations

import contextlib
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import cgdp
from helpers import mlp
from test_comm_inproc import on_ranks
from test_grad_transfer import device_grads
from test_host_update import batches

MAKE = partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=False)  # the same kernel on both sides


def reference(model, data, g):
    """One device: float32 masters; weights = their bf16 rounding; the gradient
    bf16(sum_j float32(bf16(g_j))) in device order (g_j: device j's weighted gradient)."""
    masters = [p.detach().clone() for p in model.parameters()]
    opt = MAKE(masters)
    for x, y in data:
        m = copy.deepcopy(model)
        with torch.no_grad():
            for p, w in zip(m.parameters(), masters):
                p.copy_(w.bfloat16())
        parts = device_grads(m, x, y, g)
        for k, w in enumerate(masters):
            s = parts[0][k].bfloat16().float()
            for j in range(1, g):
                s = s + parts[j][k].bfloat16().float()
            w.grad = s.bfloat16().float()
        opt.step()
    return masters


def check(tr, masters):
    """Replica 0's state_dict() holds the masters, every replica their rounding, bitwise."""
    sd = tr.state_dict()["model"]
    names = [n for n, _ in tr.replicas[0].named_parameters()]
    for n, w in zip(names, masters):
        assert torch.equal(sd[n], w), n
    for r in tr.replicas:
        for (n, p), w in zip(r.named_parameters(), masters):
            assert p.dtype == torch.float32 and torch.equal(p.detach().cpu(), w.bfloat16().float()), n


@pytest.mark.parametrize("devices", [["cpu:0", "cpu:1"], ["cuda:0", "cuda:1"]])
def test_parameters_go_back_in_bf16_and_equal_one_device_with_float32_masters(devices):
    from cgdp.testing import simulated_cuda
    model, data = mlp(), batches(3, n=12)
    masters = reference(model, data, 2)
    sent = {}
    for transfer in (None, "bf16"):
        with simulated_cuda(2, seed=2) if devices[0].startswith("cuda") else contextlib.nullcontext() as sim:
            with cgdp.Trainer(copy.deepcopy(model), MAKE, devices, chunks=2, update="host",
                              grad_transfer=transfer) as tr:
                for x, y in data:
                    tr.step(x, y, F.cross_entropy)
                    assert tr.stats["host_update_overlapped"] == 1.0  # chunk by chunk, with backward
                sent[transfer] = tr.stats["host_update_bytes_back"]
                if transfer:
                    check(tr, masters)
                    report = tr.memory_report()["host"]
        if sim is not None:
            assert not sim.errors
            assert sim.copied_bytes["h2d"] == 0  # no gradient comes back: the host reads its own bf16 sum
    n = sum(p.numel() for p in model.parameters())
    assert sent == {None: 4 * n, "bf16": 2 * n}  # per device, per step
    assert report["transfer"] >= 2 * n


@pytest.mark.parametrize("devices", [["cpu:0", "cpu:1"], ["cuda:0", "cuda:1"]])
def test_a_checkpoint_holds_the_masters_and_resumes_exactly(devices):
    """state_dict() saves the float32 masters (not the rounded replicas); a new Trainer loads
    them, rounds its replicas, and goes on as the uninterrupted run; close() leaves the model
    holding the masters."""
    from cgdp.testing import simulated_cuda
    with simulated_cuda(2, seed=5) if devices[0].startswith("cuda") else contextlib.nullcontext() as sim:
        _checkpoint_round_trip(devices)
    assert sim is None or not sim.errors


def _checkpoint_round_trip(devices):
    model, data = mlp(), batches(4, n=12)
    masters = reference(model, data, 2)
    kw = dict(chunks=1, update="host", grad_transfer="bf16")
    with cgdp.Trainer(copy.deepcopy(model), MAKE, devices, **kw) as tr:
        for x, y in data[:2]:
            tr.step(x, y, F.cross_entropy)
        saved = copy.deepcopy(tr.state_dict())
        assert all(not torch.equal(v, v.bfloat16().float()) for v in saved["model"].values())
        clone = copy.deepcopy(tr.replicas[0])  # a deep copy of the module keeps its own (rounded) values
        assert all(map(torch.equal, clone.state_dict().values(), [p.detach() for p in tr.replicas[0].parameters()]))
    mine = copy.deepcopy(model)
    with cgdp.Trainer(mine, MAKE, devices, **kw) as tr:
        tr.load_state_dict(saved)
        for x, y in data[2:]:
            tr.step(x, y, F.cross_entropy)
        check(tr, masters)
    assert all(torch.equal(p.detach().cpu(), w) for p, w in zip(mine.parameters(), masters))  # close(): the masters
    assert all(torch.equal(v.cpu(), w) for v, w in zip(mine.state_dict().values(), masters))


def test_a_failed_step_keeps_the_masters_unrounded():
    """A step post-hook raises once: the masters come back from their copy, not from the rounded
    replicas, and training equals one device skipping that batch."""
    model, data = mlp(), batches(3, n=12)
    masters = reference(model, [data[0], data[2]], 2)
    with cgdp.Trainer(copy.deepcopy(model), MAKE, ["cpu:0", "cpu:1"], chunks=1, update="host",
                      grad_transfer="bf16") as tr:
        calls = []

        def hook(*_):
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("once")
        tr.optimizers[0].register_step_post_hook(hook)
        tr.step(*data[0], F.cross_entropy)
        with pytest.raises(ValueError, match="once"):
            tr.step(*data[1], F.cross_entropy)
        tr.step(*data[2], F.cross_entropy)
        check(tr, masters)


def test_a_load_into_the_model_reaches_every_replica_and_the_masters():
    """model.load_state_dict() between steps: the replicas' follower reads replica 0's loaded
    values (not the masters, which take them before the next step), and the next step starts
    from them on every replica, rounded."""
    model, data = mlp(), batches(2, n=12)
    masters = reference(model, data[1:], 2)
    with cgdp.Trainer(mlp(), MAKE, ["cpu:0", "cpu:1"], chunks=1, update="host", grad_transfer="bf16") as tr:
        tr.step(*data[0], F.cross_entropy)
        tr.optimizers[0].state.clear()
        tr.replicas[0].load_state_dict(model.state_dict())
        for r in tr.replicas:
            assert all(map(torch.equal, r.parameters(), model.parameters()))
        tr.step(*data[1], F.cross_entropy)
        check(tr, masters)


def test_two_ranks_allreduce_then_round_once_and_stay_identical():
    """With ranks the bf16 sum is rounded once after the float32 allreduce: two ranks of one
    device each train as two devices do, bitwise, and hold the same masters."""
    model, data = mlp(), batches(3, n=12)
    masters = reference(model, data, 2)

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), MAKE, ["cpu:0"], comm=comm, chunks=2, update="host",
                          grad_transfer="bf16", timeout_s=30) as tr:
            for x, y in data:
                tr.step(torch.tensor_split(x, 2)[comm.rank], torch.tensor_split(y, 2)[comm.rank], F.cross_entropy)
            check(tr, masters)
            return tr.state_dict()["model"]

    states = on_ranks(2, rank, timeout_s=60)
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_backward_failing_after_chunks_were_stepped_keeps_the_masters_unrounded():
    """Overlapped: a backward that raises after the host stepped the last layer's chunk undoes it
    from the masters' own copy (not the rounded replicas'); training equals one device skipping
    that batch."""
    from test_dataparallel import _Boom
    from test_host_update import _FailsPartway
    torch.manual_seed(0)
    model, data = _FailsPartway(), batches(3, n=12)
    _Boom.fail = False
    masters = reference(model, [data[0], data[2]], 2)
    with cgdp.Trainer(copy.deepcopy(model), MAKE, ["cpu:0", "cpu:1"], chunks=2, update="host",
                      grad_transfer="bf16") as tr:
        try:
            for i, (x, y) in enumerate(data):
                _Boom.fail = i == 1
                if i == 1:
                    with pytest.raises(RuntimeError, match="^boom$"):
                        tr.step(x, y, F.cross_entropy)
                else:
                    tr.step(x, y, F.cross_entropy)
                    assert tr.stats["host_update_overlapped"] == 1.0
        finally:
            _Boom.fail = True  # that module's default
        check(tr, masters)


def test_after_backward_the_whole_row_is_widened():
    """Clipping keeps the update after backward: the whole bf16 row is widened then; no norm
    reached the bound here, so it trains as the reference."""
    model, data = mlp(), batches(2, n=12)
    masters = reference(model, data, 2)
    with cgdp.Trainer(copy.deepcopy(model), MAKE, ["cpu:0", "cpu:1"], chunks=2, update="host",
                      grad_transfer="bf16", clip_grad_norm=1e9) as tr:
        for x, y in data:
            tr.step(x, y, F.cross_entropy)
            assert tr.stats["host_update_overlapped"] == 0.0
        check(tr, masters)


def test_tied_parameters_and_submodules_hold_the_masters_in_their_state_dict():
    """A tied parameter's every name, and a submodule's own state_dict(), hold the float32 masters
    (only the first name did, and the top module only): a checkpoint resumes exactly."""
    from helpers import TokenLM, token_batches, token_sum
    data = token_batches(4, 6)

    def train(batches, state=None):
        with cgdp.Trainer(TokenLM(), MAKE, ["cpu:0", "cpu:1"], update="host", grad_transfer="bf16",
                          chunks=1) as tr:
            if state is not None:
                tr.load_state_dict(state)
            for b in batches:
                tr.step(b, token_sum)
            model = tr.replicas[0]
            sd = model.state_dict()
            assert torch.equal(sd["emb.weight"], sd["out.weight"])
            assert torch.equal(model.emb.state_dict()["weight"], sd["emb.weight"])
            assert torch.equal(model.mix.state_dict()["weight"], sd["mix.weight"])
            assert not torch.equal(sd["mix.weight"], model.mix.weight.detach())  # the masters, not the rounding
            return copy.deepcopy(tr.state_dict())

    full = train(data)
    resumed = train(data[2:], train(data[:2]))
    for k, v in full["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
