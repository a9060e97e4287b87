"""``Trainer(update="host")``: one optimizer over float32 masters in host memory, equal to one device."""
from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import threading
import warnings
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

import cgdp
from test_comm_inproc import on_ranks
from test_dataparallel import _Boom
from helpers import (TokenLM, assert_params_close, assert_ranks_equal_reference, assert_replicas_identical, mlp,
                     reference, reference_step2, token_batches, token_sum)

OPTIMIZERS = {
    "adamw": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "rmsprop": partial(torch.optim.RMSprop, lr=1e-3, momentum=0.5),
}


def batches(n_steps=3, n=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(n_steps)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_host_update_equals_one_device(name):
    make = OPTIMIZERS[name]
    model, data = mlp(), batches(4)
    ref, ref_losses = reference(model, make, data, F.cross_entropy)
    # chunks="auto": the tuner switches plans between steps, and the host's views follow
    with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks="auto", update="host") as tr:
        losses = []
        for x, y in data:
            losses.append(tr.step(x, y, F.cross_entropy))
            assert_replicas_identical(tr)
        opt = tr.optimizers[0]
        assert len(tr.optimizers) == 1 and type(opt) is type(make([torch.zeros(1)]))
        # torch's fused CPU kernel where the factory chose no implementation (Adam, AdamW, SGD)
        assert opt.param_groups[0].get("fused") is (True if name != "rmsprop" else None)
        assert all(p.device.type == "cpu" for s in tr.optimizers[0].state.values() for p in s.values()
                   if isinstance(p, torch.Tensor))
        report = tr.memory_report()
        assert set(report) == {"cpu:0", "cpu:1", "host"}
        assert all(report[d]["optimizer_state"] == 0 for d in ("cpu:0", "cpu:1"))
        assert report["host"]["optimizer_state"] > 0
        assert_params_close(tr.replicas[0], ref)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_clipping_scheduler_uneven_split_and_state_dict_round_trip():
    make = partial(torch.optim.AdamW, lr=2e-2)
    sched = partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    model, data = mlp(), batches(4, n=7)
    ref = copy.deepcopy(model)
    opt = make(ref.parameters())
    s = sched(opt)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        s.step()
    kw = dict(chunks=1, update="host", clip_grad_norm=0.05, scheduler=sched)
    with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1", "cpu:2"], **kw) as tr:
        for x, y in data[:2]:
            tr.step(x, y, F.cross_entropy)
        saved = copy.deepcopy(tr.state_dict())
    # a fresh trainer restores the masters and the host optimizer's state, and goes on exactly
    with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], **kw) as tr:
        tr.load_state_dict(saved)
        for x, y in data[2:]:
            tr.step(x, y, F.cross_entropy)
            assert_replicas_identical(tr)
        assert_params_close(tr.replicas[0], ref)
        assert tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(s.get_last_lr()[0])


def test_host_slot_ring_reads_the_gradient_from_replica_0():
    """Without a float32 sum row to read in place, the host copies replica 0's averaged gradient:
    the same as update='devices' with the same ring."""
    make = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    model, data = mlp(), batches()
    out = []
    for update in ("devices", "host"):
        with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=2, update=update,
                          host_memory=1 << 16, segment_bytes=1024) as tr:
            for x, y in data:
                tr.step(x, y, F.cross_entropy)
                assert_replicas_identical(tr)
            out.append(copy.deepcopy(tr.replicas[0]))
    assert_params_close(out[1], out[0])


def test_two_ranks_hold_the_whole_state_and_stay_identical():
    make = OPTIMIZERS["adamw"]
    model, data = mlp(), batches(3, n=12)
    ref, _ = reference(model, make, data, F.cross_entropy)

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], comm=comm, chunks=2, update="host",
                          timeout_s=30) as tr:
            for x, y in data:
                tr.step(torch.tensor_split(x, 2)[comm.rank], torch.tensor_split(y, 2)[comm.rank], F.cross_entropy)
                assert_replicas_identical(tr)
            return copy.deepcopy(tr.replicas[0]).state_dict()

    assert_ranks_equal_reference(on_ranks(2, rank, timeout_s=30), ref, mlp())


def test_parameters_unused_in_a_step_keep_no_update_as_on_one_device():
    """A parameter with no gradient anywhere is skipped by AdamW on one device; so on the host."""
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body, self.a, self.b = torch.nn.Linear(12, 8), torch.nn.Linear(8, 5), torch.nn.Linear(8, 5)

        def forward(self, x, head="a"):
            return getattr(self, head)(torch.tanh(self.body(x)))

    make = OPTIMIZERS["adamw"]
    model, data = TwoHeads(), batches(3)
    ref = copy.deepcopy(model)
    opt = make(ref.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], update="host", chunks=1) as tr:
        for x, y in data:
            tr.step(x, y, F.cross_entropy)
        assert_params_close(tr.replicas[0], ref)
        assert torch.equal(tr.replicas[0].b.weight, model.b.weight)


def test_a_layer_whose_only_parameter_is_tied_to_another_layer_steps_as_on_one_device():
    """A tied output layer (its weight is the embedding's) owns no parameter, so its chunk sends
    nothing: the overlapped host update waited for that chunk's update for ever."""
    make = OPTIMIZERS["adamw"]
    model, data = TokenLM(), token_batches(3, 4)
    ref, _ = reference_step2(model, make, data, token_sum)
    with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], update="host", chunks=[[2], [1], [0]],
                      timeout_s=60) as tr:
        for b in data:
            tr.step(b, token_sum)
        assert_replicas_identical(tr)
        assert_params_close(tr.replicas[0], ref)


def test_unsupported_combinations_are_refused_with_a_sentence():
    with pytest.raises(ValueError, match="mode='cgdp'"):
        cgdp.Trainer(mlp(), OPTIMIZERS["adamw"], ["cpu:0", "cpu:1"], mode="typical", update="host")
    with pytest.raises(ValueError, match="update must be"):
        cgdp.Trainer(mlp(), OPTIMIZERS["adamw"], ["cpu:0"], update="cpu")
    with pytest.raises(ValueError, match="float32"):
        cgdp.Trainer(mlp().to(torch.bfloat16), OPTIMIZERS["adamw"], ["cpu:0"], update="host")
    model = mlp()
    handle = model[0].weight.register_hook(lambda g: 2 * g)
    with cgdp.Trainer(model, OPTIMIZERS["sgd_momentum"], ["cpu:0", "cpu:1"], update="host") as tr:
        x, y = batches(1)[0]
        with pytest.raises(NotImplementedError, match="register_hook"):
            tr.step(x, y, F.cross_entropy)
        assert not tr.optimizers[0].state  # refused after backward: nothing was stepped with it
        handle.remove()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tr.step(x, y, F.cross_entropy)  # usable again without the hook
        assert_replicas_identical(tr)


def _step_threads(tr):
    """The threads the host optimizer's step() ran on, per call (not seen through a step hook:
    one keeps the update after backward)."""
    seen, opt = [], tr.optimizers[0]
    own = opt.step

    def step():
        seen.append(threading.current_thread().name)
        return own()
    opt.step = step
    return seen


def test_per_parameter_optimizer_updates_each_chunk_on_the_host_thread_without_clipping():
    model, data = mlp(), batches(2)
    with cgdp.Trainer(copy.deepcopy(model), OPTIMIZERS["adamw"], ["cpu:0", "cpu:1"], chunks=1, update="host") as tr:
        seen = _step_threads(tr)
        tr.step(*data[0], F.cross_entropy)
        assert tr.stats["host_update_overlapped"] == 1.0
        assert len(seen) == len(tr.plan) and all(n.startswith("cgdp-host") for n in seen)  # one step per chunk
    with cgdp.Trainer(copy.deepcopy(model), OPTIMIZERS["adamw"], ["cpu:0", "cpu:1"], chunks=1, update="host",
                      clip_grad_norm=1.0) as tr:
        seen = _step_threads(tr)
        tr.step(*data[0], F.cross_entropy)
        assert tr.stats["host_update_overlapped"] == 0.0 and seen == [threading.current_thread().name]


class _Poison(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class _FirstLayerPoisoned(torch.nn.Module):
    """The first layer's weight gradient is NaN when ``poison`` is set: the last chunk to arrive."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.poison = False

    def forward(self, x):
        first = self.net[0]
        w = _Poison.apply(first.weight) if self.poison else first.weight
        return self.net[1:](F.linear(x, w, first.bias))


def test_nan_in_a_late_chunk_rejects_the_step_and_leaves_parameters_as_they_were():
    torch.manual_seed(0)
    model, data = _FirstLayerPoisoned(), batches(2)
    with cgdp.Trainer(model, OPTIMIZERS["adamw"], ["cpu:0", "cpu:1"], chunks=1, update="host") as tr:
        tr.step(*data[0], F.cross_entropy)
        before = copy.deepcopy(model.state_dict())
        for r in tr.replicas:
            r.poison = True
        state = copy.deepcopy(tr.optimizers[0].state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the chunks stepped while backward ran are undone, state too
            with pytest.raises(cgdp.NonFiniteGradientError):
                tr.step(*data[1], F.cross_entropy)
        assert _states_equal(tr.optimizers[0].state_dict(), state)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k])
        assert_replicas_identical(tr)
        for r in tr.replicas:
            r.poison = False
        tr.step(*data[1], F.cross_entropy)  # training goes on
        assert_replicas_identical(tr)
        assert not torch.equal(model.net[0].weight, before["net.0.weight"])


@pytest.mark.parametrize("clip", [None, 1.0])
def test_cuda_backend_on_the_strict_simulator_sends_no_gradient_back(clip):
    """The CUDA backend (pinned masters, asynchronous copies to the devices) on the simulated
    runtime, whose stream checker reports any unordered access; with and without overlap."""
    from cgdp.testing import simulated_cuda
    make = OPTIMIZERS["adamw"]
    model, data = mlp(), batches()
    ref = copy.deepcopy(model)
    opt = make(ref.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
    with simulated_cuda(2, seed=1) as sim:
        with cgdp.Trainer(copy.deepcopy(model), make, ["cuda:0", "cuda:1"], update="host", chunks=1,
                          segment_bytes=1024, clip_grad_norm=clip) as tr:
            for x, y in data:
                tr.step(x, y, F.cross_entropy)
                assert_replicas_identical(tr)
            assert tr.stats["host_update_overlapped"] == (clip is None)
            assert_params_close(tr.replicas[0], ref)
    assert not sim.errors
    assert sim.copied_bytes["d2h"] > 0 and sim.copied_bytes["h2d"] == 0  # no gradient comes back


def test_micro_batches_overlap_only_the_last_backward():
    """Micro-batches before the last keep their gradients on the device; the host update of each
    chunk starts during the last one's backward, and the result is that of update='devices'."""
    make, model, data = OPTIMIZERS["adamw"], mlp(), batches(2, n=12)
    out = []
    for update in ("devices", "host"):
        with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=1, micro_batches=2,
                          update=update) as tr:
            for x, y in data:
                tr.step(x, y, F.cross_entropy)
            assert tr.stats.get("host_update_overlapped", 1.0) == 1.0
            out.append(copy.deepcopy(tr.replicas[0]))
    assert_params_close(out[1], out[0])


def test_zero_grad_on_the_host_optimizer_between_steps_changes_nothing():
    """The masters' gradients are views of the host's sum row; an optimizer.zero_grad() drops
    them, and the next step attaches them again (as one device's loop would zero and refill)."""
    make, model, data = OPTIMIZERS["sgd_momentum"], mlp(), batches(3)
    ref, _ = reference(model, make, data, F.cross_entropy)
    for clip in (None, 1e9):  # overlapped, and after backward
        with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=2, update="host",
                          clip_grad_norm=clip) as tr:
            for x, y in data:
                tr.optimizers[0].zero_grad()
                tr.step(x, y, F.cross_entropy)
            assert_params_close(tr.replicas[0], ref)


def _states_equal(a, b):
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][k][n]))
        for k, s in a["state"].items() for n, v in s.items())


class _FailsPartway(torch.nn.Module):
    """Backward raises between the last layer (stepped on the host first) and the first."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net[2:](_Boom.apply(self.net[:2](x)))


def test_a_backward_failing_partway_leaves_the_optimizer_as_one_device_does():
    """Overlapped: the chunks stepped before backward failed get their optimizer state back (one
    device's failed step changes nothing), and training equals one device skipping that step."""
    torch.manual_seed(0)
    make, model, data = OPTIMIZERS["adamw"], _FailsPartway(), batches(4)
    _Boom.fail = False
    ref, _ = reference(model, make, [d for i, d in enumerate(data) if i != 1], F.cross_entropy)
    with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=1,
                      update="host") as tr:
        assert tr.stats.get("host_update_overlapped", 1.0) == 1.0
        for i, (x, y) in enumerate(data):
            _Boom.fail = i == 1
            try:
                if i == 1:
                    with pytest.raises(RuntimeError, match="^boom$"):
                        tr.step(x, y, F.cross_entropy)
                else:
                    tr.step(x, y, F.cross_entropy)
            finally:
                _Boom.fail = i == 3  # back to that module's default at the end
        assert {int(s["step"]) for s in tr.optimizers[0].state.values()} == {3}
        assert_params_close(tr.replicas[0], ref)
        assert_replicas_identical(tr)


def test_a_chunk_step_raising_surfaces_its_error_and_undoes_the_chunks_stepped():
    """The host update thread's error (here the optimizer's step raising on the second chunk) is
    what step() raises, not the abort it caused; the chunks stepped before it are undone."""
    make, model, data = OPTIMIZERS["adamw"], mlp(), batches(3)
    ref, _ = reference(model, make, [data[0], data[2]], F.cross_entropy)
    with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=1,
                      update="host") as tr:
        opt, calls = tr.optimizers[0], []
        own = opt.step

        def step():
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("the step fails once")
            return own()
        tr.step(*data[0], F.cross_entropy)
        assert tr.stats["host_update_overlapped"] == 1.0
        opt.step = step
        try:
            with pytest.raises(ValueError, match="fails once"):
                tr.step(*data[1], F.cross_entropy)
        finally:
            del opt.step
        tr.step(*data[2], F.cross_entropy)
        assert_params_close(tr.replicas[0], ref)
        assert_replicas_identical(tr)


class _MaxNorm(torch.nn.Module):
    """A forward that writes its parameters in place: nn.Embedding(max_norm) renormalises the rows it reads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(20, 4, max_norm=1.0), torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.emb.weight.mul_(3)

    def forward(self, x):
        return self.out(self.emb(x).mean(1))


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]])
def test_a_forward_writing_parameters_in_place_is_kept_by_the_host_step(devices):
    """The masters follow replica 0 after the forward: the host step starts from the renormalised rows."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 20, (8, 3), generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    make = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    ref, _ = reference(_MaxNorm(), make, data, F.cross_entropy)
    with cgdp.Trainer(_MaxNorm(), make, devices, chunks=1, update="host") as tr:
        for x, y in data:
            tr.step(x, y, F.cross_entropy)
        assert_params_close(tr.replicas[0], ref)
        assert_replicas_identical(tr)


def test_step_hooks_keep_the_update_after_backward_once_per_step():
    """A step hook (the optimizer's own or a global one: EMA, logging) would run once per chunk and
    see part of the parameters if the update overlapped backward: it runs once, over all of them."""
    make, model, data = OPTIMIZERS["adamw"], mlp(), batches(2)
    ref, _ = reference(model, make, data, F.cross_entropy)
    n_params = len(list(model.parameters()))
    with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=1, update="host") as tr:
        seen = []
        hook = tr.optimizers[0].register_step_post_hook(
            lambda opt, *_: seen.append(sum(len(g["params"]) for g in opt.param_groups)))
        tr.step(*data[0], F.cross_entropy)
        assert seen == [n_params]
        assert tr.stats["host_update_overlapped"] == 0.0 and tr.stats["host_update_step_hooks"] == 1.0
        hook.remove()
        hook = register_optimizer_step_pre_hook(lambda opt, *_: seen.append(0))
        try:
            tr.step(*data[1], F.cross_entropy)
        finally:
            hook.remove()
        assert seen == [n_params, 0] and tr.stats["host_update_overlapped"] == 0.0
        assert_params_close(tr.replicas[0], ref)
        with cgdp.DataParallel(mlp(), ["cpu:0"]):  # registers no global hook: other optimizers left alone
            tr.step(*data[1], F.cross_entropy)
        assert tr.stats["host_update_overlapped"] == 1.0 and tr.stats["host_update_step_hooks"] == 0.0


def test_an_explicit_implementation_choice_is_kept():
    """foreach=False (or fused=False) chosen by the factory is not overridden by fused=True."""
    for kw in ({"foreach": False}, {"fused": False}):
        with cgdp.Trainer(mlp(), partial(torch.optim.AdamW, lr=1e-2, **kw), ["cpu:0"], update="host") as tr:
            g = tr.optimizers[0].param_groups[0]
            assert not g["fused"] and g["foreach"] is kw.get("foreach")
        with cgdp.DataParallel(mlp(), ["cpu:0", "cpu:1"], update="host") as dp:
            opt = dp.bind(torch.optim.AdamW(dp.parameters(), lr=1e-2, **kw))
            seen = []
            opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["fused"]))
            x, y = batches(1)[0]
            F.cross_entropy(dp(x), y).backward()
            opt.step()
            assert seen == [kw.get("fused")]


def test_close_stops_the_host_update_thread():
    data = batches(1)
    tr = cgdp.Trainer(mlp(), OPTIMIZERS["adamw"], ["cpu:0", "cpu:1"], chunks=1, update="host")
    tr.step(*data[0], F.cross_entropy)
    assert tr.stats["host_update_overlapped"] == 1.0
    assert any(t.name == "cgdp-host-update" for t in threading.enumerate())
    tr.close()  # tr still referenced: only close() can stop it
    assert not any(t.name == "cgdp-host-update" for t in threading.enumerate())


class _WritesThenRaises(torch.optim.AdamW):
    """An optimizer of the user's whose step raises once after it wrote parameters and state."""

    fail = False

    def step(self, closure=None):
        out = super().step(closure)
        if self.fail:
            self.fail = False
            raise ValueError("the step fails once")
        return out


@pytest.mark.parametrize("how", ["pre_hook", "post_hook", "optimizer"])
def test_a_step_raising_after_backward_changes_nothing_and_training_goes_on(how):
    """The update runs after backward (a step hook; clipping). Its step raises once, before or
    after it wrote the masters and the state: step() raises that error, no replica changed, and
    the Trainer goes on: skipping that batch, or doing it again, trains as one device does."""
    make = partial(_WritesThenRaises, lr=1e-2, weight_decay=0.1) if how == "optimizer" else OPTIMIZERS["adamw"]
    model, data = mlp(), batches(4)
    clip = dict(clip_grad_norm=1e9) if how == "optimizer" else {}  # after backward without a hook
    for redo in (False, True):
        kept = data if redo else [d for i, d in enumerate(data) if i != 1]
        ref, _ = reference(model, partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), kept, F.cross_entropy)
        with cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=2, update="host", **clip) as tr:
            opt, fail = tr.optimizers[0], [False]

            def hook(*_):
                if fail[0]:
                    fail[0] = False
                    raise ValueError("the step fails once")
            if how != "optimizer":
                getattr(opt, f"register_step_{how}")(hook)
            for i, (x, y) in enumerate(data):
                if i == 1:
                    fail[0] = opt.fail = True
                    before = [p.detach().clone() for p in tr.replicas[0].parameters()]
                    with pytest.raises(ValueError, match="fails once"):
                        tr.step(x, y, F.cross_entropy)
                    assert tr.stats["host_update_overlapped"] == 0.0
                    assert all(map(torch.equal, before, tr.replicas[0].parameters()))
                    assert_replicas_identical(tr)
                    if not redo:
                        continue
                tr.step(x, y, F.cross_entropy)
            assert {int(s["step"]) for s in opt.state.values()} == {len(kept)}
            assert_params_close(tr.replicas[0], ref)
            assert_replicas_identical(tr)


def test_memory_report_on_gpus_adds_what_the_allocator_holds(monkeypatch):
    """On GPUs each device also reports torch.cuda.memory_allocated of its own GPU, asked of the
    runtime cgdp's devices use. The simulated runtime has no allocator: the key is absent there,
    and a stand-in on its torch.cuda shows which GPU each device asks (untested on a real GPU)."""
    from cgdp.engine.backend.cuda_runtime import runtime
    from cgdp.testing import simulated_cuda
    with simulated_cuda(2, seed=1):
        with cgdp.Trainer(mlp(), OPTIMIZERS["adamw"], ["cuda:0", "cuda:1"], update="host", chunks=1) as tr:
            tr.step(*batches(1)[0], F.cross_entropy)
            report = tr.memory_report()
            assert "allocated" not in report["cuda:0"] and report["cuda:0"]["optimizer_state"] == 0
            asked = []
            monkeypatch.setattr(runtime().cuda, "memory_allocated", lambda d: asked.append(d) or 1000 + d.index,
                                raising=False)
            report = tr.memory_report()
    assert [report[d].get("allocated") for d in ("cuda:0", "cuda:1", "host")] == [1000, 1001, None]
    assert [d.index for d in asked] == [0, 1]  # the runtime's own device objects


def test_the_state_is_copied_aside_only_where_a_step_may_raise_after_writing():
    """A post-hook, a replaced or foreign step: copied aside; torch's own step, also under an LR
    scheduler's counter (every Trainer with a scheduler), or with a pre-hook only: not."""
    from cgdp.engine.core.host_state import may_write_then_raise
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    torch.optim.lr_scheduler.StepLR(opt, 1)
    pre = opt.register_step_pre_hook(lambda *_: None)
    assert not may_write_then_raise(opt)
    post = opt.register_step_post_hook(lambda *_: None)
    assert may_write_then_raise(opt)
    pre.remove(), post.remove()
    assert may_write_then_raise(_WritesThenRaises([torch.nn.Parameter(torch.zeros(2))]))
    opt.step = lambda: None
    assert may_write_then_raise(opt)


def _flat_adam_bitwise():
    """FlatAdam against torch's fused Adam/AdamW over several steps, bit for bit: tensors of odd sizes (torch's scalar
    tails), two groups, weight decay, maximize, 1 - beta1 above 0.5, a parameter skipped in a step, a discarded step."""
    import itertools
    from cgdp.engine.core.host_adam import FlatAdam, usable
    shapes = [(3,), (16,), (17,), (5, 7), (31,), (8,), (12,), (300, 3), (4,), (23,), (64, 65)]
    n = [math.prod(s) for s in shapes]
    offs = [0, *itertools.accumulate(n)][:-1]
    for nt, cls, kw in itertools.product((False, True), (torch.optim.AdamW, torch.optim.Adam), (
            dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2), dict(lr=3e-3, weight_decay=0.05, maximize=True),
            dict(lr=0.1, betas=(0.3, 0.99), eps=1e-3, weight_decay=0.2))):
        torch.manual_seed(0)
        ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        flat = torch.cat([p.detach().flatten() for p in ref])
        mine = [torch.nn.Parameter(flat[o:o + k].view(s)) for o, k, s in zip(offs, n, shapes)]
        opts = [cls([{"params": ps[:5]}, {"params": ps[5:], "lr": kw["lr"] * 3}], fused=True, **kw)
                for ps in (ref, mine)]
        assert usable(opts[1])
        fa = FlatAdam(opts[1], mine, offs, flat)
        fa.nt = nt  # non-temporal stores for runs of 256 aligned elements (the largest tensor has them)
        steps_bitwise(fa, opts[0], ref, flat, offs, (cls, kw))


def steps_bitwise(fs, opt, ref, flat, offs, what, steps=4):
    """``fs`` (flat state over views of ``flat``) against ``opt`` (torch's, over ``ref``) for ``steps`` steps: a
    parameter skipped in step 1, step 2 discarded once first; masters and state bitwise after each."""
    n = [p.numel() for p in ref]
    for s in range(steps):
        row = torch.randn(sum(n)) * 2
        live = [k for k in range(len(ref)) if s != 1 or k % 3]
        for k, p in enumerate(ref):
            p.grad = row[offs[k]:offs[k] + n[k]].view(p.shape).clone() if k in live else None
        opt.step()
        before = flat.clone()
        fs.sync()
        if s == 2:  # stepped, then discarded: the next try starts from the same state
            fs.step(live, [int(k >= 5) for k in live], row, offs)
            fs.discard()
            flat.copy_(before)
        fs.step(live, [int(k >= 5) for k in live], row, offs)
        fs.commit()
        assert all(torch.equal(a, b) for a, b in zip(fs.masters, ref)), (what, s)
        assert _states_equal(fs.opt.state_dict(), opt.state_dict()), (what, s)


def test_flat_adam_steps_bitwise_as_torch_fused():
    _flat_adam_bitwise()


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_flat_adam_steps_bitwise_as_torch_fused_on_other_cpu_capabilities(capability):
    """Each capability's build rounds differently (fused multiply-adds, vector width): the kernel follows it."""
    on_capability(capability, "test_host_update", "_flat_adam_bitwise")


def on_capability(capability: str, module: str, fn: str) -> None:
    """``module.fn()`` in a process on torch's CPU ``capability`` (ATEN_CPU_CAPABILITY)."""
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the CPU has no AVX2")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import {module} as t, torch; print(torch.backends.cpu.get_cpu_capability()); t.{fn}()"
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability,
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == capability.upper()


@pytest.mark.parametrize("make", [partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
                                  partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)],
                         ids=["adamw", "sgd_momentum"])
def test_flat_moments_step_as_torch_and_a_rejected_step_leaves_them_bitwise(make):
    """update='host' with the flat state (Adam's moments, SGD's momentum) against the same trainer stepping with
    torch's fused step (a chunk per optimizer call, the state copied aside): the same bits, through a NaN-rejected
    step, an lr change and a state_dict round trip; the rejected step leaves masters and state exactly as before, no
    warning."""
    torch.manual_seed(0)
    model, data = _FirstLayerPoisoned(), batches(6)
    trainers = [cgdp.Trainer(copy.deepcopy(model), make, ["cpu:0", "cpu:1"], chunks=2, update="host")
                for _ in range(2)]
    try:
        trainers[1]._update._flat = None  # torch's own step, chunk by chunk
        assert trainers[0]._update._flat is not None
        for i, (x, y) in enumerate(data):
            for tr in trainers:
                for r in tr.replicas:
                    r.poison = i == 2
                if i == 3:
                    tr.optimizers[0].param_groups[0]["lr"] = 3e-3
                if i == 4:
                    tr.load_state_dict(copy.deepcopy(tr.state_dict()))
                state = copy.deepcopy(tr.optimizers[0].state_dict())
                params = copy.deepcopy(tr.replicas[0].state_dict())
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    if i == 2:
                        with pytest.raises(cgdp.NonFiniteGradientError):
                            tr.step(x, y, F.cross_entropy)
                        assert _states_equal(tr.optimizers[0].state_dict(), state)
                        assert all(torch.equal(v, params[k]) for k, v in tr.replicas[0].state_dict().items())
                    else:
                        tr.step(x, y, F.cross_entropy)
                assert tr.stats["host_update_overlapped"] == 1.0
            a, b = (tr.replicas[0].state_dict() for tr in trainers)
            assert all(torch.equal(v, b[k]) for k, v in a.items()), i
            assert _states_equal(*(tr.optimizers[0].state_dict() for tr in trainers)), i
    finally:
        for tr in trainers:
            tr.close()


def test_the_flat_moments_only_where_they_match_torch_and_add_param_group_keeps_working():
    """amsgrad, foreach, another optimizer, a step of the user's keep torch's step (with the state copied aside); a
    group added later (fused unset) sends the next steps there too, and training goes on."""
    from cgdp.engine.core.host_adam import usable
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert usable(torch.optim.AdamW(p, fused=True)) and usable(torch.optim.Adam(p, fused=True, weight_decay=0.1))
    assert not usable(torch.optim.AdamW(p, fused=True, amsgrad=True))
    assert not usable(torch.optim.AdamW(p, foreach=True)) and not usable(torch.optim.SGD(p, lr=0.1, fused=True))
    own = torch.optim.AdamW(p, fused=True)
    own.step = lambda: None
    assert not usable(own)
    model, data = mlp(), batches(4)
    with cgdp.Trainer(copy.deepcopy(model), partial(torch.optim.AdamW, lr=1e-2, amsgrad=True), ["cpu:0", "cpu:1"],
                      chunks=2, update="host") as tr:
        tr.step(*data[0], F.cross_entropy)
        assert tr._update._flat is None and "max_exp_avg_sq" in next(iter(tr.optimizers[0].state.values()))
    with cgdp.Trainer(copy.deepcopy(model), OPTIMIZERS["adamw"], ["cpu:0", "cpu:1"], chunks=2, update="host") as tr:
        tr.step(*data[0], F.cross_entropy)
        assert tr._update._fast
        extra = torch.nn.Parameter(torch.zeros(2))
        tr.optimizers[0].add_param_group({"params": [extra]})
        for x, y in data[1:]:
            tr.step(x, y, F.cross_entropy)
            assert not tr._update._fast and tr.stats["host_update_overlapped"] == 1.0
        assert {int(s["step"]) for s in tr.optimizers[0].state.values()} == {4}
        assert_replicas_identical(tr)


@pytest.mark.parametrize("wire", [None, "bf16"])
def test_a_checkpoint_saved_right_after_a_failed_overlapped_step_holds_the_step_before(wire):
    """The failed step's chunk updates are finished and undone before its error reaches the caller: state_dict() in
    the except handler is the last applied step's, parameters and optimizer state alike."""
    torch.manual_seed(0)
    model, data = _FailsPartway(), batches(2)
    with cgdp.Trainer(model, partial(torch.optim.AdamW, lr=1e-2), ["cpu:0", "cpu:1"], chunks=1, update="host",
                      grad_transfer=wire) as tr:
        _Boom.fail = False
        tr.step(*data[0], F.cross_entropy)
        before = copy.deepcopy(tr.state_dict())
        _Boom.fail = True
        try:
            with pytest.raises(RuntimeError):
                tr.step(*data[1], F.cross_entropy)
            after = tr.state_dict()
        finally:
            _Boom.fail = False
        for k, v in after["model"].items():
            assert torch.equal(v, before["model"][k]), k
        for k, s in after["optimizer"]["state"].items():
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(s[name], before["optimizer"]["state"][k][name]), (k, name)


def test_a_scheduler_sees_the_host_optimizer_stepped():
    """The overlapped step may not call optimizer.step() (the flat moments): an LR scheduler still sees it stepped
    and says nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with cgdp.Trainer(mlp(), partial(torch.optim.AdamW, lr=1e-2), ["cpu:0", "cpu:1"], update="host",
                          scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1)) as tr:
            for x, y in batches(2):
                tr.step(x, y, F.cross_entropy)


@pytest.mark.parametrize("face", ["Trainer", "DataParallel"])
def test_parameters_that_are_not_contiguous_are_refused(face):
    """The masters are row-major: a channels_last convolution's weight would take its gradient in the wrong order."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten()).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="not contiguous|is not \\(strides"):
        if face == "Trainer":
            cgdp.Trainer(net, partial(torch.optim.SGD, lr=0.1), ["cpu:0", "cpu:1"], update="host")
        else:
            cgdp.DataParallel(net, ["cpu:0", "cpu:1"], update="host")
