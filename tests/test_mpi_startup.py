"""``mpiexec -n 2 python -m cgdp.train`` where one rank's command differs: every rank exits with
code 2 within seconds, and rank 0 names the rank and what differs (never a hang in MPI_Init)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from test_mpi import MPIEXEC, mpirun

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
                       reason='needs mpi4py and mpiexec: pip install "cgdp[mpi]"'),
]


def run_cli(rank: int, extra: str, *args: str) -> tuple[int, str, float]:
    """``mpiexec -n 2`` of ``python -m cgdp.train ARGS``, rank ``rank`` with ``EXTRA`` too."""
    return mpirun("cli_per_rank.py", str(rank), extra, "--steps", "3", "--devices", "1", "--progress", "off",
                  "--plots", "false", *args)


def test_one_ranks_user_error_ends_every_rank():
    rc, out, took = run_cli(1, "--lr -1")
    assert rc == 2, out
    assert "rank 1 of 2: train.lr must be > 0" in out, out
    assert "rank 0 exit 2" in out and "rank 1 exit 2" in out, out
    assert took < 30, (took, out)
    assert "Traceback" not in out, out


def test_ranks_with_different_batch_sizes_are_refused():
    rc, out, took = run_cli(1, "--batch 8", "--batch", "16")
    assert rc == 2, out
    assert "rank 0 has train.batch = 16, rank 1 has 8" in out, out
    assert took < 30


def test_ranks_with_different_data_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        x = rng.random((64, 1, 8, 8), dtype=np.float32)  # same shapes and labels, other pixels
        np.savez(tmp_path / name / "part.npz", x=x, y=np.arange(64) % 10)
    rc, out, took = run_cli(1, f"--shards {tmp_path / 'b'}", "--dataset", "shards", "--shards",
                            str(tmp_path / "a"), "--batch", "4", "--model", "digits_cnn")
    assert rc == 2, out
    assert "rank 0 has training data = '51 samples, sha256" in out and "rank 1 has '51 samples" in out, out
    assert took < 30
