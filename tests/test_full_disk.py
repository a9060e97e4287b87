"""A full disk outside a checkpoint save: metrics.jsonl filling up mid-run, config.toml or the
resume's first lines on a disk that is already full. Each ends with a one-line message and exit
code 2, and loses nothing: the earlier metrics lines, config.toml and the last checkpoint stay.

The disk is real: a small tmpfs mounted for the test (skipped where mounting is not allowed,
i.e. not root). The file-size limit (RLIMIT_FSIZE, in a child process) gives the same error path
everywhere.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from cgdp.cli import checkpoint
from cgdp.cli.train import main

ROOT = Path(__file__).resolve().parent.parent
BASE = ["--chunks", "1", "--progress", "off", "--plots", "false", "--profile_every", "0"]


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill ``disk`` but ``leave`` bytes (whole 4 KiB pages)."""
    filler = disk / f"filler-{uuid.uuid4().hex}"
    st = os.statvfs(disk)
    size = st.f_bavail * st.f_frsize - leave
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * max(size, 0))
        except OSError:
            pass
    return filler


def run(capsys, *args: str) -> tuple[int, str]:
    rc = main([*BASE, *args])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    err = [line for line in cap.err.splitlines() if line.strip()]
    if rc == 2:
        assert len(err) == 1 and err[0].startswith("cgdp.train: error: "), cap.err
    return rc, cap.out + cap.err


def snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def test_metrics_filling_the_disk_mid_run(small_disk, capsys):
    out = small_disk / "run"
    fill(small_disk, leave=24 << 10)
    rc, text = run(capsys, "--out", str(out), "--steps", "300", "--checkpoint_every", "1000")
    assert rc == 2 and f"cannot write {out}/metrics.jsonl: the disk is full" in text, text
    assert "no checkpoint has been written yet" in text, text
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[:-1]]  # the last line may be cut
    assert rows[0]["kind"] == "config" and [r["step"] for r in rows if r["kind"] == "step"][:3] == [1, 2, 3]
    assert (out / "config.toml").read_text().startswith("[model]")


def test_resume_onto_a_full_disk_changes_nothing(small_disk, capsys):
    out = small_disk / "run"
    assert run(capsys, "--out", str(out), "--steps", "3")[0] == 0
    before = snapshot(out)
    filler = fill(small_disk)
    rc, text = run(capsys, "--out", str(out), "--resume", "--steps", "6")
    assert rc == 2 and "config.toml: the disk is full" in text and "nothing was changed" in text, text
    assert snapshot(out) == before  # config.toml, metrics.jsonl and the checkpoint, byte for byte
    # a little room: config.toml is replaced, then the metrics lines fill the disk
    filler.unlink()
    fill(small_disk, leave=4 << 10)
    rc, text = run(capsys, "--out", str(out), "--resume", "--steps", "300")
    assert rc == 2 and "metrics.jsonl: the disk is full" in text, text
    assert "the checkpoint at step 3 and the metrics lines before are intact" in text, text
    assert checkpoint.load(out / "checkpoint.pt")["trainer"]["step"] == 3
    assert (out / "metrics.jsonl").read_bytes().startswith(before["metrics.jsonl"])
    # space again: the run continues from its checkpoint
    for f in small_disk.glob("filler-*"):
        f.unlink()
    rc, text = run(capsys, "--out", str(out), "--resume", "--steps", "5")
    assert rc == 0, text
    assert checkpoint.load(out / "checkpoint.pt")["trainer"]["step"] == 5


def test_a_disk_full_before_the_start(small_disk, capsys):
    """Full before anything is written: the lock's process id is the first write, and fails."""
    out = small_disk / "run"
    fill(small_disk)
    rc, text = run(capsys, "--out", str(out), "--steps", "2")
    assert rc == 2 and f"cannot write {out}/.lock: the disk is full" in text, text
    assert "free some space (or choose another --out)" in text, text
    assert not (out / "metrics.jsonl").exists() and not (out / "config.toml").exists()


FSIZE = textwrap.dedent("""
    import resource, signal, sys
    from cgdp.cli.train import main
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="RLIMIT_FSIZE on Linux")
def test_metrics_past_the_file_size_limit(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", FSIZE, *BASE, "--out", str(out), "--steps", "300",
                        "--checkpoint_every", "1000"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "metrics.jsonl: the file would exceed the largest file this process may write" in p.stderr, p.stderr
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["kind"] == "config"
