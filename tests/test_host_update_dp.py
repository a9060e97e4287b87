"""``DataParallel(update="host")``: the user's own optimizer steps float32 masters on the host."""
from __future__ import annotations

import copy
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import cgdp
from test_comm_inproc import on_ranks
from helpers import assert_params_close, assert_ranks_equal_reference, bound, mlp

OPTIMIZERS = {
    "adamw": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adagrad": partial(torch.optim.Adagrad, lr=0.05),
}
DEVS = ["cpu:0", "cpu:1"]


def batches(n_steps=3, n=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(n_steps)]


def run(model, make, data, *, clip=None, sched=None, groups=False):
    """The user's loop, the same for one device and for cgdp.DataParallel."""
    if groups:  # two param groups with their own hyperparameters
        params = list(model.parameters())
        opt = bound(model, make([{"params": params[:2], "lr": 0.02}, {"params": params[2:]}]))
    else:
        opt = bound(model, make(model.parameters()))
    s = sched(opt) if sched else None
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip:
            (model.clip_grad_norm_ if isinstance(model, cgdp.DataParallel) else
             partial(torch.nn.utils.clip_grad_norm_, model.parameters()))(clip)
        opt.step()
        if s:
            s.step()
    return opt


def assert_identical(dp):
    first = dp.replicas[0].state_dict()
    for r in dp.replicas[1:]:
        for k, v in r.state_dict().items():
            assert torch.equal(v, first[k]), f"replicas differ in {k}"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_users_optimizer_steps_on_the_host_and_equals_one_device(name):
    make = OPTIMIZERS[name]
    model, data = mlp(), batches()
    ref = copy.deepcopy(model)
    ref_opt = run(ref, make, data, groups=True)
    with cgdp.DataParallel(copy.deepcopy(model), DEVS, update="host", chunks=2) as dp:
        opt = run(dp, make, data, groups=True)
        assert_identical(dp)
        assert_params_close(dp.module, ref)
        # the user's object: its groups hold the model's parameters, its state their keys, on the host
        assert [p for g in opt.param_groups for p in g["params"]] == list(dp.module.parameters())
        assert set(opt.state) == set(dp.module.parameters())
        assert all(g.get("fused") is None for g in opt.param_groups)  # fused on the host for the step only
        report = dp.memory_report()
        assert all(report[d]["optimizer_state"] == 0 for d in DEVS)
        assert report["host"]["optimizer_state"] == sum(
            t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        assert report["host"]["parameters"] == 4 * sum(p.numel() for p in model.parameters())
        assert report["host"]["gradients"] == 0  # the host's sum row read in place: no copy of replica 0's
        sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    for k, s in ref_sd["state"].items():
        for key, v in s.items():
            torch.testing.assert_close(sd["state"][k][key], v, rtol=1e-5, atol=1e-7)


def test_clipping_a_scheduler_and_load_state_dict_keep_working():
    make = OPTIMIZERS["adamw"]
    sched = partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    model, data = mlp(), batches(4, n=9)
    ref = copy.deepcopy(model)
    ref_opt = run(ref, make, data[:2], clip=0.05, sched=sched)
    saved = copy.deepcopy(ref_opt.state_dict())
    ref_opt.load_state_dict(copy.deepcopy(saved))
    for x, y in data[2:]:
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    with cgdp.DataParallel(copy.deepcopy(model), DEVS, update="host", chunks=1) as dp:
        opt = run(dp, make, data[:2], clip=0.05, sched=sched)
        assert dp.memory_report()["host"]["gradients"] > 0  # clipped: replica 0's gradients, copied
        opt.load_state_dict(copy.deepcopy(saved))
        assert all(t.device.type == "cpu" for s in opt.state.values() for t in s.values())
        run_opt = opt
        for x, y in data[2:]:
            run_opt.zero_grad()
            F.cross_entropy(dp(x), y).backward()
            run_opt.step()
            assert_identical(dp)
        assert_params_close(dp.module, ref)
    # closed: the optimizer steps replica 0 alone again, with its state
    opt.zero_grad()
    F.cross_entropy(dp.module(data[0][0]), data[0][1]).backward()
    opt.step()


def test_edited_parameters_are_followed_by_the_masters():
    make = OPTIMIZERS["sgd_momentum"]
    model, data = mlp(), batches(2)
    ref = copy.deepcopy(model)
    with cgdp.DataParallel(copy.deepcopy(model), DEVS, update="host") as dp:
        for m in (ref, dp):
            opt = bound(m, make(m.parameters()))
            for i, (x, y) in enumerate(data):
                if i == 1:
                    with torch.no_grad():
                        (m.module if m is dp else m)[0].weight.mul_(0.5)  # a user's edit between steps
                opt.zero_grad()
                with pytest.warns(UserWarning, match="changed outside") if m is dp and i == 1 else nullcontext():
                    F.cross_entropy(m(x), y).backward()
                opt.step()
        assert_identical(dp)
        assert_params_close(dp.module, ref)


def test_two_ranks_are_identical_and_equal_one_device():
    make = OPTIMIZERS["adamw"]
    model, data = mlp(), batches(3, n=12)
    ref = copy.deepcopy(model)
    run(ref, make, data)

    def rank(comm):
        with cgdp.DataParallel(copy.deepcopy(model), DEVS, comm=comm, update="host", timeout_s=30) as dp:
            mine = [(torch.tensor_split(x, 2)[comm.rank], torch.tensor_split(y, 2)[comm.rank]) for x, y in data]
            run(dp, make, mine)
            assert_identical(dp)
            return copy.deepcopy(dp.module.state_dict())

    assert_ranks_equal_reference(on_ranks(2, rank, timeout_s=30), ref, mlp())


def test_refusals():
    with cgdp.DataParallel(mlp(), DEVS, update="host") as dp:
        opt = dp.bind(OPTIMIZERS["sgd_momentum"](dp.parameters()))
        x, y = batches(1)[0]
        with dp.no_sync():
            F.cross_entropy(dp(x), y).backward()
        with pytest.raises(RuntimeError, match="no_sync"):
            opt.step()
        F.cross_entropy(dp(x), y).backward()
        with pytest.raises(NotImplementedError, match="closure"):
            opt.step(lambda: 0.0)
        opt.step()
        assert_identical(dp)
    with pytest.raises(ValueError, match="update must be"):
        cgdp.DataParallel(mlp(), DEVS, update="everywhere")


def test_cuda_backend_on_the_strict_simulator():
    from cgdp.testing import simulated_cuda
    make = OPTIMIZERS["adamw"]
    model, data = mlp(), batches()
    ref = copy.deepcopy(model)
    run(ref, make, data, clip=0.5)
    with simulated_cuda(2, seed=1) as sim:
        with cgdp.DataParallel(copy.deepcopy(model), ["cuda:0", "cuda:1"], update="host", chunks=1,
                               segment_bytes=1024) as dp:
            run(dp, make, data, clip=0.5)
            assert_identical(dp)
            assert_params_close(dp.module, ref)
    assert not sim.errors


def test_a_step_that_raises_leaves_the_optimizer_its_parameters():
    """The host step raises (a step pre-hook of the user's, before anything changed): the user's
    optimizer still holds the model's parameters, and the next step trains every replica."""
    model, data = mlp(), batches(2)
    with cgdp.DataParallel(copy.deepcopy(model), DEVS, update="host") as dp:
        opt = dp.bind(torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9))
        failed = []

        def fails_once(*_):
            if not failed:
                failed.append(1)
                raise RuntimeError("boom")
        opt.register_step_pre_hook(fails_once)
        x, y = data[0]
        F.cross_entropy(dp(x), y).backward()
        with pytest.raises(RuntimeError, match="boom"):
            opt.step()
        assert [p for g in opt.param_groups for p in g["params"]] == list(dp.module.parameters())
        before = copy.deepcopy(dp.module.state_dict())
        opt.zero_grad()
        F.cross_entropy(dp(*data[1][:1]), data[1][1]).backward()
        opt.step()
        assert_identical(dp)
        assert not torch.equal(dp.module[0].weight, before["0.weight"])


def test_the_usual_optimizer_over_a_model_with_a_frozen_layer():
    """A parameter frozen when the model was wrapped has no master and no gradient: skipped, as
    torch skips it."""
    model, data = mlp(), batches()
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model)
    run(ref, OPTIMIZERS["adamw"], data)
    with cgdp.DataParallel(copy.deepcopy(model), DEVS, update="host") as dp:
        opt = run(dp, OPTIMIZERS["adamw"], data)
        assert_params_close(dp.module, ref)
        assert_identical(dp)
        assert [p for g in opt.param_groups for p in g["params"]] == list(dp.module.parameters())


class _SparseNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.emb(x).mean(1))


def test_a_sparse_embedding_with_an_optimizer_of_its_own_steps_on_the_devices():
    """SparseAdam for the embedding (no master: it steps the replicas on the devices), Adam on the
    host for the rest: equal to one device; the embedding in the host's optimizer is refused."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 20, (8, 3), generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]

    def loop(m, body):
        sparse = bound(m, torch.optim.SparseAdam(body.emb.parameters(), lr=1e-2))
        dense = bound(m, torch.optim.Adam(body.out.parameters(), lr=1e-2))
        for x, y in data:
            sparse.zero_grad()
            dense.zero_grad()
            F.cross_entropy(m(x), y).backward()
            sparse.step()
            dense.step()
        return sparse, dense
    ref = _SparseNet()
    loop(ref, ref)
    with cgdp.DataParallel(_SparseNet(), DEVS, update="host") as dp:
        opts = loop(dp, dp.module)  # noqa: F841 (alive: what the memory report counts)
        assert_params_close(dp.module, ref)
        assert_identical(dp)
        report = dp.memory_report()
        assert report["host"]["optimizer_state"] > 0 and report["cpu:0"]["optimizer_state"] > 0
        opt = dp.bind(torch.optim.Adam(dp.parameters(), lr=1e-2))
        F.cross_entropy(dp(data[0][0]), data[0][1]).backward()
        with pytest.raises(NotImplementedError, match="SparseAdam"):
            opt.step()


def test_edited_gradients_are_copied_into_page_locked_host_memory():
    """After clipping (replica 0's gradients edited since backward) the host copies them once into
    a buffer of its own: page-locked on CUDA, as every other host copy target of cgdp."""
    from cgdp.testing import simulated_cuda
    with simulated_cuda(2, seed=1) as sim:
        with cgdp.DataParallel(mlp(), ["cuda:0", "cuda:1"], update="host", chunks=1) as dp:
            opt = dp.bind(OPTIMIZERS["sgd_momentum"](dp.parameters()))
            x, y = batches(1)[0]
            F.cross_entropy(dp(x), y).backward()
            dp.clip_grad_norm_(0.5)
            before = sum(sim.registered.values())
            opt.step()
            assert sum(sim.registered.values()) - before >= sum(p.numel() * 4 for p in dp.parameters())
            assert_identical(dp)
    assert not sim.errors


@pytest.mark.parametrize("first", [False, True], ids=["second_step", "first_step"])
@pytest.mark.parametrize("how", ["pre_hook", "post_hook"])
def test_a_step_raising_once_leaves_what_one_device_holds(how, first):
    """The user's step hook raises once, before the update or after it (the host optimizer runs
    the user's step hooks), at the first step or a later one; the user's loop catches it and goes
    on (its zero_grad() next): every replica holds what one device running the same loop holds,
    as with update='devices' (skipped for a pre-hook, stepped for a post-hook). (An optimizer
    subclass that overrides step() is refused at bind with update='host'.)"""
    def loop(model):
        opt = bound(model, OPTIMIZERS["adamw"](model.parameters()))
        calls, opt.fail_at = [], 1 if first else 2

        def hook(*_):
            calls.append(1)
            if len(calls) == opt.fail_at:
                raise ValueError("the step fails once")
        getattr(opt, f"register_step_{how}")(hook)
        raised = 0
        for x, y in batches(4):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            try:
                opt.step()
            except ValueError:
                raised += 1
        assert raised == 1
        return opt

    model = mlp()
    ref = copy.deepcopy(model)
    ref_opt = loop(ref)
    with cgdp.DataParallel(copy.deepcopy(model), DEVS, update="host") as dp:
        opt = loop(dp)
        assert [p for g in opt.param_groups for p in g["params"]] == list(dp.module.parameters())
        assert {int(s["step"]) for s in opt.state.values()} == {int(s["step"]) for s in ref_opt.state.values()}
        assert_params_close(dp.module, ref)
        assert_identical(dp)


def test_one_device_host_update_takes_a_gradient_edited_through_data():
    """One device, update='host': a clamp through ``.data`` (PyTorch's DQN tutorial) is in the step, as on one device.
    With one replica there is no other to compare bits with, so the host's own sum row is not taken as replica 0's
    gradient (it stepped the unclamped sum)."""
    base = torch.nn.Linear(4, 2)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)

    def run(model, inner):
        opt = torch.optim.SGD(inner.parameters(), lr=0.1)
        if model is not inner:
            model.bind(opt)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p in inner.parameters():
            p.grad.data.clamp_(-1e-3, 1e-3)
        opt.step()
        return [p.detach().clone() for p in inner.parameters()]
    ref_net = copy.deepcopy(base)
    ref = run(ref_net, ref_net)
    with cgdp.DataParallel(copy.deepcopy(base), ["cpu:0"], update="host") as dp:
        got = run(dp, dp.module)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b)
