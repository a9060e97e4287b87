"""cgdp.integrations.lightning.CGDPStrategy: the user's LightningModule on 2 CPU-emulated devices
equals Lightning on one device with the same batches (parameters, logged values, validation, test
and predict), and a resumed fit is bitwise the uninterrupted one."""
import copy
import warnings

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import cgdp  # noqa: E402
from cgdp.integrations.lightning import RNG_KEY, CGDPStrategy  # noqa: E402

# the integration binds the optimizer: an unbound one would be followed through replica 0, warning
pytestmark = pytest.mark.filterwarnings("error:replica 0's parameters were changed outside")


class Model(L.LightningModule):
    """An ordinary LightningModule: its network in self.net, the loss and logging around it."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3))

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def test_step(self, batch, i):
        x, y = batch
        self.log("test_acc", (self.net(x).argmax(1) == y).float().mean())

    def predict_step(self, batch, i):
        return self.net(batch[0]).softmax(1)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]


class PartsBF16(Model):
    """One device computing each of 2 devices' parts in its own autocast region: the arithmetic of
    bf16-mixed on 2 devices (bf16 gradients per part, summed in float32)."""

    def training_step(self, batch, i):
        x, y = batch
        outs = []
        for part in torch.tensor_split(x, 2):
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                outs.append(self.net(part))
        return nn.functional.cross_entropy(torch.cat(outs), y)


class Recorder(Logger):
    """Every value self.log sent, in order."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name, version = "recorder", 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


def loader(n=64, batch=10, seed=1):
    g = torch.Generator().manual_seed(seed)  # 64 samples, batches of 10: an uneven last batch
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def trainer(**kw):
    kw = {"accelerator": "cpu", "max_epochs": 2, "enable_progress_bar": False, "enable_model_summary": False,
          "enable_checkpointing": False, "logger": False, "log_every_n_steps": 1, **kw}
    return L.Trainer(**kw)


def fit(model, **kw):
    t = trainer(**kw)
    t.fit(model, loader(), loader(24, seed=2))
    return t


def assert_params(a, b, rtol=1e-5, atol=1e-7):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)


def test_fit_validate_test_predict_equal_one_device(monkeypatch):
    """AdamW with a scheduler, accumulation 2, clipping by norm, an uneven last batch: the
    parameters, every logged value and the validation, test and predict results equal one device's;
    every micro-batch but the last of a step runs inside no_sync."""
    torch.manual_seed(0)
    net = Model()
    one, two = net, copy.deepcopy(net)
    quiet = []
    no_sync = cgdp.DataParallel.no_sync
    monkeypatch.setattr(cgdp.DataParallel, "no_sync", lambda self: quiet.append(1) or no_sync(self))
    opts = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    logs1, logs2 = Recorder(), Recorder()
    t1 = fit(one, devices=1, logger=logs1, **opts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t2 = fit(two, devices=2, strategy=CGDPStrategy(), logger=logs2, **opts)
    assert not [w for w in caught if "cgdp" in str(w.message)]  # clipped by the host norm, no copies
    assert len(quiet) == 6  # 7 batches an epoch, steps after batches 2, 4, 6 and 7
    assert_params(one, two)
    assert type(two.net) is nn.Sequential  # the user's module is back in place, trained
    assert [s for s, _ in logs2.rows] == [s for s, _ in logs1.rows] and logs2.rows
    for (_, a), (_, b) in zip(logs1.rows, logs2.rows):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(torch.tensor(b[k]), torch.tensor(a[k]), rtol=1e-5, atol=1e-6)
    data = loader(24, seed=3)
    for stage in ("validate", "test"):
        r1, r2 = getattr(t1, stage)(one, data, verbose=False), getattr(t2, stage)(two, data, verbose=False)
        assert r1[0].keys() == r2[0].keys()
        for k in r1[0]:
            assert r2[0][k] == pytest.approx(r1[0][k], rel=1e-5)
    p1, p2 = t1.predict(one, data), t2.predict(two, data)
    torch.testing.assert_close(torch.cat(p2), torch.cat(p1), rtol=1e-5, atol=1e-6)


def test_bf16_mixed_equals_one_device():
    """strategy="cgdp", precision="bf16-mixed": autocast on every replica; equal to one device
    computing the same two parts in bf16, and close to one device on the whole batch."""
    torch.manual_seed(0)
    net = Model()
    parts, two, whole = PartsBF16(), copy.deepcopy(net), copy.deepcopy(net)
    parts.load_state_dict(net.state_dict())
    opts = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5, "precision": "bf16-mixed", "max_epochs": 1}
    fit(parts, devices=1, **opts)
    fit(two, devices=2, strategy="cgdp", **opts)
    fit(whole, devices=1, **opts)
    assert_params(parts, two)
    assert_params(whole, two, rtol=0, atol=1e-3)


def test_resume_from_checkpoint_is_bitwise(tmp_path):
    """ModelCheckpoint's file has the user's keys and the replicas' random streams; fit(ckpt_path=)
    from the first epoch's checkpoint ends bitwise where the uninterrupted run did, dropout included."""
    torch.manual_seed(0)
    start = Model(dropout=0.3)
    whole, resumed = start, copy.deepcopy(start)
    keep = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    fit(whole, devices=2, strategy=CGDPStrategy(), enable_checkpointing=True, callbacks=[keep])
    saved = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)
    assert list(saved["state_dict"]) == list(Model().state_dict())
    assert len(saved[RNG_KEY]["states"]) == 2
    t = trainer(devices=2, strategy=CGDPStrategy())
    t.fit(resumed, loader(), loader(24, seed=2), ckpt_path=tmp_path / "epoch=0.ckpt")
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    plain = Model.load_from_checkpoint(tmp_path / "epoch=1.ckpt", dropout=0.3)  # a plain Lightning module
    for p, q in zip(whole.parameters(), plain.parameters()):
        assert torch.equal(p, q)


class Manual(Model):
    """Manual optimization: manual_backward, clip_gradients and opt.step() in training_step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, i):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self.net(x), y))
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()


def test_manual_optimization_equals_one_device():
    torch.manual_seed(0)
    one = Manual()
    two = copy.deepcopy(one)
    fit(one, devices=1, max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(two, devices=2, strategy="cgdp", max_epochs=1)
    assert not [w for w in caught if "cgdp" in str(w.message)]
    assert_params(one, two)


class TwoNets(Model):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)


@pytest.mark.parametrize("kw, model, match", [
    ({"plugins": [MixedPrecision("16-mixed", "cpu")]}, Model, "unscale replica 0 only"),
    ({"precision": "bf16-true"}, Model, "convert the model before fit"),
    ({}, TwoNets, r"\['net', 'head'\] all do"),
])
def test_refused_with_a_sentence(kw, model, match):
    with pytest.raises(ValueError, match=match):
        fit(model(), devices=2, strategy=CGDPStrategy(), **kw)


class FrozenSibling(Model):
    """tests_pytorch/models/test_hooks.py's ``test_train_eval_mode_restored``: a frozen child beside the trained one,
    and an optimizer over ``self.parameters()``."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(3, 3).requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_optimizer_over_a_frozen_sibling_trains_as_one_device():
    """``SGD(self.parameters())`` with a frozen child beside the trained one: bound to the DataParallel, the sibling's
    parameters are the optimizer's alone (frozen here), and training is one device's."""
    torch.manual_seed(0)
    one = FrozenSibling()
    two = copy.deepcopy(one)
    fit(one, devices=1)
    fit(two, devices=2, strategy=CGDPStrategy())
    assert_params(two, one)


def test_several_machines_refused_with_a_sentence():
    with pytest.raises(NotImplementedError, match="comm='mpi'"):
        CGDPStrategy(comm="mpi")


# ---- Lightning's own cases (tests_pytorch/trainer/optimization, core/test_lightning_module.py), ported: the
# LightningModule as written, its module tree read during training, compared with Lightning on one device.

def boring_data(n=32, batch=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(torch.randn(n, 32, generator=g), batch_size=batch)


def fit_both(model, strategy_kw=None, data=boring_data, **kw):
    """The model trained on one device and a copy on 2 through CGDPStrategy, with cgdp's warnings caught."""
    one, two = model, copy.deepcopy(model)
    trainer(devices=1, **kw).fit(one, data())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(devices=2, strategy=CGDPStrategy(**(strategy_kw or {})), **kw).fit(two, data())
    return one, two, [str(w.message) for w in caught if "cgdp" in str(w.message)]


class ManualOptModel(BoringModel):
    """test_manual_optimization.py's ManualOptModel: two optimizers, self.layer.weight.grad read between steps,
    a second backward through a retained graph."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.seen = []

    def training_step(self, batch, batch_idx):
        assert type(self.layer) is nn.Linear  # the user's module, where the user put it
        opt_a, opt_b = self.optimizers()
        assert self.layer.weight.grad is None
        loss_1 = self.step(batch)
        self.manual_backward(loss_1)
        self.seen.append(self.layer.weight.grad.clone())  # the whole batch's gradient, as on one device
        opt_a.step()
        opt_a.zero_grad()
        assert self.layer.weight.grad is None
        loss_2 = self.step(batch)
        self.manual_backward(loss_2, retain_graph=True)
        self.manual_backward(loss_2)
        self.seen.append(self.layer.weight.grad.clone())
        opt_b.step()
        opt_b.zero_grad()
        assert self.layer.weight.grad is None
        return loss_2

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.layer.parameters(), lr=0.1)


@pytest.mark.parametrize("update", ["devices", "host"])
def test_manual_two_optimizers_read_the_childs_attributes(update):
    torch.manual_seed(0)
    one, two, said = fit_both(ManualOptModel(), {"update": update}, max_epochs=1)
    assert not said
    assert len(two.seen) == len(one.seen) == 8
    for a, b in zip(one.seen, two.seen):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert_params(one, two)


class ToggleModel(BoringModel):
    """test_toggle_untoggle_2_optimizers_no_shared_parameters, its two parts in one child (``self.net``): cgdp
    runs the one child that holds the trainable parameters."""

    def __init__(self):
        super().__init__()
        del self.layer
        self.automatic_optimization = False
        layer_1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        layer_2 = nn.Sequential(nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
        self.net = nn.Sequential()
        self.net.layer_1, self.net.layer_2 = layer_1, layer_2
        # some weights frozen, to check that toggle/untoggle works as expected
        layer_1[2].weight.requires_grad = False
        layer_1[4].weight.requires_grad = False
        layer_2[1].weight.requires_grad = False
        layer_2[3].weight.requires_grad = False

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        opt1, opt2 = self.optimizers()
        # requires_grad of layer_1[0], [2], [4] and layer_2[1], [3], [5] while each optimizer is toggled
        self.toggled_step(batch, opt1, [True, False, False, False, False, False])
        self.toggled_step(batch, opt2, [False, False, False, False, False, True])

    def toggled_step(self, batch, opt, trains):
        self.toggle_optimizer(opt)
        loss = self.step(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        l1, l2 = self.net.layer_1, self.net.layer_2
        assert [m.weight.requires_grad for m in (l1[0], l1[2], l1[4], l2[1], l2[3], l2[5])] == trains
        opt.step()
        self.untoggle_optimizer(opt)

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net.layer_1.parameters(), lr=0.1),
                torch.optim.Adam(self.net.layer_2.parameters(), lr=0.1)]


def test_toggle_optimizer():
    torch.manual_seed(0)
    one, two, said = fit_both(ToggleModel(), max_epochs=1)
    assert not said
    assert_params(one, two)
    assert all(p.requires_grad for p in two.net.layer_1[0].parameters())  # untoggled


class GD(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 32))
        self.d = nn.Sequential(nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        return self.d(self.g(x))


class PerSubmoduleOptimizers(L.LightningModule):
    """One optimizer per submodule (issue 36's ``configure_optimizers``), manual optimization as in
    test_multiple_optimizers_manual: a generator step then a discriminator step, submodules read by name."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = GD()

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        assert isinstance(opt_g.optimizer, torch.optim.Adam) and isinstance(opt_d.optimizer, torch.optim.SGD)
        self.toggle_optimizer(opt_g)
        loss_g = -self.net(batch).mean()
        self.manual_backward(loss_g)
        assert self.net.d[0].weight.grad is None
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        loss_d = self.net(batch).pow(2).mean()
        self.manual_backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log("loss_d", loss_d)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.g.parameters()), torch.optim.SGD(self.net.d.parameters(), lr=.1)


def test_per_submodule_optimizers():
    torch.manual_seed(0)
    one, two, said = fit_both(PerSubmoduleOptimizers(), max_epochs=2)
    assert not said
    assert_params(one, two)
    assert type(two.net) is GD


class ClosureModel(BoringModel):
    """test_step_with_optimizer_closure (without its dropout): manual optimization, opt.step(closure=...) whose
    closure runs two backwards through a retained graph."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        assert self.layer.weight.grad is None
        opt = self.optimizers()

        def optimizer_closure():
            losses = []
            for backward_idx in range(2):
                loss = self.step(batch)
                losses.append(loss)
                self.manual_backward(loss, retain_graph=backward_idx == 0)
            self.log("train_loss", torch.stack(losses).mean(), on_step=True, on_epoch=True)

        weight_before = self.layer.weight.clone()
        opt.step(closure=optimizer_closure)
        opt.zero_grad()
        assert not torch.equal(weight_before, self.layer.weight)


def test_manual_step_with_closure():
    torch.manual_seed(0)
    one, two, said = fit_both(ClosureModel(), max_epochs=1)
    assert not said
    assert_params(one, two)


class LBFGSModel(BoringModel):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        raise AssertionError("training started")


def test_closure_optimizer_refused_before_training():
    """LBFGS re-runs the closure inside its step: refused when the Trainer sets up the optimizers."""
    model = LBFGSModel()
    with pytest.raises(ValueError, match=r"cannot train with LBFGS: its step\(closure\) re-runs"):
        trainer(devices=2, strategy=CGDPStrategy()).fit(model, boring_data())
    assert "forward" not in model.layer.__dict__  # the module put back as it was


class ReadsDuringTraining(Model):
    """The tree read during fit: a penalty on a weight read by name, a copy of the module (as
    StochasticWeightAveraging makes)."""

    def training_step(self, batch, i):
        assert type(self.net) is nn.Sequential and isinstance(self.net[0], nn.Linear)
        assert list(self.state_dict()) == list(Model().state_dict())
        x, y = batch
        copied = copy.deepcopy(self.net)  # a plain module: its forward is the module's own
        assert copied.forward.__self__ is copied
        torch.testing.assert_close(copied(x), nn.Sequential.forward(self.net, x))
        penalty = self.net[0].weight.pow(2).sum()  # reaches the user's parameter alone, outside the replicas
        return nn.functional.cross_entropy(self.net(x), y) + 1e-2 * penalty


def test_module_tree_read_during_fit():
    torch.manual_seed(0)
    one, two, said = fit_both(ReadsDuringTraining(), data=loader, max_epochs=1)
    assert not said
    assert_params(one, two)
    assert "forward" not in two.net.__dict__  # put back as it was


class ReadsChild(Model):
    """A training_step that reads the child's attributes (a weight penalty on self.net[0].weight), as written for
    one device."""

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y) + 1e-2 * self.net[0].weight.square().sum()


class PerSubmodule(L.LightningModule):
    """Lightning's manual optimization with one optimizer per submodule, built in configure_optimizers from the
    child's own submodules (self.net.g, self.net.d), toggle_optimizer around each, a GAN-like pair of steps."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.ModuleDict({"g": nn.Linear(8, 8), "d": nn.Sequential(nn.Linear(8, 16), nn.Tanh(),
                                                                           nn.Linear(16, 3))})

    def forward(self, x):
        return self.net["d"](self.net["g"](x))

    def training_step(self, batch, i):
        g_opt, d_opt = self.optimizers()
        x, y = batch
        self.toggle_optimizer(d_opt)
        d_opt.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self.forward(x), y))
        d_opt.step()
        self.untoggle_optimizer(d_opt)
        self.toggle_optimizer(g_opt)
        g_opt.zero_grad()
        self.manual_backward(-nn.functional.cross_entropy(self.forward(x), y) + self.net.g.weight.norm())
        g_opt.step()
        self.untoggle_optimizer(g_opt)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.g.parameters(), lr=1e-2), torch.optim.SGD(self.net.d.parameters(), lr=0.1)


class Wrapping(nn.Module):
    """The GAN pair in one child whose forward the LightningModule calls, so that the batch splits."""

    def __init__(self):
        super().__init__()
        self.g, self.d = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x):
        return self.d(self.g(x))


class PerSubmoduleSplit(PerSubmodule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = Wrapping()

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("make", [ReadsChild, PerSubmodule, PerSubmoduleSplit])
def test_the_lightning_module_stays_as_written(make):
    """Lightning's DDP leaves the LightningModule's tree alone; so does CGDPStrategy as far as the module reads it:
    attributes of the wrapped child (self.net[0].weight, self.net.g), optimizers per submodule built in
    configure_optimizers after wrapping, toggle_optimizer, manual optimization: equal to Lightning on one device.
    (They failed with "'DataParallel' object has no attribute ...".)"""
    torch.manual_seed(0)
    one = make()
    two = copy.deepcopy(one)
    fit(one, devices=1, max_epochs=1)
    fit(two, devices=2, strategy="cgdp", max_epochs=1)
    assert_params(one, two)
    assert type(two.net) is type(one.net)  # the child back in its place after fit

