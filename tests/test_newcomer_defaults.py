"""What a newcomer gets from the defaults: ``cgdp.DataParallel(net)`` without a GPU runs two
CPU-emulated devices and says so once; a step slower than ``timeout_s`` leaves the trainer
unusable for good, with a message saying what to do, as the README states."""
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.engine.backend.cuda import cuda_count
from cgdp.engine.dataparallel import dataparallel as dp_module
from helpers import mlp

SGD = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731


@pytest.mark.skipif(cuda_count() > 0, reason="the rule for a machine without a GPU")
def test_dataparallel_without_a_gpu_runs_two_emulated_devices_and_says_so_once(monkeypatch):
    monkeypatch.setattr(dp_module, "_SAID_EMULATED", [False])  # once per process: as in a fresh one
    with pytest.warns(UserWarning, match=r"found no GPU and runs on 2 CPU-emulated devices \(cpu:0, cpu:1\)"):
        with cgdp.DataParallel(mlp()) as model:
            assert model.devices == ["cpu:0", "cpu:1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with cgdp.DataParallel(mlp()):  # said once
            pass
        monkeypatch.setattr(dp_module, "_SAID_EMULATED", [False])
        with cgdp.DataParallel(mlp(), ["cpu:0", "cpu:1"]):  # chosen: nothing to say
            pass


GATE: dict = {}


class SlowOnDevice1(nn.Module):
    """Replica 1's forward waits for ``GATE["release"]`` while ``GATE["armed"]``."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        if GATE["armed"] and threading.current_thread().name == "cgdp-cpu:1":
            GATE["release"].wait(60)
            GATE["left"].set()
        return self.fc(x)


def test_a_step_slower_than_timeout_s_leaves_the_trainer_unusable_for_good():
    GATE.update(armed=True, release=threading.Event(), left=threading.Event())
    model = SlowOnDevice1()
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    tr = cgdp.Trainer(model, SGD, ["cpu:0", "cpu:1"], timeout_s=0.5)
    try:
        with pytest.raises(TimeoutError, match="raise timeout_s if a step can really take that long"):
            tr.step(x, y, F.cross_entropy)
    finally:
        GATE["release"].set()  # the slow step ends after all
    assert GATE["left"].wait(30)
    GATE["armed"] = False
    with pytest.raises(RuntimeError, match=r"cannot continue: .*create a new Trainer \(load a checkpoint into it\)"):
        tr.step(x, y, F.cross_entropy)
    tr.close()
    with cgdp.Trainer(model, SGD, ["cpu:0", "cpu:1"]) as again:  # the documented way on
        again.step(x, y, F.cross_entropy)
