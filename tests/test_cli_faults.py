"""The training and planning CLIs under faults and bad input: untrusted or damaged checkpoints, a
used --out, Ctrl-C, a full disk, bad data and bad settings. Each ends with a clear message and a
documented exit code (2 for what the user can fix), never a raw traceback, and loses nothing
that was saved."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cgdp.cli import checkpoint
from cgdp.cli.plan import main as plan_main
from cgdp.cli.train import main

ROOT = Path(__file__).resolve().parent.parent
BASE = ["--chunks", "1", "--progress", "off", "--plots", "false", "--profile_every", "0"]


def run(capsys, *args: str) -> tuple[int, str]:
    rc = main([*BASE, *args])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return rc, cap.out + cap.err


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ untrusted and damaged checkpoints
class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # what an attacker's pickle does when it is loaded
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("wrapped", [False, True])
def test_malicious_checkpoint_never_runs(tmp_path, capsys, wrapped):
    """A pickle whose loading would create a file: on --resume it is refused, never run. Also when
    it carries cgdp's header and a valid checksum (anyone can compute one)."""
    out, marker = tmp_path / "run", tmp_path / "pwned"
    out.mkdir()
    buf = tmp_path / "payload.pt"
    torch.save({"trainer": Payload(marker), "config": {}}, buf)
    data = buf.read_bytes()
    if wrapped:
        data = checkpoint.encode(data, {}) + data
    (out / "checkpoint.pt").write_bytes(data)
    rc, text = run(capsys, "--out", str(out), "--resume", "--steps", "4")
    assert rc == 2, text
    assert not marker.exists(), "the checkpoint's code ran"
    expect = "could run code" if wrapped else "not one written by cgdp.train"
    assert expect in text, text


def test_flipped_bit_and_truncation_are_caught(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, "--out", str(out), "--steps", "2")[0] == 0
    ck = out / "checkpoint.pt"
    good = ck.read_bytes()
    mid = len(good) // 2  # inside the model's weights
    for damaged in (good[:mid] + bytes([good[mid] ^ 0x04]) + good[mid + 1:], good[:-100]):
        ck.write_bytes(damaged)
        rc, text = run(capsys, "--out", str(out), "--resume", "--steps", "4")
        assert rc == 2 and "damaged: its SHA-256 checksum does not match" in text, text


def test_foreign_torch_file_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    torch.save({"weight": torch.ones(3)}, out / "checkpoint.pt")
    rc, text = run(capsys, "--out", str(out), "--resume")
    assert rc == 2 and "a torch file, but not one written by cgdp.train" in text, text


def test_checkpoint_holds_only_plain_data(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, "--out", str(out), "--steps", "2", "--chunks", "auto")[0] == 0
    raw = (out / "checkpoint.pt").read_bytes()
    payload = bytes(checkpoint.split(raw)[2])
    (tmp_path / "p.pt").write_bytes(payload)
    state = torch.load(tmp_path / "p.pt", weights_only=True)  # no allow-list needed
    assert set(state) == {"trainer", "rng", "loader", "config", "job"}


# ------------------------------------------------------------------ --out, --resume, Ctrl-C
def test_used_out_without_a_checkpoint_does_not_suggest_resume(tmp_path, capsys):
    """A run killed before its first checkpoint left metrics.jsonl only: --resume cannot help."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "config"}\n')
    rc, text = run(capsys, "--out", str(out), "--steps", "2")
    assert rc == 2 and "no checkpoint to continue from" in text and "--resume" not in text, text
    rc, text = run(capsys, "--out", str(out), "--resume", "--steps", "2")
    assert rc == 2 and "nothing to resume" in text and "--overwrite" in text, text
    assert run(capsys, "--out", str(out), "--overwrite", "--steps", "2")[0] == 0


def test_used_out_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, "--out", str(out), "--steps", "2", "--lr", "0.02", "--batch", "16")[0] == 0
    before = (out / "metrics.jsonl").read_text()
    rc, text = run(capsys, "--out", str(out), "--steps", "3")
    assert rc == 2 and "already holds a run" in text and "--overwrite" in text, text
    assert (out / "metrics.jsonl").read_text() == before
    # --resume alone takes the run's settings (lr, batch) from the checkpoint; steps may grow
    rc, text = run(capsys, "--out", str(out), "--resume", "--steps", "4")
    assert rc == 0, text
    config = [r for r in rows(out) if r["kind"] == "config"][-1]["config"]
    assert config["train"]["lr"] == 0.02 and config["train"]["batch"] == 16
    assert [r["step"] for r in rows(out) if r["kind"] == "step"] == [1, 2, 3, 4]
    rc, text = run(capsys, "--out", str(out), "--resume", "--steps", "5", "--lr", "0.5")
    assert rc == 2 and "train.lr: 0.02 -> 0.5" in text, text
    rc, text = run(capsys, "--out", str(out), "--steps", "2", "--overwrite")
    assert rc == 0, text
    assert [r["step"] for r in rows(out) if r["kind"] == "step"] == [1, 2]


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_lock_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path, capsys, link):
    """``OUT/.lock`` is written with the process id; planted as a link to a file elsewhere, it
    would empty and overwrite that file. The run is refused before anything is written."""
    out, target = tmp_path / "run", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("the user's data\n")
    (out / ".lock").symlink_to(target) if link == "symbolic" else os.link(target, out / ".lock")
    rc, text = run(capsys, "--out", str(out), "--steps", "2")
    assert rc == 2 and f"{out / '.lock'} is a {link} link" in text and "Remove" in text, text
    assert target.read_text() == "the user's data\n"
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing else was written


def test_metrics_planted_as_a_link_is_not_written_through(tmp_path, capsys):
    """metrics.jsonl is appended to, not replaced by a rename: a link there (here one that points
    nowhere yet, so --out looks unused) would create or empty a file elsewhere."""
    out, target = tmp_path / "run", tmp_path / "elsewhere.txt"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(target)
    rc, text = run(capsys, "--out", str(out), "--steps", "2")
    assert rc == 2 and "metrics.jsonl: it is a symbolic link" in text and "remove the link" in text, text
    assert not target.exists()


def test_an_out_holding_only_a_users_model_is_refused_without_overwrite(tmp_path, capsys):
    """A run writes OUT/model.pt at its end: a user's own model.pt there is not replaced unasked."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.pt").write_bytes(b"the user's pretrained weights")
    rc, text = run(capsys, "--out", str(out), "--steps", "2")
    assert rc == 2 and f"--out {out} holds a model.pt but no run" in text and "--overwrite" in text, text
    assert (out / "model.pt").read_bytes() == b"the user's pretrained weights"
    assert not (out / "metrics.jsonl").exists() and not (out / "config.toml").exists()
    assert run(capsys, "--out", str(out), "--steps", "2", "--overwrite")[0] == 0
    assert torch.load(out / "model.pt", weights_only=True)


def test_resume_after_a_crash_marks_the_repeated_steps(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(capsys, "--out", str(out), "--steps", "3")[0] == 0
    at3 = (out / "checkpoint.pt").read_bytes()
    assert run(capsys, "--out", str(out), "--resume", "--steps", "6")[0] == 0
    # a crash after step 6 whose last checkpoint was step 3, the last line cut mid-write
    (out / "checkpoint.pt").write_bytes(at3)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "step", "st')
    assert run(capsys, "--out", str(out), "--resume", "--steps", "7")[0] == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert lines[-1].startswith('{"kind": "final"')
    parsed = [json.loads(line) for line in lines if not line.startswith('{"kind": "step", "st')]
    marks = [r for r in parsed if r["kind"] == "resume"]
    assert marks[-1]["step"] == 3 and marks[-1]["superseded"] == [4, 6], marks
    assert "superseded by the lines below" in marks[-1]["note"]


CTRL_C = ["--steps", "100000", "--progress", "lines", "--log_every", "1", "--plots", "false", "--chunks", "1",
          "--profile_every", "0"]


def _interrupt(out: Path, while_running=lambda p: None) -> tuple[int, str]:
    """A real Ctrl-C (SIGINT) to a real training process once its first step line is written (and
    ``while_running(process)`` has run)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "cgdp.train", "--out", str(out), *CTRL_C], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").exists() or '"kind": "step"' not in (out / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and p.poll() is None, "training did not start"
            time.sleep(0.1)
        while_running(p)
        p.send_signal(signal.SIGINT)
        text, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    return p.returncode, text


@pytest.mark.slow  # a training process
def test_a_run_holds_its_out_and_ctrl_c_saves_a_checkpoint_then_resume_continues(tmp_path, capsys):
    """A real training process, interrupted by a real Ctrl-C. While it runs, a second run on the same
    --out (this test's process: a second process) is refused by the first one's lock (it was
    separated only by a few milliseconds' window before: both found --out empty); --overwrite does
    not override the lock. Once the first has ended, its --out resumes."""
    out = tmp_path / "run"
    refused = []

    def second_run(p):
        for extra in ([], ["--overwrite"]):
            rc, text = run(capsys, "--out", str(out), "--steps", "3", *extra)
            refused.append((rc, text))
            assert rc == 2 and f"--out {out} is in use by another cgdp.train run (process {p.pid})" in text, text
    rc, text = _interrupt(out, second_run)
    assert len(refused) == 2
    assert rc == 130, text
    assert "stopping after this step, saving a checkpoint" in text and "Traceback" not in text, text
    ck = checkpoint.load(out / "checkpoint.pt")
    done = ck["trainer"]["step"]
    assert done >= 1 and [r for r in rows(out) if r["kind"] == "stopped"][-1]["step"] == done
    rc, text = run(capsys, "--out", str(out), "--resume", "--steps", str(done + 2))
    assert rc == 0, text


def test_second_ctrl_c_stops_at_once_and_tells_the_truth(tmp_path, capsys, monkeypatch):
    """Two Ctrl-C right after the first step, before anything is saved: the second stops the run
    at once, and the message says no checkpoint exists. Both signals are raised in the training
    process's main thread by the step itself (signal.raise_signal runs the handler there and then),
    so they cannot merge into one or arrive after the save, as two signals 50 ms apart could."""
    import cgdp
    real_step = cgdp.Trainer.step

    def step(self, *args, **kwargs):
        loss = real_step(self, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # the first: finish this step, then stop
        signal.raise_signal(signal.SIGINT)  # the second: KeyboardInterrupt here, at once
        return loss
    monkeypatch.setattr(cgdp.Trainer, "step", step)
    rc, text = run(capsys, "--out", str(tmp_path / "run"), "--steps", "100000", "--chunks", "1")
    assert rc == 130, text
    assert "stopping after this step, saving a checkpoint" in text, text
    assert "interrupted; no checkpoint was saved (none had been written yet)" in text, text
    assert "Traceback" not in text, text


# ------------------------------------------------------------------ a full disk, Ctrl-C during a save
@pytest.mark.parametrize("fault", ["enospc", "ctrl-c"])
def test_failed_final_save_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch, fault):
    out = tmp_path / "run"
    assert run(capsys, "--out", str(out), "--steps", "2")[0] == 0

    real = os.fsync

    def broken(fd):  # the checkpoint's temporary file only (config.toml is written the same way)
        if ".checkpoint-" not in os.readlink(f"/proc/self/fd/{fd}"):
            return real(fd)
        if fault == "enospc":
            raise OSError(28, "No space left on device")
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint.os, "fsync", broken)
    rc, text = run(capsys, "--out", str(out), "--resume", "--steps", "4")
    monkeypatch.undo()
    if fault == "enospc":
        assert rc == 2 and "the disk is full" in text and "the previous checkpoint there is intact" in text, text
    else:
        assert rc == 130 and "the checkpoint at step 2" in text and "is intact" in text, text
    assert checkpoint.load(out / "checkpoint.pt")["trainer"]["step"] == 2
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------ bad data and bad settings
def _shards(d: Path, y: np.ndarray, x: np.ndarray | None = None) -> Path:
    d.mkdir()
    if x is None:
        x = np.random.default_rng(0).random((len(y), 1, 8, 8), dtype=np.float32)
    np.savez(d / "part.npz", x=x, y=y)
    return d


def test_labels_out_of_range(tmp_path, capsys):
    y = np.arange(200) % 10
    y[7] = 10 ** 6
    d = _shards(tmp_path / "stray", y)
    rc, text = run(capsys, "--dataset", "shards", "--shards", str(d), "--steps", "1")
    assert rc == 2 and "only 11 distinct labels occur: a 1000001-class output layer" in text, text
    rc, text = run(capsys, "--dataset", "shards", "--shards", str(d), "--steps", "1", "--num_classes", "10")
    assert rc == 2 and "num_classes = 10, but the data has labels up to 1000000; labels must be 0..9" in text, text
    y[7] = 2 ** 62
    d = _shards(tmp_path / "huge", y)
    rc, text = run(capsys, "--dataset", "shards", "--shards", str(d), "--steps", "1")
    assert rc == 2 and "labels go up to 4611686018427387904" in text, text


def test_nan_in_the_data_is_not_blamed_on_the_learning_rate(tmp_path, capsys):
    x = np.random.default_rng(0).random((200, 1, 8, 8), dtype=np.float32)
    x[::2, 0, 0, 0] = np.nan
    d = _shards(tmp_path / "nan", np.arange(200) % 10, x)
    rc, text = run(capsys, "--dataset", "shards", "--shards", str(d), "--steps", "2", "--batch", "8")
    assert rc == 2 and "the data is bad, not the learning rate" in text and "--lr" not in text, text
    rc, text = run(capsys, "--steps", "3", "--lr", "1e30")
    assert rc == 1 and "diverged" in text and "--lr is 1e+30" in text, text


@pytest.mark.parametrize("args, match", [
    (["--mode", "single", "--devices", "2"], "mode 'single' trains on one device"),
    (["--timeout_s", "inf"], "timeout_s must be a finite number"),
    (["--timeout_s", "nan"], "timeout_s must be a finite number"),
    (["--dataset", "synthetic", "--model", "alexnet", "--batch", "100000000"], "lower --batch"),
    (["--dataset", "synthetic", "--batch", "2000000000"], "lower --batch"),
    # the advice fits what was given: not "use --dataset synthetic" to a synthetic run
    (["--dataset", "synthetic", "--model", "alexnet", "--input_shape", "3,64,64"], "without --input_shape"),
    (["--model", "alexnet"], "(--dataset synthetic without --input_shape makes it)"),
])
def test_bad_settings_are_exit_code_2(capsys, args, match):
    t0 = time.monotonic()
    rc, text = run(capsys, *args)
    assert rc == 2 and match in text, text
    assert time.monotonic() - t0 < 60  # refused before anything large is built (a hang bound under load)


def test_object_array_npz_and_binary_config(tmp_path, capsys):
    d = tmp_path / "obj"
    d.mkdir()
    np.savez(d / "a.npz", x=np.array([1, 2, 3, 4], dtype=object), y=np.arange(4))
    rc, text = run(capsys, "--dataset", "shards", "--shards", str(d))
    assert rc == 2 and "numeric arrays only" in text, text
    cfg = tmp_path / "bin.toml"
    cfg.write_bytes(bytes(range(256)))
    rc, text = run(capsys, "--config", str(cfg))
    assert rc == 2 and "not a text file" in text, text


@pytest.mark.parametrize("args, match", [
    (["--chunks", "0"], "a chunk holds at least one layer"),
    (["--gpus", "-2"], "--gpus: must be an integer > 0"),
    (["--host-gbps", "0"], "--host-gbps: must be a number > 0"),
    (["--host-gbps", "nan"], "--host-gbps: must be a number > 0"),
    (["--network-gbps", "-5"], "--network-gbps: must be a number > 0"),
    (["--gpus", "100000"], "beyond what the planner models"),
    (["--model", "no/such.json"], "no such file"),
])
def test_plan_user_errors_are_one_line_and_exit_code_2(capsys, args, match):
    t0 = time.monotonic()
    try:
        rc = plan_main(args)
    except SystemExit as e:  # argparse's own exit, also code 2
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and match in err and "Traceback" not in err, err
    assert time.monotonic() - t0 < 60


def test_plan_reads_the_profile_lines_of_metrics_jsonl(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*BASE, "--out", str(out), "--steps", "4", "--profile_every", "2"]) == 0
    capsys.readouterr()
    assert plan_main(["--model", str(out / "metrics.jsonl"), "--hardware", "pcie3-4gpu", "--chunks", "1"]) == 0
    assert "model: " in capsys.readouterr().out
    assert plan_main(["--model", "resnet152", "--gpus", "2"]) == 0
    assert "156 layers (layers as in the paper's profile" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None or torch.cuda.is_available(), reason="no-GPU message")
def test_no_gpu_message_names_no_impossible_range():
    import cgdp
    with pytest.raises(ValueError) as e:
        cgdp.Trainer(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), ["cuda:0"])
    assert "cuda:-1" not in str(e.value) and "cpu:N" in str(e.value)


# ------------------------------------------------------------------ careless flags, what is offered after a failure
@pytest.mark.parametrize("flag, value", [("--lr", "inf"), ("--lr", "-inf"), ("--momentum", "inf"),
                                         ("--weight_decay", "nan")])
def test_non_finite_hyperparameters_are_refused(capsys, flag, value):
    rc, text = run(capsys, flag, value, "--steps", "1")
    assert rc == 2 and f"train.{flag[2:]} must be " in text and "and finite; got" in text, text


def test_a_failed_first_save_does_not_offer_resume(tmp_path, capsys, monkeypatch):
    real = os.fsync

    def full(fd):
        if ".checkpoint-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(28, "No space left on device")
        return real(fd)
    monkeypatch.setattr(checkpoint.os, "fsync", full)
    rc, text = run(capsys, "--out", str(tmp_path / "run"), "--steps", "2")
    assert rc == 2 and "no checkpoint was written" in text and "--resume" not in text, text
    assert "start the run again (with --overwrite)" in text, text


def test_a_stopped_run_without_out_does_not_offer_resume(capsys, monkeypatch):
    """Ctrl-C (a real SIGINT, before the first step ends) without --out: no checkpoint exists, and
    neither the first message nor the last promises or offers one."""
    import cgdp.cli.train as cli

    real = cli.GracefulStop.__enter__

    def enter(self):
        real(self)
        signal.raise_signal(signal.SIGINT)  # the handler runs in this (the main) thread, now
        assert self.requested
        return self
    monkeypatch.setattr(cli.GracefulStop, "__enter__", enter)
    rc, text = run(capsys, "--steps", "5")
    assert rc == 130 and "interrupted after 1 steps" in text and "--resume" not in text, text
    assert "nothing is saved: this run has no --out" in text and "saving a checkpoint" not in text, text


def test_ctrl_c_after_the_rename_reports_the_checkpoint_on_disk(tmp_path, capsys, monkeypatch):
    """The second Ctrl-C lands in a save after its rename: the message must name the step the file
    holds (it named the one before)."""
    calls = []

    def interrupted(d):
        calls.append(d)
        if len(calls) == 2:  # the save of step 2: renamed, then Ctrl-C
            raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "_fsync_dir", interrupted)
    out = tmp_path / "run"
    rc, text = run(capsys, "--out", str(out), "--steps", "4", "--checkpoint_every", "1")
    assert rc == 130, text
    held = checkpoint.load(out / "checkpoint.pt")["trainer"]["step"]
    assert held == 2 and "the checkpoint at step 2" in text, text


# ------------------------------------------------------------------ a first run that never dies silently
def test_a_run_that_cannot_fit_in_memory_is_refused_with_the_numbers(capsys):
    """64 emulated VGG-16 replicas need hundreds of GiB: refused at once, before anything is built."""
    t0 = time.monotonic()
    rc, text = run(capsys, "--config", "vgg16", "--devices", "64", "--print-config")
    assert rc == 2 and "GiB of host memory" in text and "GiB is available" in text, text
    assert "64 replica(s) x (0.52 GiB parameters" in text and "use fewer devices" in text, text
    if not torch.cuda.is_available():
        assert "--devices 64 means 64 CPU-emulated device(s)" in text, text
    assert time.monotonic() - t0 < 60  # before 64 replicas exist (building them takes minutes)


def test_the_documented_vgg16_command_on_a_small_machine(capsys, monkeypatch):
    """docs/train.md's `--config vgg16 --devices 4` on a machine with 12 GiB available: refused with
    a batch that fits; the default job fits. Without a GPU, the GPU preset that fits says before it
    starts that its steps take minutes (it started hours of work without a word); the default job
    does not."""
    from cgdp.cli import memory
    monkeypatch.setattr(memory, "available_host", lambda: 12.0 * 2**30)
    monkeypatch.setattr(memory, "gpu_free", lambda devices: None)
    rc, text = run(capsys, "--config", "vgg16", "--devices", "4", "--print-config")
    assert rc == 2 and "and 12.0 GiB is available" in text and "lower --batch to " in text, text
    fit = int(text.split("lower --batch to ")[1].split()[0])
    assert 1 <= fit < 32
    rc, text = run(capsys, "--config", "vgg16", "--devices", "4", "--batch", str(fit), "--print-config")
    assert rc == 0, text
    slow = "note: vgg16 (138.4 M parameters"
    if not torch.cuda.is_available():
        assert slow in text and "one step can take minutes" in text and "--steps 3 --batch 2" in text, text
    rc, text = run(capsys, "--print-config")
    assert rc == 0 and "one step can take minutes" not in text, text


def test_the_gpu_preset_note_gives_only_advice_not_yet_followed():
    from cgdp.cli.memory import time_note
    cpu = ["cpu:0", "cpu:1"]
    note = lambda batch, steps: time_note("vgg16", 138_000_000, cpu, batch, 2 * batch, steps)  # noqa: E731
    assert note(32, 300).endswith("300 steps hours (the ETA follows the first step). For a quick look, pass "
                                  "--steps 3 --batch 2")
    assert note(32, 3).endswith("For a quick look, pass --batch 2") and "steps hours" not in note(32, 3)
    assert note(2, 300).endswith("For a quick look, pass --steps 3")
    assert note(2, 3).endswith("one step can take minutes (the ETA follows the first step)")  # as advised
    assert time_note("vgg16", 138_000_000, ["cuda:0"], 2, 2, 3) is None


def test_no_gpu_note_for_a_device_count(capsys):
    if torch.cuda.is_available():
        pytest.skip("the note is for machines without a GPU")
    rc, text = run(capsys, "--devices", "3", "--print-config")
    assert rc == 0 and "--devices 3 runs 3 CPU-emulated device(s)" in text, text


# ------------------------------------------------------------------ the run's summary and plots
def test_a_short_run_has_table_4_and_a_resumed_plot_starts_at_step_1(tmp_path, capsys, monkeypatch):
    from cgdp.cli import report
    out = tmp_path / "run"
    plotted = []
    monkeypatch.setattr(report, "write_plots", lambda o, rows, profile: plotted.append(rows) or "plotted")
    rc, _ = run(capsys, "--out", str(out), "--steps", "3", "--profile_every", "50", "--plots", "true",
                "--stop_after", "2")
    assert rc == 0
    assert "Per chunk (send order" in (out / "summary.md").read_text()  # 2 steps, profile_every 50
    rc, _ = run(capsys, "--out", str(out), "--resume", "--plots", "true", "--profile_every", "50")
    assert rc == 0
    assert [r["step"] for r in plotted[-1]] == [1, 2, 3]  # the resumed run's curve from step 1
    assert "Per chunk (send order" in (out / "summary.md").read_text()


def test_the_memory_estimate_on_gpus_counts_each_gpu():
    """On GPUs the replica, its gradients, optimizer state and activations are each GPU's; the host
    keeps its buffers and the data. (A pure estimate: no GPU needed.)"""
    from cgdp.cli import memory
    p, act, top = 2 * 2**30, 100 * 2**20, 10 * 2**20  # 2 GiB of parameters, 120 MiB per sample
    est = memory.estimate((p, act, top, 2), devices=4, emulated=False, mode="cgdp", batch=64,
                          input_bytes=600_000, global_batch=256, prefetch=2, eval_samples=256)
    assert est.device_bytes() == 4 * p + 64 * (act + 2 * top)
    assert est.host_bytes() == 5 * p + 4 * 256 * 600_000 + 256 * (600_000 + 2 * top)
    text = memory.check(est, host=64 * 2**30, gpu_free=[40 * 2**30, 12 * 2**30], device_flag="4")
    assert "GiB per GPU, and the fullest GPU has 12.0 GiB free" in text and "lower --batch to 34 or less" in text, text  # (12 - 8) GiB / 120 MiB
    assert "CPU-emulated" not in text
    assert memory.check(est, host=64 * 2**30, gpu_free=[40 * 2**30] * 4) is None


def test_a_run_in_typical_mode_has_no_table_of_zeros(tmp_path, capsys):
    """Mode typical sends no chunk through the host: no per-chunk table (its cells were all 0.000),
    a line that says why instead."""
    out = tmp_path / "typical"
    rc, _ = run(capsys, "--out", str(out), "--steps", "3", "--mode", "typical", "--profile_every", "1")
    assert rc == 0
    summary = (out / "summary.md").read_text()
    assert "Per chunk (send order" not in summary, summary
    assert "mode 'typical' has no per-chunk host transfers" in summary, summary
