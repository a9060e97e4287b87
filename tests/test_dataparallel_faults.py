"""cgdp.DataParallel under faults: optimizer subclasses, an optimizer step that raises on some
replicas, a forward that fails on one device, one model driven from two threads. In every case
the replicas stay bitwise identical and training matches one device running the same loop (the
same step failing there), or the call is refused with an error that says why."""
import copy
import gc
from contextlib import nullcontext
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from helpers import WithBN, assert_params_close, assert_replicas_identical, bound, mlp
from cgdp.testing import inside

DEVS = ["cpu:0", "cpu:1"]


def batches(n_steps, n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(n_steps)]


def train(model, opt, data, out_device=None):
    """The user's loop; each step's exception (if any) is kept and the loop goes on."""
    opt, errors = bound(model, opt), []
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
class Counted:
    """An optimizer subclass whose step() calls super().step(), counting its calls."""
    def step(self, closure=None):  # the common pattern: extra work, then the parent's step
        self.calls = getattr(self, "calls", 0) + 1
        return super().step(closure)


class MySGD(Counted, torch.optim.SGD):
    pass


class MyAdamW(Counted, torch.optim.AdamW):
    pass


def test_a_nested_step_that_raised_leaves_nothing_behind():
    """The first step of an optimizer subclass raises inside its nested super().step(): the bound
    step (the outermost by construction) gives the lock back and resyncs in its ``finally``; the
    next steps (the first with no other operation of the model between) step every replica: one
    device's result, replicas identical."""
    parent = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # wraps the parent's step too
    net = mlp()
    ref = copy.deepcopy(net)
    model = cgdp.DataParallel(net, DEVS, chunks=1)
    opt = model.bind(MySGD(model.parameters(), lr=0.05))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    seen = []

    def second_call_raises(o, args, kwargs):  # the outer step's pre-hooks, then the nested one's
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("the nested step fails")
    hook = opt.register_step_pre_hook(second_call_raises)
    x, y = batches(1)[0]
    with model:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(RuntimeError, match="the nested step fails"):
            opt.step()
        hook.remove()
        opt.step()  # the same gradients, stepped now: no forward or backward between
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        for xb, yb in batches(3):
            for o, m in ((opt, model), (ref_opt, ref)):
                o.zero_grad()
                F.cross_entropy(m(xb), yb).backward()
                o.step()
        assert opt.calls == 5
        assert_replicas_identical(model)
        assert_params_close(model.module, ref)
    del parent


@pytest.mark.parametrize("cls", [MySGD, MyAdamW])
def test_optimizer_subclass_calling_super_step(cls, monkeypatch):
    """torch wraps both step() methods (with an instance of the parent class alive, here a plain
    one), so their hooks fire twice, nested. The bound step is the outermost call by construction:
    each replica's optimizer steps once per step, and no replica is ever resynced."""
    from cgdp.engine.dataparallel.binding import Binding
    resyncs = []
    monkeypatch.setattr(Binding, "resync", lambda self, opt, real=Binding.resync: resyncs.append(1) or real(self, opt))
    parent = cls.__mro__[2]([nn.Parameter(torch.zeros(1))], lr=0.1)  # wraps the parent's step too
    net = mlp()
    ref, model = copy.deepcopy(net), cgdp.DataParallel(net, DEVS, chunks=1)
    opt = model.bind(cls(model.parameters(), lr=0.01))
    ref_errors, errors = train(ref, cls(ref.parameters(), lr=0.01), batches(4)), train(model, opt, batches(4))
    with model:
        assert errors == ref_errors == [None] * 4
        assert_replicas_identical(model)
        assert_params_close(model.module, ref)
        (b,) = inside(model).bindings
        assert [o.calls for o in [b.opt(), *b.mirrors]] == [4, 4]
        assert not resyncs
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
        sgd = model.bind(opt(model.parameters()))

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
        opt = model.bind(torch.optim.SGD(model.parameters(), lr=0.1))
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
    refused with the clear error; the replicas never differ, and later steps run cleanly. The
    first forward holds until the other thread has been refused once, so the calls collide on a
    loaded machine too."""
    errors, done = [], []

    class HeldOnce(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            if held:
                held.clear()  # once (every replica is a deep copy; `held` is shared)
                deadline = time.monotonic() + 30
                while not errors and time.monotonic() < deadline:
                    time.sleep(0.001)
            return self.net(x)

    held = [True]
    model = cgdp.DataParallel(HeldOnce(), DEVS, chunks=1)
    opt = model.bind(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    data = batches(12)

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
        # ours; or torch's, when the other thread's step changed the weights, or its zero_grad()
        # (which is the user's optimizer's, not a cgdp operation) unset .grad inside this step
        for e in errors:
            assert any(m in e for m in ("one operation at a time", "redo this step's forward and backward",
                                        "modified by an inplace operation", "on undefined tensor",
                                        "undefined input tensor")), e
        assert sum(done) > 0 and errors, (done, errors)  # steps went through, calls collided
        assert_replicas_identical(model)
        train(model, opt, batches(2))  # one thread again: clean
        assert_replicas_identical(model)


# ------------------------------------------------------------------ one model, one engine
def engine(face, net):
    if face == "DataParallel":
        return cgdp.DataParallel(net, DEVS, chunks=1)
    return cgdp.Trainer(net, lambda p: torch.optim.SGD(p, lr=0.1), DEVS, chunks=1)


@pytest.mark.parametrize("first", ["DataParallel", "Trainer"])
@pytest.mark.parametrize("second", ["DataParallel", "Trainer"])
def test_one_model_in_two_open_engines_is_refused(first, second):
    """A notebook cell run twice, two trainers on one model: the second engine would take the
    model's gradients over while the first still runs. Refused, saying what to do; after close()
    the second engine builds and trains the model exactly."""
    net = mlp()
    ref = copy.deepcopy(net)
    one = engine(first, net)
    with pytest.raises(RuntimeError, match=rf"already being trained by an open cgdp.{first} .* call close\(\) on the other"):
        engine(second, net)
    one.close()
    data = batches(2)
    with engine(second, net) as two:
        if second == "DataParallel":
            train(two, torch.optim.SGD(two.parameters(), lr=0.1), data, two.output_device)
        else:
            for x, y in data:
                two.step(x, y, F.cross_entropy)
        assert_replicas_identical(two)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data)
    assert_params_close(net, ref)


def test_an_engine_does_not_wrap_an_engine():
    net = mlp()
    with cgdp.DataParallel(net, DEVS, chunks=1) as inner:
        for make in (lambda m: cgdp.DataParallel(m, DEVS), lambda m: engine("Trainer", m),
                     lambda m: cgdp.DataParallel(nn.Sequential(m, nn.Linear(5, 2)), DEVS)):
            with pytest.raises(TypeError, match="a cgdp.DataParallel; an engine does not wrap another"):
                make(inner)


@pytest.mark.filterwarnings("error")  # an optimizer that stepped replica 0 alone would warn at the next forward
def test_a_notebook_cell_run_twice_and_an_optimizer_bound_after_a_freed_wrapper():
    """``model = cgdp.DataParallel(net)`` run again while the first wrapper is open is refused;
    after close() it works, and so after the first was dropped: an optimizer bound then steps
    every replica."""
    net = mlp()
    ref = copy.deepcopy(net)
    data = batches(4)
    model = cgdp.DataParallel(net, DEVS, chunks=1)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), data[:1], model.output_device)
    with pytest.raises(RuntimeError, match="call close"):
        model = cgdp.DataParallel(net, DEVS, chunks=1)
    model.close()
    model = cgdp.DataParallel(net, DEVS, chunks=1)  # the closed one is freed here
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), data[1:2], model.output_device)
    del model  # dropped without close()
    model = cgdp.DataParallel(net, DEVS, chunks=1)
    gc.collect()
    opt = model.bind(torch.optim.SGD(model.parameters(), lr=0.1))
    with model:
        train(model, opt, data[2:], model.output_device)
        assert_replicas_identical(model)
    train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data)
    assert_params_close(net, ref)


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


def failing_backward(m, x, y):
    """A backward of ``m`` on ``(x, y)`` that raises after the later layer's gradient."""
    _FailsOnce.fail = True
    try:
        with pytest.raises(RuntimeError, match="this backward failed"):
            F.cross_entropy(m(x), y).backward()
    finally:
        _FailsOnce.fail = False


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
            opt = bound(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
            x, y = data[0]
            worker = threading.Thread(target=failing_backward, args=(m, x, y))
            worker.start()
            worker.join(30)
            assert not worker.is_alive()
            with pytest.warns(UserWarning, match="partway") if m is model else nullcontext():
                train(m, opt, data[1:])
        assert_replicas_identical(model)
    assert_params_close(net, ref)


# ------------------------------------------------------------------ close() from another thread
def _cgdp_threads() -> int:
    return sum(t.name.startswith("cgdp-") for t in threading.enumerate())


def assert_threads_back_to(base: int) -> None:
    """The model's threads stop (a 30 s bound against a hang): as many cgdp threads as ``base`` again."""
    deadline = time.monotonic() + 30
    while _cgdp_threads() > base and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _cgdp_threads() == base, [t.name for t in threading.enumerate()]


def test_close_from_another_thread_during_backward_stops_it_at_once():
    """The other thread's close() lands in the middle of backward (from a backward hook, which
    waits until close() has stopped the backward): backward() raises the RuntimeError that names
    close() at once (it waited timeout_s, then an IndexError, before), close() returns once
    backward has ended, and every thread of the model is gone."""
    gc.collect()
    base = _cgdp_threads()
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    model = cgdp.DataParallel(net, DEVS, chunks=1, timeout_s=120)
    closer = threading.Thread(target=model.close)
    engine = inside(model)

    def hook(mod, grad_in, grad_out):
        if closer.ident is None:  # the first replica's hook (module hooks run on every replica)
            closer.start()
            deadline = time.monotonic() + 30
            while engine.error is None and time.monotonic() < deadline:  # until close() stopped it
                time.sleep(0.001)
    net[2].register_full_backward_hook(hook)
    loss = model(torch.randn(8, 32)).pow(2).mean()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"close\(\) was called while its backward was running"):
        loss.backward()
    assert time.monotonic() - t0 < 60  # at once, not after timeout_s (120 s)
    closer.join(30)
    assert not closer.is_alive() and model.closed
    del model, engine, loss
    assert_threads_back_to(base)
    assert all(torch.isfinite(p).all() for p in net.parameters())


HOLD: dict = {"where": None, "reached": threading.Event(), "model": None, "closed": threading.Event()}
"""Where close() lands in the user's loop (a phase below), set by the test; module level because the
replicas are deep copies."""


def _hold_for_close(where: str) -> None:
    """At phase ``where``: tell the closer, then hold there until close() has stopped the model's
    waits (or returned), so that close() lands in this phase whatever the machine's load."""
    if HOLD["where"] != where:
        return
    HOLD["where"] = None  # once
    HOLD["reached"].set()
    deadline = time.monotonic() + 30
    while inside(HOLD["model"]).error is None and not HOLD["closed"].is_set():
        assert time.monotonic() < deadline, "close() never took effect"
        time.sleep(0.001)


def test_close_from_another_thread_at_each_moment_has_a_clear_outcome():
    """close() lands in each part of the user's loop (forward, backward, the optimizer's step,
    between them; arranged with events, the loop holding at the part until close() took effect):
    the loop finishes, or stops with the RuntimeError that names close() or says the model is
    closed, never an internal error or a wait of timeout_s; close() returns and every thread of the
    model is gone."""

    class HeldSGD(torch.optim.SGD):
        def step(self, closure=None):
            _hold_for_close("step")
            return super().step(closure)

    class Phased(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])

        def forward(self, x):
            _hold_for_close("forward")
            out = self.net(x)
            if out.requires_grad:
                out.register_hook(lambda g: _hold_for_close("backward"))
            return out

    gc.collect()
    base = _cgdp_threads()
    outcomes, net = {}, Phased()
    for where in ("forward", "backward", "step", "between"):
        model = cgdp.DataParallel(net, DEVS, chunks=1, timeout_s=120)
        opt = model.bind(HeldSGD(model.parameters(), lr=1e-3))
        HOLD.update(where=None, reached=threading.Event(), model=model, closed=threading.Event())
        reached, closed = HOLD["reached"], HOLD["closed"]
        closer = threading.Thread(target=lambda m=model: reached.wait(30) and (m.close(), closed.set()))
        closer.start()
        t0 = time.monotonic()
        outcomes[where] = "finished"
        try:
            for i in range(3):
                HOLD["where"] = where if i == 1 else None  # the close lands in a steady iteration
                opt.zero_grad()
                model(torch.randn(16, 64)).pow(2).mean().backward()
                opt.step()
                if i == 1:
                    _hold_for_close("between")
        except RuntimeError as e:
            assert "close() was called while its" in str(e) or "is closed" in str(e), (where, repr(e))
            outcomes[where] = str(e)[:60]
        finally:
            HOLD.update(where=None, model=None)
        assert time.monotonic() - t0 < 60, "a wait ran into timeout_s"
        assert reached.is_set(), f"the loop never reached {where}"
        closer.join(30)
        assert not closer.is_alive(), "close() hung"
        assert model.closed
        assert all(torch.isfinite(p).all() for p in net.parameters())
        del model, opt, closer
        assert_threads_back_to(base)
    assert all(o != "finished" for o in outcomes.values()), outcomes  # each close stopped the loop


def test_close_of_a_model_whose_last_backward_failed_on_this_thread(monkeypatch):
    """A backward that raised leaves its turn stale (autograd skips the final callback): close()
    from the same thread releases everything at once, and the model refuses further use clearly."""
    from cgdp.engine.core import lifetime
    monkeypatch.setattr(lifetime, "CLOSE_WAIT_S", 120.0)  # a wait for the stale turn would show
    gc.collect()
    base = _cgdp_threads()
    model = cgdp.DataParallel(LateFailure(), DEVS, chunks=1)
    x, y = batches(1)[0]
    failing_backward(model, x, y)
    assert inside(model).operation == "backward"  # stale
    t0 = time.monotonic()
    model.close()
    assert time.monotonic() - t0 < 60  # it did not wait CLOSE_WAIT_S for the stale backward
    assert_threads_back_to(base)
    with pytest.raises(RuntimeError, match="is closed"):
        model(x)


class ZeroedMidStep(torch.optim.SGD):
    """Its gradients are dropped inside ``step()``, before the update, as another thread's
    ``zero_grad()`` would drop them between the model's check and the update."""
    victims: set = set()

    def step(self, closure=None):
        if self in ZeroedMidStep.victims:
            self.zero_grad()
        return super().step(closure)


def test_gradients_dropped_during_the_step_leave_the_replicas_identical():
    """Replica 0 steps without gradients while its mirrors step with theirs: every replica then
    takes replica 0's parameters and state, as one device dropping them there holds them."""
    net = mlp()
    ref = copy.deepcopy(net)
    data = batches(3)
    with cgdp.DataParallel(net, DEVS, chunks=1) as model:
        for m in (model, ref):
            opt = bound(m, ZeroedMidStep(m.parameters(), lr=0.1, momentum=0.9))
            for i, (x, y) in enumerate(data):
                (ZeroedMidStep.victims.add if i == 1 else ZeroedMidStep.victims.discard)(opt)
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                if m is model and i == 1:
                    with pytest.warns(UserWarning, match="changed during optimizer.step"):
                        opt.step()
                else:
                    opt.step()
        assert_replicas_identical(model)
    assert_params_close(net, ref)


# ------------------------------------------------------------------ the gradients' states after failures
class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 5)

    def forward(self, x):
        return _FailsOnce.apply(self.b(torch.relu(self.a(x))))  # its backward comes first


def test_clip_after_a_backward_that_failed_early_clips_the_kept_gradients():
    """A synced backward that fails before any gradient arrived keeps the gradients, as one device
    does; arming it reset the host's sum of squares, so the clip that follows must take the norm of
    the kept gradients (not the host's zero) and clip: equal to one device."""
    net = _Head()
    ref = copy.deepcopy(net)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    with cgdp.DataParallel(net, DEVS, chunks=1) as model:
        opts = [bound(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (model, ref)]
        norms = []
        for m, opt, clip in ((model, opts[0], model.clip_grad_norm_),
                             (ref, opts[1], lambda n: torch.nn.utils.clip_grad_norm_(ref.parameters(), n))):
            for it in range(2):
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                if it == 1:
                    failing_backward(m, x, y)
                norms.append(float(clip(0.01)))
                opt.step()
        assert norms[1] > 0 and norms[:2] == pytest.approx(norms[2:], rel=1e-5)
        assert_replicas_identical(model)
        assert_params_close(model.module, ref)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


class _FailsLate(nn.Module):  # fc2's gradient arrives, fc1's never will
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.fc2(_Boom.apply(self.fc1(x)))


def test_clipping_after_a_dropped_backward_does_not_lift_the_refusal():
    with cgdp.DataParallel(_FailsLate(), DEVS, chunks=1) as model:
        opt = model.bind(torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(6, 4)).sum().backward()
        with pytest.warns(UserWarning, match="failed partway"):
            assert float(model.clip_grad_norm_(1.0)) == 0.0  # the clean-up of the failed backward
        with pytest.raises(RuntimeError, match="failed partway"):
            opt.step()


def test_a_step_refused_on_another_thread_leaves_the_running_step_undisturbed(monkeypatch):
    """Thread B's optimizer.step() while thread A's runs is refused; A's step then completes as
    usual, untouched by B's call (no resync of the replicas): the model's lock is given back and
    another thread may use the model."""
    from cgdp.engine.dataparallel.binding import Binding
    resyncs = []
    monkeypatch.setattr(Binding, "resync", lambda self, opt, real=Binding.resync: resyncs.append(1) or real(self, opt))
    entered, tried = threading.Event(), threading.Event()

    class Slow(torch.optim.SGD):  # the main thread's step waits, inside, for the other's attempt
        def step(self, closure=None):
            if threading.current_thread() is threading.main_thread():
                entered.set()
                assert tried.wait(30)
            return super().step(closure)

    x, y = batches(1)[0]
    with cgdp.DataParallel(mlp(), DEVS, chunks=1) as model:
        opt = model.bind(Slow(model.parameters(), lr=0.1))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        refused = []

        def other():
            entered.wait(30)
            try:
                opt.step()
            except RuntimeError as e:
                refused.append(str(e))
            finally:
                tried.set()
        t = threading.Thread(target=other)
        t.start()
        opt.step()
        t.join()
        assert refused and "one operation at a time" in refused[0]
        assert inside(model).operation is None and not resyncs
        worker = threading.Thread(target=lambda: model(x))
        worker.start()
        worker.join()
        assert_replicas_identical(model)


def test_a_closed_models_optimizer_is_freed_by_reference_counting():
    """The optimizer bound to a DataParallel (a scheduler built after its first step wraps its
    step) holds no reference cycle once the model is closed: its state goes with it."""
    import weakref
    gc.collect()
    gc.disable()
    try:
        with cgdp.DataParallel(mlp(), DEVS, chunks=1) as model:
            opt = model.bind(torch.optim.Adam(model.parameters(), lr=1e-3))
            x, y = batches(1)[0]
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        ref = weakref.ref(opt)
        del opt, sched
        assert ref() is None
    finally:
        gc.enable()


class _StallsOnReplica1(torch.optim.SGD):
    """An SGD whose step holds replica 1's thread while ``HOLD`` is set (a step that never returns)."""
    HOLD = {"release": threading.Event(), "entered": threading.Event(), "on": False}

    def step(self, closure=None):
        if self.HOLD["on"] and threading.current_thread().name == "cgdp-cpu:1":
            self.HOLD["entered"].set()
            self.HOLD["release"].wait(60)
        return super().step(closure)


@pytest.mark.parametrize("how", ["timeout", "ctrl-c"])
def test_a_replica_step_that_never_returns_stops_the_step_and_the_model_refuses_to_go_on(how):
    """The wait for the other replicas' steps is bounded (timeout_s) and Ctrl-C surfaces at once; the replica still
    stepping is never resynced under it, and the model then refuses every operation with a sentence."""
    import _thread
    hold = _StallsOnReplica1.HOLD
    hold["release"].clear(), hold["entered"].clear()
    model = cgdp.DataParallel(mlp(), DEVS, timeout_s=1.0 if how == "timeout" else None)
    opt = model.bind(_StallsOnReplica1(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    hold["on"] = True
    try:
        if how == "ctrl-c":
            threading.Thread(target=lambda: hold["entered"].wait(30) and _thread.interrupt_main(), daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt if how == "ctrl-c" else TimeoutError):
            opt.step()
        assert time.monotonic() - t0 < 30
        with pytest.raises(RuntimeError, match=r"cannot continue: the device thread\(s\) of cpu:1 never returned"):
            model(x)
        with pytest.raises(RuntimeError, match="cannot continue"):
            opt.step()
    finally:
        hold["on"] = False
        hold["release"].set()
        model.close()


class _InterruptedTwice(_StallsOnReplica1):
    """Replica 0's step raises KeyboardInterrupt (a first Ctrl-C) while replica 1's is held; a second Ctrl-C comes
    while the engine gives replica 1 its time to stop."""

    def step(self, closure=None):
        if self.HOLD["on"] and threading.current_thread() is threading.main_thread():
            import _thread
            threading.Thread(target=lambda: self.HOLD["entered"].wait(30) and (time.sleep(0.1), _thread.interrupt_main()),
                             daemon=True).start()
            raise KeyboardInterrupt
        return super().step(closure)


def test_a_second_ctrl_c_while_the_other_replicas_are_given_time_leaves_them_stuck_never_resynced():
    hold = _InterruptedTwice.HOLD
    hold["release"].clear(), hold["entered"].clear()
    model = cgdp.DataParallel(mlp(), DEVS, timeout_s=None)
    opt = model.bind(_InterruptedTwice(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    hold["on"] = True
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        time.sleep(0.6)  # the second Ctrl-C has landed, wherever it did
        with pytest.raises(RuntimeError, match=r"cannot continue: the device thread\(s\) of cpu:1 never returned"):
            model(x)
    except KeyboardInterrupt:  # the second one, if it landed after pytest.raises
        pass
    finally:
        hold["on"] = False
        hold["release"].set()
        model.close()


def test_a_step_that_raised_on_ranks_leaves_the_model_unusable():
    """With ranks, each may have stopped its step at another point: the model refuses to go on, with a sentence."""
    from test_comm_inproc import on_ranks

    class Raises(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            raise RuntimeError("stopped partway")

    net = mlp()  # every rank starts from the same parameters

    def rank(comm):
        with cgdp.DataParallel(copy.deepcopy(net), ["cpu:0", "cpu:1"], comm=comm, timeout_s=30) as model:
            opt = model.bind(Raises(model.parameters(), lr=0.1))
            x, y = batches(1)[0]
            F.cross_entropy(model(x), y).backward()
            with pytest.raises(RuntimeError, match="stopped partway"):
                opt.step()
            with pytest.raises(RuntimeError, match="the ranks' parameters may differ; load a checkpoint"):
                model(x)
        return True

    assert on_ranks(2, rank, timeout_s=60) == [True, True]
