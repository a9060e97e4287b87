"""Device threads take turns when there are more devices than cores: at most ``at_once`` compute
at a time, the results do not change by a bit, and a thread stuck in its turn is the only one a
timeout names."""
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import cgdp
from cgdp.engine.backend import make_devices
from cgdp.engine.core import threads as threads_mod
from cgdp.engine.core.threads import DeviceThreads, default_at_once
from cgdp.engine.sync import Guard
from helpers import assert_replicas_identical, mlp
from test_host_path import Net, bits, loss_fn, same
from cgdp.testing import inside


def test_default_turns_follow_the_cores(monkeypatch):
    for cores, devices, at_once in ((2, 2, 2), (2, 4, 1), (2, 8, 1), (1, 2, 1), (4, 8, 3), (16, 8, 8)):
        monkeypatch.setattr(threads_mod, "usable_cores", lambda: cores)
        assert default_at_once(devices) == at_once, (cores, devices)


@pytest.mark.parametrize("at_once", [1, 2, 4])
def test_at_most_at_once_threads_compute(at_once):
    guard = Guard(30.0)
    devs = make_devices([f"cpu:{j}" for j in range(4)], guard.fail)
    th = DeviceThreads(devs, guard, at_once=at_once)
    inside, most, want, met = [0], [0], [at_once], [False]
    cond = threading.Condition()

    def work(j):
        # each thread stays in its turn until `want` threads were inside together once (bounded):
        # the overlap the turns allow happens on a loaded machine too, without a sleep to collide in
        with cond:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            met[0] = met[0] or inside[0] >= want[0]
            cond.notify_all()
            cond.wait_for(lambda: met[0], timeout=30)
            inside[0] -= 1
        return j

    try:
        assert th.run_all(work, computing=True) == [0, 1, 2, 3]
        assert most[0] == at_once
        most[0], want[0], met[0] = 0, 4, False
        th.run_all(work)  # not a computing phase: every thread at once
        assert most[0] == 4
    finally:
        th.close()
        for d in devs:
            d.close()


def train(cores, monkeypatch, devices=3, **kw):
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: cores)
    g = torch.Generator().manual_seed(1)
    with cgdp.Trainer(Net(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                      [f"cpu:{i}" for i in range(devices)], chunks=1, **kw) as tr:
        assert inside(tr).threads.at_once == min(devices, default_at_once(devices))
        for _ in range(3):
            tr.step((torch.randn(9, 160, generator=g), torch.randint(0, 8, (9,), generator=g)), loss_fn)
            assert_replicas_identical(tr)
        r = tr.replicas[-1]
        return bits(r.parameters()) + bits(p.grad for p in r.parameters() if p.grad is not None)


def test_turns_change_no_bit(monkeypatch):
    free = train(64, monkeypatch)  # every device thread at once
    assert same(free, train(1, monkeypatch))  # one at a time
    assert same(train(64, monkeypatch, micro_batches=2), train(1, monkeypatch, micro_batches=2))
    assert same(train(64, monkeypatch, host_memory=1 << 16, segment_bytes=4096),
                train(1, monkeypatch, host_memory=1 << 16, segment_bytes=4096))


def test_dataparallel_forward_takes_turns_and_stays_exact(monkeypatch):
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: 1)
    torch.manual_seed(0)
    net = mlp()
    ref = mlp()
    ref.load_state_dict(net.state_dict())
    model = cgdp.DataParallel(net, ["cpu:0", "cpu:1", "cpu:2"])
    assert inside(model).threads.at_once == 1
    x, y = torch.randn(7, 12), torch.randint(0, 5, (7,))
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


STALL = {"armed": False, "release": threading.Event()}


class Stall(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        if STALL["armed"] and threading.current_thread().name == "cgdp-cpu:1":
            STALL["release"].wait(60)
        return self.net(x)


def test_a_thread_stuck_in_its_turn_is_the_only_one_named(monkeypatch):
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: 1)
    STALL.update(armed=True, release=threading.Event())
    tr = cgdp.Trainer(Stall(), lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1", "cpu:2"], timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"the device thread\(s\) of cpu:1 did not finish"):
            tr.step(torch.randn(6, 12), torch.randint(0, 5, (6,)), F.cross_entropy)
        assert time.monotonic() - t0 < 30  # timeout_s ended it, long before the 60 s stall
        assert inside(tr).threads.stuck == ["cpu:1"]
    finally:
        STALL["release"].set()
        STALL["armed"] = False
        tr.close()
