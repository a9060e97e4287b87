"""cgdp.DataParallel under faults: optimizer subclasses, an optimizer step that raises on some
replicas, a forward that fails on one device, one model driven from two threads. In every case
the replicas stay bitwise identical and training matches one device running the same loop (the
same step failing there), or the call is refused with an error that says why."""
import copy
from contextlib import nullcontext
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from helpers import WithBN, assert_params_close, assert_replicas_identical, mlp

DEVS = ["cpu:0", "cpu:1"]


def batches(n_steps, n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(n_steps)]


def train(model, opt, data, out_device=None):
    """The user's loop; each step's exception (if any) is kept and the loop goes on."""
    errors = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y if out_device is None else y.to(out_device))
        loss.backward()
        try:
            opt.step()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the loop goes on, as a user's might
            errors.append(str(e))
    return errors


def on_one_device_and_dp(make_opt, data, net=None):
    """(errors, reference model) of one device, and (errors, DataParallel) on two devices."""
    net = net or mlp()
    ref = copy.deepcopy(net)
    ref_errors = train(ref, make_opt(ref.parameters()), data)
    model = cgdp.DataParallel(net, DEVS, chunks=1)
    errors = train(model, make_opt(model.parameters()), data, model.output_device)
    return ref_errors, ref, errors, model


# ------------------------------------------------------------------ optimizer subclasses
class MySGD(torch.optim.SGD):
    def step(self, closure=None):  # the common pattern: extra work, then the parent's step
        return super().step(closure)


class MyAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize("cls", [MySGD, MyAdamW])
def test_optimizer_subclass_calling_super_step(cls):
    """torch wraps both step() methods, so its global hooks fire twice, nested; with an instance
    of the parent class alive (here a plain one) every step used to fail."""
    parent = cls.__mro__[1]([nn.Parameter(torch.zeros(1))], lr=0.1)  # wraps the parent's step too
    ref_errors, ref, errors, model = on_one_device_and_dp(lambda p: cls(p, lr=0.01), batches(4))
    with model:
        assert errors == ref_errors == [None] * 4
        assert_replicas_identical(model)
        assert_params_close(model.module, ref)
    del parent


# ------------------------------------------------------------------ a step that raises somewhere
class Failing(torch.optim.SGD):
    """Raises at step 2 (counted per optimizer), ``when`` its update has run or before, and only
    on the threads ``where`` says (the user's thread steps replica 0; cgdp's device threads step
    the others). cgdp builds the other replicas' optimizers as ``cls(groups, **defaults)``."""
    when, where = "before", "all"

    def __init__(self, params, lr=0.05, momentum=0.9, **kw):
        super().__init__(params, lr=lr, momentum=momentum, **kw)
        self.calls = 0

    def _hits(self):
        main = threading.current_thread() is threading.main_thread()
        return self.calls == 2 and (self.where == "all" or (self.where == "replica 0") == main)

    def step(self, closure=None):
        self.calls += 1
        if self.when == "before" and self._hits():
            raise ValueError("refused before changing anything")
        out = super().step(closure)
        if self.when == "after" and self._hits():
            raise ValueError("failed after the update")
        return out


def failing(when, where):
    return type("Failing", (Failing,), {"when": when, "where": where})


@pytest.mark.parametrize("when, where", [("before", "replica 0"), ("after", "replica 0"), ("before", "all")])
def test_a_step_that_raises_leaves_replicas_identical_and_equal_to_one_device(when, where):
    """Replica 0's step raises (before or after its update) while the other replicas stepped, or
    every replica raises before changing anything: the user sees the error, and from then on the
    model trains exactly as one device on which the same step raised (no false 'replicas are no
    longer identical')."""
    ref_errors, ref, errors, model = on_one_device_and_dp(failing(when, where), batches(4))
    with model:
        assert errors == ref_errors and errors[1] is not None and errors[2:] == [None, None], errors
        assert_replicas_identical(model)
        assert_params_close(model.module, ref)


def test_a_step_that_raises_on_another_replica_only_is_reported_and_resynced():
    ref_errors, ref, errors, model = on_one_device_and_dp(failing("after", "others"), batches(4))
    with model:
        assert ref_errors == [None] * 4  # one device: no other replica to fail
        assert "raised on replica 1" in errors[1] and "replicas are identical" in errors[1], errors
        assert errors[2:] == [None, None]
        assert_replicas_identical(model)
        assert_params_close(model.module, ref)


# ------------------------------------------------------------------ a forward that fails on one device
class FailsOnOneDevice(WithBN):
    """A BatchNorm model whose forward raises on cpu:1 before its BatchNorm, while ``ON`` is set."""
    ON = {"fail": False}

    def forward(self, x):
        if self.ON["fail"] and threading.current_thread().name == "cgdp-cpu:1":
            raise RuntimeError("this device's input is bad")
        return super().forward(x)


def _buffers_identical(replicas):
    for r in replicas[1:]:
        for (name, a), b in zip(replicas[0].named_buffers(), r.buffers()):
            assert torch.equal(a, b.to(a.device)), f"replicas differ in {name}"


@pytest.mark.parametrize("face", ["DataParallel", "Trainer"])
def test_a_forward_that_failed_on_one_device_leaves_the_buffers_identical(face):
    """BatchNorm's num_batches_tracked advanced on cpu:0 only; it used to differ for good (4 vs 3)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    opt = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    if face == "DataParallel":
        model = cgdp.DataParallel(FailsOnOneDevice(), DEVS, chunks=1)
        sgd = opt(model.parameters())

        def step():
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            sgd.step()
    else:
        model = cgdp.Trainer(FailsOnOneDevice(), opt, DEVS, chunks=1)

        def step():
            model.step(x, y, F.cross_entropy)
    with model:
        step()
        FailsOnOneDevice.ON["fail"] = True
        try:
            with pytest.raises(RuntimeError, match="this device's input is bad"):
                step()
        finally:
            FailsOnOneDevice.ON["fail"] = False
        step()
        _buffers_identical(model.replicas)
        step()
        _buffers_identical(model.replicas)
        assert len({int(r.bn.num_batches_tracked) for r in model.replicas}) == 1


# ------------------------------------------------------------------ one model, two threads
class Gate(nn.Module):
    """An MLP whose forward waits on ``HOLD`` while it is armed (in the caller's thread)."""
    HOLD = {"armed": False, "entered": threading.Event(), "release": threading.Event()}

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        if self.HOLD["armed"] and threading.current_thread().name == "cgdp-cpu:0":
            self.HOLD["entered"].set()
            self.HOLD["release"].wait(30)
        return self.net(x)


def test_a_second_thread_is_refused_while_an_operation_runs():
    hold = Gate.HOLD
    hold.update(armed=True, entered=threading.Event(), release=threading.Event())
    x, y = batches(1)[0]
    with cgdp.DataParallel(Gate(), DEVS, chunks=1) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out = []
        first = threading.Thread(target=lambda: out.append(model(x)), daemon=True)
        first.start()
        assert hold["entered"].wait(10)
        errors = []
        for call in (lambda: model(x), opt.step, lambda: model.clip_grad_norm_(1.0)):
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))
        hold["armed"] = False
        hold["release"].set()
        first.join(10)
        assert len(errors) == 3 and all("running on another thread" in e and "one operation at a time" in e
                                        for e in errors), errors
        F.cross_entropy(out[0], y).backward()  # the first thread's forward was not disturbed
        opt.step()
        assert_replicas_identical(model)


@pytest.mark.filterwarnings("ignore:replica 0's gradients were changed")  # the other thread's zero_grad
def test_one_model_driven_from_two_threads_stays_identical():
    """Two threads run the whole loop on one model at once: each call either runs whole or is
    refused with the clear error; the replicas never differ, and later steps run cleanly."""
    model = cgdp.DataParallel(mlp(), DEVS, chunks=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = batches(12)
    errors, done = [], []

    def worker():
        ok = 0
        for x, y in data:
            try:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                time.sleep(0.001)
                loss.backward()
                opt.step()
                ok += 1
            except RuntimeError as e:
                errors.append(str(e))
                time.sleep(0.002)  # and try again: the threads' calls interleave
        done.append(ok)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    with model:
        for e in errors:  # ours, or torch's when the other thread's step changed the weights
            assert any(m in e for m in ("one operation at a time", "redo this step's forward and backward",
                                        "modified by an inplace operation")), e
        assert sum(done) > 0 and errors, (done, errors)  # steps went through, calls collided
        assert_replicas_identical(model)
        train(model, opt, batches(2))  # one thread again: clean
        assert_replicas_identical(model)


class _FailsOnce(torch.autograd.Function):
    """Identity whose backward raises while ``fail`` is set (after the later layer's gradient)."""
    fail = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _FailsOnce.fail:
            raise RuntimeError("this backward failed")
        return g


class LateFailure(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.fc2(_FailsOnce.apply(self.fc1(x)))


def test_a_backward_that_failed_in_a_thread_that_ended_does_not_block_the_model():
    """A backward that raised leaves its turn stale (autograd skips the final callback); once its
    thread has ended, any thread cleans it up and trains on, exactly as one device would."""
    net = LateFailure()
    ref = copy.deepcopy(net)
    data = batches(3)
    with cgdp.DataParallel(net, DEVS, chunks=1) as model:
        for m in (model, ref):
            opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            x, y = data[0]

            def fails():
                _FailsOnce.fail = True
                try:
                    with pytest.raises(RuntimeError, match="this backward failed"):
                        F.cross_entropy(m(x), y).backward()
                finally:
                    _FailsOnce.fail = False

            worker = threading.Thread(target=fails)
            worker.start()
            worker.join(30)
            assert not worker.is_alive()
            with pytest.warns(UserWarning, match="partway") if m is model else nullcontext():
                train(m, opt, data[1:])
        assert_replicas_identical(model)
    assert_params_close(net, ref)
