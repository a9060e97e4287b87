"""``memory_report()`` of both faces on emulated devices: bytes from the tensors themselves."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import cgdp
from cgdp.testing import inside
from helpers import mlp

DEVS = ["cpu:0", "cpu:1"]
ADAMW = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
KEYS = {"parameters", "gradients", "optimizer_state", "transfer"}


def nparams(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("update", ["devices", "host"])
def test_trainer_report_counts_what_each_place_holds(update):
    model = mlp()
    n = nparams(model)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    with cgdp.Trainer(copy.deepcopy(model), ADAMW, DEVS, update=update, grad_transfer="bf16") as tr:
        before = tr.memory_report()
        tr.step(x, y, F.cross_entropy)
        rep = tr.memory_report()
        assert set(rep) == {*DEVS, "host"} and all(set(v) == KEYS for v in rep.values())
        flat = inside(tr).stream.flats[0]
        for d in DEVS:
            assert rep[d]["parameters"] == 4 * n
            assert rep[d]["gradients"] == flat.numel() * 4  # the flat buffer; .grad are views into it
            assert rep[d]["transfer"] == flat.numel() * 2  # the bf16 stage
            # AdamW: two float32 moments per element (and a step counter per parameter)
            want = 0 if update == "host" else 8 * n
            assert want <= rep[d]["optimizer_state"] <= want + (0 if update == "host" else 8 * len(list(model.parameters())))
        wire = 2 * n if update == "host" else 0  # with update="host", the masters' bf16 rounding sent back
        assert rep["host"]["transfer"] == inside(tr).stream.host.registered_bytes + wire > wire
        if update == "host":
            assert rep["host"]["parameters"] == 4 * n
            # fused AdamW's moments flat in two sides on the host (host_adam.FlatAdam), both counted from the start
            assert 16 * n <= rep["host"]["optimizer_state"] <= 16 * n + 8 * len(list(model.parameters()))
            assert before["host"]["optimizer_state"] == 16 * n
        else:
            assert rep["host"]["parameters"] == rep["host"]["optimizer_state"] == 0


def test_dataparallel_report_counts_mirrors_and_host_state():
    model = mlp()
    n = nparams(model)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    for update in ("devices", "host"):
        with cgdp.DataParallel(copy.deepcopy(model), DEVS, update=update) as dp:
            opt = dp.bind(ADAMW(dp.parameters()))
            F.cross_entropy(dp(x), y).backward()
            opt.step()
            rep = dp.memory_report()
            for d in DEVS:
                assert rep[d]["parameters"] == 4 * n
                assert rep[d]["optimizer_state"] >= (0 if update == "host" else 8 * n)
                assert rep[d]["optimizer_state"] == 0 or update == "devices"
            assert (rep["host"]["optimizer_state"] >= 8 * n) == (update == "host")
            assert rep["host"]["transfer"] > 0
