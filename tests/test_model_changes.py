"""The model a user changes between steps, and a forward that changes parameters in place: every
replica follows replica 0 as one device would (both faces, one mechanism: core/follow.py), or the
change is refused with a sentence. Each case against a plain one-device autograd reference."""
import copy
import warnings

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import cgdp
from helpers import assert_params_close, assert_replicas_identical, mlp

DEVS = ["cpu:0", "cpu:1"]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batches(n, seed=1, width=12, out=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, width, generator=g), torch.randn(8, out, generator=g)) for _ in range(n)]


def bn_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 5))


def bn_only_model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))


def freeze_bn(m):
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm1d):
            mod.eval()


def clamp(m):
    with torch.no_grad():
        for p in m.parameters():
            p.clamp_(-0.1, 0.1)


def load_other(m):
    m.load_state_dict(mlp(seed=5).state_dict())


def freeze_first(m):
    m[0].requires_grad_(False)


def trainer_vs_one_device(model, change, at, n=3):
    """``model`` trained by a Trainer and a copy by one device, ``change`` made to both before step ``at``."""
    ref = copy.deepcopy(model)
    ropt = sgd(ref.parameters())
    with cgdp.Trainer(model, sgd, DEVS, chunks=2) as tr:
        for i, (x, y) in enumerate(batches(n)):
            if i == at:
                change(model)
                change(ref)
            tr.step(x, y, F.mse_loss)
            ropt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ropt.step()
            assert_replicas_identical(tr)
    assert_params_close(model, ref)


@pytest.mark.parametrize("make, change, at", [
    (bn_model, lambda m: m.eval(), 0),         # eval(): BatchNorm's running statistics, no dropout
    (bn_only_model, freeze_bn, 0),             # BatchNorm frozen through model.modules()
    (mlp, clamp, 1),                           # an in-place edit under no_grad
    (mlp, load_other, 1),                      # model.load_state_dict
    (mlp, freeze_first, 1),                    # requires_grad_(False) on a layer
], ids=["eval", "frozen-batchnorm", "clamp", "load_state_dict", "requires_grad"])
def test_trainer_follows_what_the_user_changes_between_steps(make, change, at):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer_vs_one_device(make(), change, at)
    edited = [w for w in seen if "changed outside optimizer.step()" in str(w.message)]
    assert bool(edited) == (change is clamp)  # an in-place edit is said; the rest is silent


def test_trainer_refuses_a_replaced_layer_and_goes_on_when_it_is_put_back():
    model = mlp()
    ref = copy.deepcopy(model)
    ropt = sgd(ref.parameters())
    (x, y), (x2, y2) = batches(2)
    with cgdp.Trainer(model, sgd, DEVS, chunks=2) as tr:
        old = model[2]
        model[2] = nn.Linear(24, 24)
        with pytest.raises(RuntimeError, match=r"submodule\(s\) 2 of the model were replaced.*create a new Trainer"):
            tr.step(x, y, F.mse_loss)
        with pytest.raises(RuntimeError, match="replaced"):  # until it is undone
            tr.step(x, y, F.mse_loss)
        model[2] = old
        nn.Linear(3, 3)  # a module built elsewhere (torch counts its registrations): nothing to follow
        for xb, yb in ((x, y), (x2, y2)):
            tr.step(xb, yb, F.mse_loss)
            ropt.zero_grad()
            F.mse_loss(ref(xb), yb).backward()
            ropt.step()
        assert_replicas_identical(tr)
        model[0].weight = nn.Parameter(model[0].weight.detach().clone())  # a new parameter object
        with pytest.raises(RuntimeError, match="not one the model had when it was wrapped"):
            tr.step(x, y, F.mse_loss)
    assert_params_close(model, ref)


def test_trainer_refuses_to_unfreeze_what_was_frozen_when_built():
    model = mlp()
    model[0].requires_grad_(False)
    (x, y), = batches(1)
    with cgdp.Trainer(model, sgd, DEVS, chunks=1) as tr:
        tr.step(x, y, F.mse_loss)
        model[0].requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"frozen when cgdp.Trainer was built now require grad \(0.weight, 0.bias\)"):
            tr.step(x, y, F.mse_loss)


def test_dataparallel_refuses_a_replaced_layer_with_a_sentence():
    model = mlp()
    (x, y), = batches(1)
    with cgdp.DataParallel(model, DEVS, chunks=2) as dp:
        dp.module[2] = nn.Linear(24, 24)
        with pytest.raises(RuntimeError, match=r"submodule\(s\) 2 of the model were replaced.*wrap model.module again"):
            dp(x)
        with pytest.raises(ValueError, match="replaced after wrapping"):  # a fresh optimizer: no bare KeyError
            dp.bind(torch.optim.SGD(dp.parameters(), lr=0.1))


class Renorm(nn.Module):
    """An embedding with max_norm (the forward renormalises the rows it looks up, in place)."""
    def __init__(self, tied=False):
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(20, 4, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(3)
        self.out = nn.Linear(4, 20, bias=False)
        if tied:
            self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def token_batches(n):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 20, (8, 3), generator=g), torch.randint(0, 20, (8,), generator=g)) for _ in range(n)]


def one_device(model, data, change=None, at=None, loss=F.cross_entropy):
    """A copy of ``model`` trained on one device on ``data``, ``change`` made to it before step ``at``."""
    ref = copy.deepcopy(model)
    opt = sgd(ref.parameters())
    for i, (x, y) in enumerate(data):
        if i == at:
            change(ref)
        opt.zero_grad()
        loss(ref(x), y).backward()
        opt.step()
    return ref


def test_embedding_max_norm_trainer_matches_one_device():
    model, data = Renorm(), token_batches(3)
    ref = one_device(model, data)
    with cgdp.Trainer(model, sgd, DEVS, chunks=1) as tr:
        for x, y in data:
            tr.step(x, y, F.cross_entropy)
            assert_replicas_identical(tr)
    assert_params_close(model, ref)


def test_embedding_max_norm_dataparallel_matches_one_device():
    model, data = Renorm(), token_batches(3)
    ref = one_device(model, data)
    with cgdp.DataParallel(model, DEVS, chunks=1) as dp:
        opt = dp.bind(sgd(dp.parameters()))
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(dp(x), y).backward()
            opt.step()
        with torch.no_grad():
            dp(data[0][0])  # an inference forward renormalises too, on every replica
        ref(data[0][0])
        for r in dp.replicas[1:]:
            assert torch.equal(r.emb.weight, dp.module.emb.weight)
    assert_params_close(model, ref)


def test_a_tied_max_norm_embedding_is_refused():
    with pytest.raises(ValueError, match="max_norm.*tied"):
        cgdp.Trainer(Renorm(tied=True), sgd, DEVS)
    with pytest.raises(ValueError, match="max_norm.*tied"):
        cgdp.DataParallel(Renorm(tied=True), DEVS)


class Drifts(nn.Module):
    """A forward that changes a parameter in place from its batch (refused) and one by a constant (exact)."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 5)
        self.scale = nn.Parameter(torch.ones(5))
        self.decay = nn.Parameter(torch.ones(5))

    def forward(self, x):
        with torch.no_grad():
            self.decay.mul_(0.5)  # the same on every device
            if self.by_batch:
                self.scale.add_(x.mean())
        return self.lin(x) * self.scale * self.decay


@pytest.mark.parametrize("face", ["trainer", "dataparallel"])
def test_a_forward_that_changes_parameters_by_its_batch_is_refused(face):
    model = Drifts()
    model.by_batch = False
    (x, y), = batches(1)
    if face == "trainer":
        engine = cgdp.Trainer(model, sgd, DEVS, chunks=1)
        run = lambda: engine.step(x, y, F.mse_loss)  # noqa: E731
    else:
        engine = cgdp.DataParallel(model, DEVS, chunks=1)
        run = lambda: engine(x)  # noqa: E731
    with engine:
        run()  # the same change on every replica: nothing to refuse
        model.by_batch = True
        with pytest.raises(RuntimeError, match=r"forward changed parameter\(s\) scale in place"):
            run()
        reps = engine.replicas
        assert all(torch.equal(r.scale, reps[0].scale) and torch.equal(r.decay, reps[0].decay) for r in reps[1:])


def test_deepcopy_and_averaged_model_of_a_dataparallel_copy_the_wrapped_model():
    """``copy.deepcopy(model)`` is a copy of model.module (no second engine); EMA through
    ``AveragedModel(model)`` then follows replica 0 as it does one device's model."""
    from torch.optim import swa_utils
    model, data = mlp(), batches(3)
    ref = copy.deepcopy(model)
    ropt = sgd(ref.parameters())
    ref_ema = swa_utils.AveragedModel(ref, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
    with cgdp.DataParallel(model, DEVS, chunks=2) as dp:
        twin = copy.deepcopy(dp)
        assert type(twin) is nn.Sequential and all(torch.equal(a, b) for a, b in zip(twin.parameters(), model.parameters()))
        ema = swa_utils.AveragedModel(dp, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
        opt = dp.bind(sgd(dp.parameters()))
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(dp(x), y).backward()
            opt.step()
            ema.update_parameters(dp)
            ropt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ropt.step()
            ref_ema.update_parameters(ref)
        assert torch.allclose(ema(data[0][0]), ref_ema(data[0][0]), rtol=1e-5, atol=1e-6)
    assert_params_close(ema.module, ref_ema.module)


def test_a_memory_format_change_on_the_wrapper_is_refused_and_one_before_wrapping_trains():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x, y = torch.randn(8, 3, 8, 8), torch.randn(8, 5)
    with cgdp.DataParallel(copy.deepcopy(net), DEVS, chunks=1) as dp:
        with pytest.raises(RuntimeError, match="cannot change its replicas' memory format.*before wrapping"):
            dp.to(memory_format=torch.channels_last)
    net = net.to(memory_format=torch.channels_last)
    ref = copy.deepcopy(net)
    ropt = sgd(ref.parameters())
    with cgdp.DataParallel(net, DEVS, chunks=1) as dp:
        assert all(r[0].weight.is_contiguous(memory_format=torch.channels_last) for r in dp.replicas)
        opt = dp.bind(sgd(dp.parameters()))
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(dp(x), y).backward()
            opt.step()
            ropt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ropt.step()
    assert_params_close(net, ref)


@pytest.mark.parametrize("edit", ["data", "replace"])
def test_gradients_edited_inside_no_sync_are_refused_and_the_model_goes_on(edit):
    """Between a backward inside no_sync() and the next one every replica holds its own part:
    an edit of replica 0's part is not the edit of the sum one device would make. Refused with a
    sentence (the gradients of that window dropped); training then goes on as on one device."""
    model, data = mlp(), batches(3)
    ref = copy.deepcopy(model)
    (x1, y1), (x2, y2), (x3, y3) = data
    with cgdp.DataParallel(model, DEVS, chunks=2) as dp:
        opt = dp.bind(sgd(dp.parameters()))
        opt.zero_grad()
        with dp.no_sync():
            F.mse_loss(dp(x1), y1).backward()
        for p in dp.parameters():
            if edit == "data":
                p.grad.data.mul_(0.5)
            else:
                p.grad = p.grad * 0.5
        with pytest.raises(RuntimeError, match="changed between backwards inside model.no_sync"):
            F.mse_loss(dp(x2), y2).backward()
        opt.zero_grad()  # the window again, without the edit
        with dp.no_sync():
            F.mse_loss(dp(x1), y1).backward()
        F.mse_loss(dp(x2), y2).backward()
        opt.step()
        opt.zero_grad()
        F.mse_loss(dp(x3), y3).backward()
        for p in dp.parameters():  # after the synced backward, the same edit is the sum's
            p.grad.data.mul_(0.5)
        with pytest.warns(UserWarning, match="through .data"):  # found, and copied to every replica
            opt.step()
        assert all(torch.equal(a, b) for r in dp.replicas[1:] for a, b in zip(r.parameters(), model.parameters()))
    ropt = sgd(ref.parameters())
    ropt.zero_grad()
    F.mse_loss(ref(x1), y1).backward()
    F.mse_loss(ref(x2), y2).backward()
    ropt.step()
    ropt.zero_grad()
    F.mse_loss(ref(x3), y3).backward()
    for p in ref.parameters():
        p.grad.data.mul_(0.5)
    ropt.step()
    assert_params_close(model, ref)


class Body(nn.Module):
    """A body with BatchNorm (kept in eval mode: its running statistics are used, not written) and a head."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.head = nn.Linear(16, 5)
        self.body[1].eval()

    def forward(self, x):
        return self.head(self.body(x))

    def train(self, mode=True):
        super().train(mode)
        self.body[1].eval()
        return self


def pretrained_body():
    body = Body().body
    with torch.no_grad():
        body[0].weight.mul_(0.5)
        body[1].running_mean.fill_(0.7)
        body[1].running_var.fill_(3.0)
    return copy.deepcopy(body.state_dict())


def run_face(face, model, data, change=None, at=None, loss=F.mse_loss, devices=DEVS):
    """``model`` trained by ``face`` on ``data``, ``change`` made to it before step ``at``."""
    if face == "trainer":
        engine = cgdp.Trainer(model, sgd, devices, chunks=1)
        step = lambda x, y: engine.step(x, y, loss)  # noqa: E731
    else:
        engine = cgdp.DataParallel(model, devices, chunks=1)
        opt = engine.bind(sgd(engine.parameters()))

        def step(x, y):
            opt.zero_grad()
            loss(engine(x), y).backward()
            opt.step()
    with engine:
        for i, (x, y) in enumerate(data):
            if i == at:
                change(model)
            step(x, y)
            assert_replicas_identical(engine)


@pytest.mark.parametrize("face", ["trainer", "dataparallel"])
def test_load_state_dict_on_a_submodule_reaches_every_replica_buffers_too(face):
    """``model.body.load_state_dict(pretrained)``: its parameters and its BatchNorm's running
    statistics on every replica (the load is followed on every submodule, not only the root)."""
    state, data = pretrained_body(), batches(3)
    change = lambda m: m.body.load_state_dict(state)  # noqa: E731
    ref = one_device(Body(), data, change, at=1, loss=F.mse_loss)
    model = Body()
    run_face(face, model, data, change, at=1)
    assert_params_close(model, ref)
    assert torch.equal(model.body[1].running_mean, ref.body[1].running_mean)


@pytest.mark.parametrize("face", ["trainer", "dataparallel"])
def test_load_state_dict_with_assign_is_refused_with_a_sentence(face):
    """``load_state_dict(..., assign=True)`` replaces the parameter objects every device trains:
    refused at the load, and at every step after it."""
    model, data = mlp(), batches(2)
    other = mlp(seed=5).state_dict  # fresh each time: a load with assign=True marks its state's _metadata
    load = lambda m: m.load_state_dict(other(), assign=True)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"new objects since cgdp\.\w+ was built .*Load without assign=True"):
        run_face(face, model, data, load, at=1)
    engine = cgdp.Trainer(model, sgd, DEVS, chunks=1) if face == "trainer" else cgdp.DataParallel(model, DEVS)
    with engine:
        model.load_state_dict(other())  # a copy into the parameters: followed
        assert_replicas_identical(engine)
        with pytest.raises(RuntimeError, match="assign=True"):
            model.load_state_dict(other(), assign=True)
        with pytest.raises(RuntimeError, match="not one the model had when it was wrapped"):
            run = engine.step if face == "trainer" else lambda x, y, loss: engine(x)
            run(*data[0], F.mse_loss)


class Penalised(Renorm):
    """A max_norm embedding whose table the forward also reads (an L2 penalty: saved for backward)."""
    def forward(self, ids):
        return super().forward(ids) + 1e-3 * self.emb.weight.pow(2).sum()


@pytest.mark.parametrize("face", ["trainer", "dataparallel"])
def test_max_norm_rows_are_written_only_where_replicas_differ(face):
    """Both halves of the batch look up the same rows: after the forward every replica already
    holds what one device holds, nothing is written, and a forward that also reads the table
    (saved for backward) trains as one device. Rows one half alone looked up are refused with a
    sentence (writing them would break that backward), replicas still identical."""
    ids = torch.tensor([[1, 2, 3], [4, 5, 1], [2, 3, 4], [5, 1, 2]])
    g = torch.Generator().manual_seed(2)
    data = [(torch.cat([ids, ids.flip(0)]), torch.randint(0, 20, (8,), generator=g)) for _ in range(2)]
    model = Penalised()
    ref = one_device(model, data)
    run_face(face, model, data, loss=F.cross_entropy)
    assert_params_close(model, ref)
    apart = [(torch.arange(24).view(8, 3) % 20, torch.zeros(8, dtype=torch.long))]
    with pytest.raises(RuntimeError, match=r"emb.weight of an nn.Embedding\(max_norm=...\) in another operation "
                                           r"that saved it for backward.*Use only what the embedding returns"):
        run_face(face, Penalised(), apart, loss=F.cross_entropy)


def test_the_hooks_that_follow_a_model_never_travel_with_it():
    """The load hooks on every submodule and the max_norm embedding's forward pre-hook stay out of
    ``torch.save`` and ``copy.deepcopy`` of the wrapped model."""
    import io
    model = Renorm()
    with cgdp.DataParallel(model, DEVS, chunks=1) as dp:
        dp(token_batches(1)[0][0])
        buf = io.BytesIO()
        torch.save(model, buf)
        assert b"cgdp" not in buf.getvalue()
        for twin in (torch.load(io.BytesIO(buf.getvalue()), weights_only=False), copy.deepcopy(model)):
            assert not any(m._forward_pre_hooks or m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks
                           for m in twin.modules())


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 5)
        self.register_buffer("scale", torch.ones(5))

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.parametrize("face", ["trainer", "dataparallel"])
def test_a_buffer_changed_in_place_between_steps_reaches_every_replica(face):
    """A scheduled buffer edited on replica 0 between steps: every replica runs the next forward with it, as one device
    does (not each its own, then averaged)."""
    torch.manual_seed(0)
    net, data = Scaled(), batches(3)

    def change(m):
        with torch.no_grad():
            m.scale.mul_(0.5)

    ref = one_device(net, data, change, at=1, loss=F.mse_loss)
    run_face(face, net, data, change, at=1)  # replicas identical after every step
    for (name, a), b in zip(ref.state_dict().items(), net.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_reset_running_stats_on_the_model_reaches_every_replica():
    """``model.module.bn.reset_running_stats()``: an eval forward on every replica uses the reset statistics."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with cgdp.DataParallel(net, ["cpu:0", "cpu:1"]) as model:
        model(torch.randn(8, 4) * 3 + 1)  # training forward: running statistics move
        model.module[1].reset_running_stats()
        model.eval()
        x = torch.randn(8, 4)
        with torch.no_grad():
            torch.testing.assert_close(model(x), net(x))


@pytest.mark.parametrize("face", ["trainer", "dataparallel"])
def test_the_first_step_that_draws_keeps_the_batchnorm_updates_before_it_on_one_device(face):
    """Dropout off for the first steps, then on: on an emulated device the first forward that draws is done again
    with the device's own stream, from the buffers every earlier step wrote (nothing is averaged on one device, and
    the baseline moves all the same). One device, so that BatchNorm sees the whole batch as the reference does."""
    torch.manual_seed(0)
    net, data = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 5)), batches(4)
    net[2].eval()
    change = lambda m: m[2].train()  # noqa: E731
    ref = one_device(net, data, change, at=3, loss=F.mse_loss)
    run_face(face, net, data, change, at=3, devices=["cpu:0"])
    assert net[1].num_batches_tracked.item() == 4
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean, rtol=1e-5, atol=1e-6)
