"""``model.bind(opt)``: the optimizer bound once, its ``step()`` every replica's, until close().
And an optimizer never bound: it steps replica 0 alone, and the replicas copy replica 0's
parameters before they run again (exact), with a warning that says to bind it."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.testing import inside
from helpers import assert_params_close, assert_replicas_identical, bound, mlp

DEVS = ["cpu:0", "cpu:1"]


def batches(n_steps, n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(n_steps)]


def one_step(model, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("update", ["devices", "host"])
def test_bind_returns_the_optimizer_and_binding_again_changes_nothing(update):
    with cgdp.DataParallel(mlp(), DEVS, chunks=1, update=update) as model:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert model.bind(opt) is opt
        step = vars(opt)["step"]
        assert model.bind(opt) is opt and vars(opt)["step"] is step and len(inside(model).bindings) == 1
        assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_load_state_dict_post_hooks) == 1
        for x, y in batches(2):
            one_step(model, opt, x, y)
        assert_replicas_identical(model)


def test_an_optimizer_of_other_parameters_is_refused_at_bind():
    with cgdp.DataParallel(mlp(), DEVS) as a, cgdp.DataParallel(mlp(), DEVS) as b:
        for params in (list(b.parameters()), [*a.parameters(), *b.parameters()], list(a.replicas[1].parameters())):
            with pytest.raises(ValueError, match="an optimizer may hold the parameters of one DataParallel only"):
                a.bind(torch.optim.SGD(params, lr=0.1))
        with pytest.raises(ValueError, match="holds none of this cgdp.DataParallel's parameters"):
            a.bind(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))
        bound_to_b = b.bind(torch.optim.SGD(b.parameters(), lr=0.1))
        with pytest.raises(ValueError, match="build a separate optimizer"):
            a.bind(bound_to_b)
    with pytest.raises(RuntimeError, match="closed"):
        a.bind(torch.optim.SGD(a.parameters(), lr=0.1))


def test_a_step_past_the_binding_is_refused():
    """``type(opt).step(opt)`` (or a step method saved before bind) would step replica 0 alone."""
    with cgdp.DataParallel(mlp(), DEVS, chunks=1) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        saved = opt.step
        model.bind(opt)
        x, y = batches(1)[0]
        F.cross_entropy(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        for call in (lambda: type(opt).step(opt), saved):
            with pytest.raises(RuntimeError, match=r"past the step cgdp.DataParallel.bind gave it .* call optimizer.step\(\)"):
                call()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt.step()
        assert_replicas_identical(model)


def test_grad_scaler_and_a_scheduler_built_after_bind_work():
    """The bound step keeps what torch's helpers read: its signature (GradScaler), a ``__func__``
    (a scheduler built later wraps it and counts its calls, no warning about the order)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5))
    ref = copy.deepcopy(net)
    with cgdp.DataParallel(net, DEVS, chunks=1) as model:
        opts = [model.bind(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)),
                torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)]
        scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in opts]
        scalers = [torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
            for x, y in batches(3):
                for m, o, s, sc in zip((model, ref), opts, scheds, scalers):
                    o.zero_grad()
                    sc.scale(F.cross_entropy(m(x), y)).backward()
                    sc.step(o)
                    sc.update()
                    s.step()
                assert_replicas_identical(model)
        assert opts[0].param_groups[0]["lr"] == opts[1].param_groups[0]["lr"] == 1e-2 / 8
    assert_params_close(net, ref)


@pytest.mark.parametrize("update", ["devices", "host"])
def test_close_gives_the_optimizer_back_as_it_was(update):
    """After close() the optimizer is torch's own again (no instance ``step``, no hook of cgdp's,
    its state on the parameters' device) and steps replica 0 alone."""
    net = mlp()
    with cgdp.DataParallel(net, DEVS, chunks=1, update=update) as model:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        hooks = (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_load_state_dict_post_hooks))
        model.bind(opt)
        one_step(model, opt, *batches(1)[0])
    assert "step" not in vars(opt) and not any(k.startswith("_cgdp") for k in vars(opt))
    assert (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_load_state_dict_post_hooks)) == hooks
    assert all(t.device == p.device for p, s in opt.state.items() for t in s.values())
    before = [p.detach().clone() for p in net.parameters()]
    one_step(net, opt, *batches(1)[0])
    assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))


def test_an_unbound_optimizer_trains_exactly_through_replica_0_and_says_to_bind_it():
    """Never bound, the optimizer steps replica 0 alone; the other replicas copy its parameters
    before they run again: one device's result, and a warning naming model.bind."""
    net = mlp()
    ref = copy.deepcopy(net)
    with cgdp.DataParallel(net, DEVS, chunks=1) as model:
        opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
        data = batches(3)
        one_step(model, opt, *data[0])
        one_step(ref, ref_opt, *data[0])
        for x, y in data[1:]:
            with pytest.warns(UserWarning, match=r"never bound to it, which steps replica 0 alone: bind it once, "
                                                 r"opt = model.bind\(opt\)"):
                one_step(model, opt, x, y)
            one_step(ref, ref_opt, x, y)
        model(data[0][0])  # the replicas take the last step
        assert_replicas_identical(model)
    assert_params_close(net, ref)


def test_host_update_refuses_an_optimizer_that_overrides_step():
    class Mine(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    with cgdp.DataParallel(mlp(), DEVS, update="host") as model:
        with pytest.raises(TypeError, match="Mine overrides step.*update='devices'"):
            model.bind(Mine(model.parameters(), lr=0.1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert "step" not in vars(opt)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_an_optimizer_over_the_model_and_parameters_outside_it_trains_as_one_device(opt_cls):
    """A head applied to the gathered output and a frozen layer beside the model, in the model's optimizer (as with
    nn.DataParallel): the model's parameters step on every replica, the others where they are; one device's result;
    state_dict and load_state_dict keep working."""
    torch.manual_seed(0)
    net, head, frozen = mlp(), nn.Linear(5, 3), nn.Linear(3, 3)
    frozen.requires_grad_(False)
    data = [(torch.randn(8, 12), torch.randint(0, 3, (8,))) for _ in range(3)]

    def train(model, head, frozen):
        opt = bound(model, opt_cls([{"params": model.parameters()}, {"params": head.parameters(), "lr": 0.05},
                                    {"params": frozen.parameters()}], lr=0.1))
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(frozen(head(model(x))), y).backward()
            opt.step()
        return opt

    ref = [copy.deepcopy(m) for m in (net, head, frozen)]
    ref_opt = train(*ref)
    with cgdp.DataParallel(copy.deepcopy(net), DEVS) as model:
        ours = [copy.deepcopy(m) for m in (head, frozen)]
        opt = train(model, *ours)
        assert_replicas_identical(model)
        for a, b in zip([*model.module.parameters(), *ours[0].parameters(), *ours[1].parameters()],
                        [p for m in ref for p in m.parameters()]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        opt.load_state_dict(ref_opt.state_dict())  # the mirrors take the model's part of it
        x, y = data[0]
        opt.zero_grad()
        F.cross_entropy(ours[1](ours[0](model(x))), y).backward()
        opt.step()
        assert_replicas_identical(model)


def test_outside_parameters_added_later_another_engines_replicas_and_trainable_ones_where_only_the_model_steps():
    """A frozen head added with add_param_group after bind trains on; another engine's replica 1 is refused (it would
    step that replica alone); with update='host' a trainable outside parameter is refused at bind (only the model's
    masters are stepped there), a frozen one is fine."""
    torch.manual_seed(0)
    with cgdp.DataParallel(mlp(), DEVS) as a, cgdp.DataParallel(mlp(), DEVS) as b:
        head = nn.Linear(5, 3)
        opt = a.bind(torch.optim.SGD(a.parameters(), lr=0.1))
        opt.add_param_group({"params": head.parameters(), "lr": 0.05})
        x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(head(a(x)), y).backward()
            opt.step()
        assert_replicas_identical(a)
        with pytest.raises(ValueError, match="another replica than replica 0"):
            a.bind(torch.optim.SGD([*a.parameters(), *b.replicas[1].parameters()], lr=0.1))
    with cgdp.DataParallel(mlp(), DEVS, update="host") as model:
        head = nn.Linear(5, 3)
        with pytest.raises(ValueError, match="update='host' steps the model's parameters on the host"):
            model.bind(torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1))
        head.requires_grad_(False)
        model.bind(torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1))
