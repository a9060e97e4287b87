"""Checkpoints: a save that dies at any point leaves the previous checkpoint loadable, and a run
resumed from a checkpoint is bitwise identical to one that was never interrupted."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from cgdp.cli import checkpoint
from cgdp.cli.train import main


def _tmp_files(d):
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_roundtrip_and_rng_state(tmp_path):
    path = tmp_path / "ck.pt"
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    checkpoint.save({"w": torch.arange(5.0), "rng": checkpoint.rng_state()}, path)
    a = (torch.rand(3), np.random.rand(3), random.random())
    ck = checkpoint.load(path)
    assert torch.equal(ck["w"], torch.arange(5.0))
    checkpoint.set_rng_state(ck["rng"])
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    assert _tmp_files(tmp_path) == []


@pytest.mark.parametrize("where", ["write", "rename"])
def test_failure_mid_save_keeps_old(tmp_path, monkeypatch, where):
    path = tmp_path / "ck.pt"
    checkpoint.save({"step": 1}, path)
    if where == "write":
        def full(fd):  # the bytes are written, the flush to disk fails as on a full disk
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(os, "fsync", full)
        match = "the disk is full .*; the previous checkpoint there is intact"
    else:
        def no_rename(src, dst):
            raise OSError(5, "injected failure between write and rename")
        monkeypatch.setattr(os, "replace", no_rename)
        match = "injected failure"
    with pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.save({"step": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1
    assert _tmp_files(tmp_path) == []


CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from cgdp.cli import checkpoint
    where, path = sys.argv[1], sys.argv[2]
    if where == "write":
        def slow_fsync(fd):  # the temporary file is written, not yet on disk
            print("SAVING", flush=True); time.sleep(60)
        os.fsync = slow_fsync
        state = {"step": 2, "big": torch.ones(1 << 20)}
    if where == "rename":
        real = os.replace
        def slow_replace(a, b):  # the temporary file is complete and fsynced, not yet renamed
            print("SAVING", flush=True); time.sleep(60); real(a, b)
        os.replace = slow_replace
        state = {"step": 2, "big": torch.ones(1 << 20)}
    checkpoint.save(state, path)
""")


@pytest.mark.slow  # a process each
@pytest.mark.parametrize("where", ["write", "rename"])
def test_killed_save_leaves_old_loadable(tmp_path, where):
    path = tmp_path / "ck.pt"
    checkpoint.save({"step": 1, "big": torch.zeros(1 << 20)}, path)
    p = subprocess.Popen([sys.executable, "-c", CHILD, where, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "SAVING"
    finally:
        p.kill()  # SIGKILL: no cleanup handler runs, as in a crash or an OOM kill
        p.wait()
    ck = checkpoint.load(path)
    assert ck["step"] == 1 and torch.equal(ck["big"], torch.zeros(1 << 20))
    assert len(_tmp_files(tmp_path)) == 1  # the dead save's leftover...
    checkpoint.save({"step": 3}, path)
    assert _tmp_files(tmp_path) == [] and checkpoint.load(path)["step"] == 3  # ...is cleared by the next


def test_unreadable_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "ck.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read"):
        checkpoint.load(bad)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.load(tmp_path / "none.pt")


def _losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "step"], rows


def test_resume_is_bitwise_identical(tmp_path, capsys):
    # chunks = auto: the tuner's state travels in the checkpoint, and the two runs may settle on
    # different plans (its choice depends on timings); the arithmetic must not depend on the plan
    common = ["--steps", "24", "--progress", "off", "--plots", "false", "--profile_every", "5"]
    assert main(common + ["--out", str(tmp_path / "a")]) == 0
    assert main(common + ["--out", str(tmp_path / "b"), "--stop_after", "10"]) == 0
    mid = checkpoint.load(tmp_path / "b" / "checkpoint.pt")
    assert mid["trainer"]["step"] == 10 and mid["loader"]["pos"] == 10
    assert mid["trainer"]["tuner"] is not None  # the tuner's state travels too
    assert main(common + ["--out", str(tmp_path / "b"), "--resume"]) == 0
    capsys.readouterr()
    a = checkpoint.load(tmp_path / "a" / "checkpoint.pt")["trainer"]
    b = checkpoint.load(tmp_path / "b" / "checkpoint.pt")["trainer"]
    assert a["step"] == b["step"] == 24
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    la, rows_a = _losses(tmp_path / "a")
    lb, rows_b = _losses(tmp_path / "b")
    assert la == lb and len(la) == 24
    assert rows_a[-1]["eval_accuracy"] == rows_b[-1]["eval_accuracy"]
    kinds = [r["kind"] for r in rows_b if r["kind"] not in ("step", "profile")]
    assert kinds == ["config", "stopped", "resume", "config", "final"]


def test_resume_with_other_settings_is_refused(tmp_path, capsys):
    out = str(tmp_path / "r")
    base = ["--steps", "4", "--chunks", "1", "--progress", "off", "--plots", "false", "--out", out]
    assert main(base) == 0
    capsys.readouterr()
    assert main(base + ["--resume", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "train.lr: 0.05 -> 0.5" in err and "Traceback" not in err
    assert main(base + ["--resume"]) == 2
    assert "nothing to do" in capsys.readouterr().err


def test_out_leaves_the_trained_model_where_pytorch_users_look(tmp_path, capsys):
    """``--out`` writes ``model.pt``, a plain state_dict that ``torch.load(weights_only=True)`` reads into
    the user's own model (it scores the run's final eval accuracy), prints its path, and
    ``cgdp.load_checkpoint`` reads the checkpoint (its ``"model"`` is the same state_dict)."""
    import cgdp
    from cgdp.data import digits, eval_batches
    from cgdp.models import build_model

    out = tmp_path / "run"
    assert main(["--steps", "6", "--chunks", "1", "--progress", "off", "--plots", "false", "--profile_every", "0",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"trained model: {out / 'model.pt'}" in printed, printed
    state = torch.load(out / "model.pt", weights_only=True)
    net = build_model("digits_cnn", 10, (1, 8, 8))
    net.load_state_dict(state)
    net.eval()
    test = digits("test")
    with torch.no_grad():
        correct = sum(int((net(x).argmax(1) == y).sum()) for x, y in eval_batches(test, 512))
    final = _losses(out)[1][-1]
    assert correct / len(test) == final["eval_accuracy"]

    for where in (out, out / "checkpoint.pt"):
        ck = cgdp.load_checkpoint(where)
        assert ck["step"] == 6 and ck["config"]["train"]["steps"] == 6
        assert list(ck["model"]) == list(state) and all(torch.equal(ck["model"][k], state[k]) for k in state)
    with pytest.raises(checkpoint.CheckpointError, match=r"plain torch file.*torch.load\(path, weights_only=True\)"):
        cgdp.load_checkpoint(out / "model.pt")
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        cgdp.load_checkpoint(tmp_path / "nothing")
