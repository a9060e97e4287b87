"""The user's hooks on a model that cgdp trains, in both faces, against the same loop on one device.

Gradient hooks on parameters (``p.register_hook``) run once per backward on the summed gradient,
so that any hook, linear (a mask) or not (a clamp), gives what one device gives; module hooks
(forward, forward-pre, full backward, ``torch.nn.utils.prune``'s) act on every replica, whether
they were registered before or after wrapping (core/param_hooks.py, core/module_hooks.py)."""
import copy

import pytest
import torch
import torch.nn.utils.prune as prune
from torch import nn

import cgdp
from helpers import assert_params_close, assert_replicas_identical

FACES = ("DataParallel", "Trainer")


def net_and_reference():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return net, copy.deepcopy(net)


def batches(n=3, rows=7):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 8, generator=g) * 3 for _ in range(n)]


def loss_of(out):
    return out.pow(2).mean()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train(face, net, add=None, when="after", backwards=1, g=3, **kw):
    """``net`` trained in place on g emulated devices (``add(net)`` registers hooks before or after
    wrapping; ``backwards`` per step accumulate, DataParallel only); the engine, still open."""
    if add is not None and when == "before":
        add(net)
    if face == "DataParallel":
        engine = cgdp.DataParallel(net, [f"cpu:{i}" for i in range(g)], chunks=1)
        opt = engine.bind(sgd(engine.parameters()))
    else:
        engine = cgdp.Trainer(net, sgd, [f"cpu:{i}" for i in range(g)], chunks=1, **kw)
    if add is not None and when == "after":
        add(net)
    for x in batches():
        if face == "DataParallel":
            opt.zero_grad()
            for _ in range(backwards):
                loss_of(engine(x)).backward()
            opt.step()
        else:
            engine.step(x, lambda m, b: loss_of(m(b)))
    assert_replicas_identical(engine)
    return engine


def one_device(ref, add=None, backwards=1, clip=None):
    if add is not None:
        add(ref)
    opt = sgd(ref.parameters())
    for x in batches():
        opt.zero_grad()
        for _ in range(backwards):
            loss_of(ref(x)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()


def gradient_hook(kind, calls):
    mask = torch.ones(16, 8)
    mask[:8] = 0

    def hook(g):
        calls.append(g.abs().sum().item())
        return g * mask if kind == "mask" else g.clamp(-0.02, 0.02)
    return hook


# ---------------------------------------------------------------- gradient hooks on parameters
@pytest.mark.parametrize("kind", ["mask", "clamp"])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("face", FACES)
def test_gradient_hook_runs_once_on_the_summed_gradient(face, when, kind):
    """A mask is linear, a clamp is not: both as on one device, the hook called once per backward
    with the whole gradient (two backwards per step accumulate on DataParallel)."""
    net, ref = net_and_reference()
    calls, ref_calls = [], []
    backwards = 2 if face == "DataParallel" else 1
    with train(face, net, lambda m: m[0].weight.register_hook(gradient_hook(kind, calls)), when, backwards):
        one_device(ref, lambda m: m[0].weight.register_hook(gradient_hook(kind, ref_calls)), backwards)
        assert_params_close(net, ref)
        assert calls == pytest.approx(ref_calls, rel=1e-5)


@pytest.mark.parametrize("kw", [{"mode": "typical"}, {"clip_grad_norm": 0.05}, {"micro_batches": 2}],
                         ids=["typical", "clip", "micro_batches"])
def test_gradient_hook_with_trainer_options(kw):
    net, ref = net_and_reference()
    with train("Trainer", net, lambda m: m[0].weight.register_hook(gradient_hook("clamp", [])), **kw):
        one_device(ref, lambda m: m[0].weight.register_hook(gradient_hook("clamp", [])),
                   clip=kw.get("clip_grad_norm"))
        assert_params_close(net, ref)


def test_gradient_hook_removed_through_its_handle_after_wrapping():
    net, ref = net_and_reference()
    h = net[0].weight.register_hook(lambda g: g * 3)
    h_ref = ref[0].weight.register_hook(lambda g: g * 3)
    with cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=1) as model:
        opt, ropt = model.bind(sgd(model.parameters())), sgd(ref.parameters())
        for step, x in enumerate(batches(2)):
            for m, o in ((model, opt), (ref, ropt)):
                o.zero_grad()
                loss_of(m(x)).backward()
                o.step()
            if step == 0:
                h.remove()
                h_ref.remove()
        assert_params_close(net, ref)
        assert_replicas_identical(model)


def test_gradient_hooks_that_cannot_run_on_the_sum_are_refused():
    net, _ = net_and_reference()
    with cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=1) as model:
        h = model.replicas[1][0].weight.register_hook(lambda g: g)
        with pytest.raises(RuntimeError, match="replica 1; register it on the model's own parameter"):
            loss_of(model(torch.randn(4, 8))).backward()
        h.remove()
        h = net[0].weight.register_hook(lambda g: g * 2)
        with model.no_sync(), pytest.raises(RuntimeError, match="inside model.no_sync"):
            loss_of(model(torch.randn(4, 8))).backward()
        h.remove()
        net[2].bias.register_post_accumulate_grad_hook(lambda p: None)
        with pytest.raises(RuntimeError, match="register_post_accumulate_grad_hook .* use p.register_hook"):
            loss_of(model(torch.randn(4, 8))).backward()


@pytest.mark.parametrize("face", FACES)
def test_a_gradient_hook_that_raises_once_leaves_the_model_usable(face):
    """The hook's own error reaches the caller; the failed step does nothing (DataParallel drops
    that backward's gradients and refuses optimizer.step() until a backward completes); training
    then goes on as on one device where the user skipped that step."""
    net, ref = net_and_reference()
    calls = []

    def hook(g):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("the user's hook failed")
        return g.clamp(-0.02, 0.02)
    net[0].weight.register_hook(hook)
    ref[0].weight.register_hook(lambda g: g.clamp(-0.02, 0.02))
    xs = batches()
    with (cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=1) if face == "DataParallel"
          else cgdp.Trainer(net, sgd, ["cpu:0", "cpu:1"], chunks=1)) as engine:
        if face == "DataParallel":
            opt = engine.bind(sgd(engine.parameters()))

            def step(x):
                opt.zero_grad()
                loss_of(engine(x)).backward()
                opt.step()
        else:
            def step(x):
                engine.step(x, lambda m, b: loss_of(m(b)))
        with pytest.raises(ValueError, match="the user's hook failed"):
            step(xs[0])
        if face == "DataParallel":
            with pytest.raises(RuntimeError, match="failed partway"):
                opt.step()
        for x in xs[1:]:
            step(x)
        assert_replicas_identical(engine)
    ropt = sgd(ref.parameters())
    for x in xs[1:]:
        ropt.zero_grad()
        loss_of(ref(x)).backward()
        ropt.step()
    assert_params_close(net, ref)


@pytest.mark.parametrize("face", FACES)
def test_a_gradient_hook_returning_another_dtype_raises_as_torch_does(face):
    net, _ = net_and_reference()
    net[0].weight.register_hook(lambda g: g.double())
    x = batches(1)[0]
    with (cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=1) if face == "DataParallel"
          else cgdp.Trainer(net, sgd, ["cpu:0", "cpu:1"], chunks=1)) as engine:
        with pytest.raises(RuntimeError, match="has changed the type of value"):
            if face == "DataParallel":
                loss_of(engine(x)).backward()
            else:
                engine.step(x, lambda m, b: loss_of(m(b)))


# ---------------------------------------------------------------- module hooks
def add_module_hook(kind):
    def add(m):
        if kind == "forward":
            m[1].register_forward_hook(lambda mod, i, o: o * 0.5)
        elif kind == "forward_pre":
            m[2].register_forward_pre_hook(lambda mod, i: (i[0] + 1,))
        elif kind == "backward":
            m[2].register_full_backward_hook(lambda mod, gi, go: (gi[0] * 3,))
        else:
            prune.l1_unstructured(m[0], "weight", amount=0.5)
    return add


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "backward", "prune"])
@pytest.mark.parametrize("face", FACES)
def test_module_hook_registered_after_wrapping_acts_on_every_replica(face, kind):
    net, ref = net_and_reference()
    with train(face, net, add_module_hook(kind)) as engine:
        one_device(ref, add_module_hook(kind))
        assert_params_close(net, ref)
        if face == "DataParallel":  # every row of the output, also in evaluation
            x = batches(1, rows=6)[0]
            with torch.no_grad():
                torch.testing.assert_close(engine(x), ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("face", FACES)
def test_capturing_hooks_see_every_part_of_the_batch(face):
    net, _ = net_and_reference()
    rows, grads = [], []
    net[0].register_forward_hook(lambda mod, i, o: rows.append(o.shape[0]))  # before wrapping
    with train(face, net, lambda m: m[2].register_full_backward_hook(
            lambda mod, gi, go: grads.append(go[0].shape[0]))):
        assert sum(rows) == 3 * 7 and len(rows) == 3 * 3
        assert sum(grads) == 3 * 7


def test_a_hook_removed_after_wrapping_is_removed_from_every_replica():
    net, ref = net_and_reference()
    h = net[1].register_forward_hook(lambda mod, i, o: o * 0.5)
    with cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=1) as model:
        h.remove()
        x = torch.randn(6, 8)
        torch.testing.assert_close(model(x), ref(x))


def test_a_parameter_the_engine_does_not_know_is_refused():
    net, _ = net_and_reference()
    with cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=1) as model:
        net[2].weight = nn.Parameter(torch.zeros(2, 16))
        net[2].register_forward_hook(lambda mod, i, o: o)
        with pytest.raises(RuntimeError, match="'weight' of Linear is not one the model had when it was wrapped"):
            model(torch.randn(4, 8))
