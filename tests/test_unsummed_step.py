"""``optimizer.step()`` on gradients that were never summed is refused with a sentence, never applied.

Inside ``model.no_sync()`` each replica keeps its own part of the gradient; one device holds their
sum. A step taken there would move every replica by a different part (as DDP's ranks step on
their local gradients): the replicas would part ways silently. cgdp refuses it, whatever led to
it: a backward inside ``no_sync()`` alone, or forwards run inside it and one backward outside
(without ``sync_in_backward()``, Accelerate's ``trigger_sync_in_backward``), through the plain
model or Accelerate's integration. The gradients stay as they were: the next synced backward completes
them and the step is then exact.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import cgdp
from helpers import assert_params_close, mlp

DEVICES = ["cpu:0", "cpu:1"]


def data(n=3, size=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 12, generator=g), torch.randint(0, 5, (size,), generator=g)) for _ in range(n)]


def test_a_step_after_a_backward_inside_no_sync_is_refused_then_completed():
    (x1, y1), (x2, y2), _ = data()
    net, ref = mlp(), mlp()
    with cgdp.DataParallel(net, DEVICES) as model:
        opt = model.bind(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        before = [p.detach().clone() for p in net.parameters()]
        with model.no_sync():
            F.cross_entropy(model(x1), y1.to(model.output_device)).backward()
        with pytest.raises(RuntimeError, match=r"inside model\.no_sync\(\).*never summed.*outside no_sync"):
            opt.step()
        for p, q in zip(net.parameters(), before):  # nothing applied, on any replica
            assert torch.equal(p, q)
        for r in model.replicas[1:]:
            for p, q in zip(r.parameters(), before):
                assert torch.equal(p.cpu(), q)
        # the next synced backward completes the accumulation: the step is then one device's
        F.cross_entropy(model(x2), y2.to(model.output_device)).backward()
        opt.step()
        replicas = [copy.deepcopy(r).cpu() for r in model.replicas]
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(ref(x1), y1).backward()
    F.cross_entropy(ref(x2), y2).backward()
    ropt.step()
    for r in replicas:
        assert_params_close(r, ref)


def test_forwards_inside_no_sync_and_one_backward_outside_are_refused():
    """The forward decides: a graph recorded inside no_sync() accumulates, wherever its backward runs."""
    (x1, y1), (x2, y2), _ = data()
    with cgdp.DataParallel(mlp(), DEVICES) as model:
        opt = model.bind(torch.optim.SGD(model.parameters(), lr=0.1))
        with model.no_sync():
            losses = [F.cross_entropy(model(x), y.to(model.output_device)) for x, y in ((x1, y1), (x2, y2))]
        torch.stack(losses).mean().backward()
        with pytest.raises(RuntimeError, match=r"inside model\.no_sync\(\)"):
            opt.step()


def test_update_host_refuses_it_too():
    (x1, y1), _, _ = data()
    with cgdp.DataParallel(mlp(), DEVICES, update="host") as model:
        opt = model.bind(torch.optim.AdamW(model.parameters(), lr=1e-2))
        with model.no_sync():
            F.cross_entropy(model(x1), y1.to(model.output_device)).backward()
        with pytest.raises(RuntimeError, match=r"no_sync\(\)"):
            opt.step()


def test_accelerate_forwards_under_no_sync_without_trigger_are_refused():
    """Several forwards under Accelerate's ``no_sync``, then one backward outside it without
    ``trigger_sync_in_backward`` (which sums it: tests/test_accelerate.py): the gradients stay in
    parts, refused at the step, never stepped apart."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from cgdp.integrations.accelerate import Accelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        acc = Accelerator(cpu=True)
        net = mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model, opt = acc.prepare(net, opt)
        before = [p.detach().clone() for p in net.parameters()]
        losses = []
        for x, y in data(2):
            with acc.no_sync(model):
                losses.append(F.cross_entropy(model(x), y.to(acc.device)))
        acc.backward(torch.stack(losses).mean())
        with pytest.raises(RuntimeError, match=r"no_sync\(\)"):
            opt.step()
        for p, q in zip(net.parameters(), before):
            assert torch.equal(p, q)
        acc.free_memory()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        del accelerate


def test_sync_in_backward_completes_forwards_run_inside_no_sync():
    """Forwards inside no_sync(), one backward inside sync_in_backward() (what Accelerate's
    trigger_sync_in_backward enters): summed, the step is one device's on every replica."""
    batches = data()
    net, ref = mlp(), mlp()
    with cgdp.DataParallel(net, DEVICES) as model:
        opt = model.bind(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        with model.no_sync():
            losses = [F.cross_entropy(model(x), y.to(model.output_device)) for x, y in batches]
        with model.sync_in_backward():
            torch.stack(losses).mean().backward()
        opt.step()
        replicas = [copy.deepcopy(r).cpu() for r in model.replicas]
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    torch.stack([F.cross_entropy(ref(x), y) for x, y in batches]).mean().backward()
    ropt.step()
    for r in replicas:
        assert_params_close(r, ref)
