"""The MPI tier with real processes: ``mpiexec -n 2``, each rank with 2 CPU-emulated devices.

Each test starts one MPI job running a script from ``tests/mpi_scripts/`` in a subprocess with a
timeout, so a bug can never hang CI. Skipped when mpi4py or mpiexec is missing
(``pip install "cgdp[mpi]"`` provides both).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MPIEXEC = shutil.which("mpiexec")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
                       reason='needs mpi4py and mpiexec: pip install "cgdp[mpi]"'),
]


def mpirun(script: str, *args: str, n: int = 2, timeout: float = 60.0) -> tuple[int, str, float]:
    """Run ``mpiexec -n n python tests/mpi_scripts/<script> args``; (exit code, output, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [MPIEXEC, "-n", str(n), sys.executable, str(HERE / "mpi_scripts" / script), *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        pytest.fail(f"mpiexec {script} {' '.join(args)} hung for {timeout:g} s; output:\n{out}")
    return p.returncode, p.stdout, time.monotonic() - t0


def test_comm_contract():
    rc, out, _ = mpirun("comm_contract.py")
    assert rc == 0, out
    for what in ("chunks", "small", "probe"):
        assert len(re.findall(f"OK {what} rank [01]", out)) == 2, out


def test_two_ranks_two_devices_equal_single_device_and_are_bitwise_identical():
    rc, out, _ = mpirun("equivalence.py", timeout=120)
    assert rc == 0, out
    for case in ("mlp-sgd-k1-uneven", "mlp-adam-k2", "gated-layer-used-on-one-rank", "batchnorm",
                 "token-sum-count", "token-sum-count-micro-batches"):
        assert f"OK {case}" in out, out


def test_dataparallel_two_ranks_average_like_ddp():
    rc, out, _ = mpirun("dataparallel.py", timeout=120)
    assert rc == 0, out
    assert "OK dataparallel" in out, out


def test_frozen_rank_gives_timeout_then_the_job_ends():
    """Rank 1 freezes (SIGSTOP) mid-backward of step 2: rank 0 raises TimeoutError after timeout_s
    naming what it waited for (a chunk's allreduce; or, should the frozen rank have delivered its
    chunks first, the end-of-step allreduce), and the job is aborted (which also ends the frozen
    rank) instead of hanging."""
    timeout_s = 3.0
    rc, out, took = mpirun("fault.py", "stop", str(timeout_s), timeout=90)
    assert rc != 0, out
    assert "rank 1 trap springs" in out, out
    m = re.search(r"CAUGHT TimeoutError after ([\d.]+) s: rank 0 of 2: "
                  r"(the allreduce of chunk \d+ .* in step 2|allreduce_small of \d+ values in step [23])", out)
    assert m, out
    assert timeout_s - 0.5 <= float(m.group(1)) <= timeout_s + 5, out
    # the abort ended the frozen rank: the job is over long before the harness's 90 s (MPICH's
    # own "MPI_Abort" line is not asserted: hydra may kill the ranks before forwarding it)
    assert "aborting the MPI job" in out and took < 45, out
    assert "rank 1 step 2 done" not in out and "rank 0 step 2 done" not in out, out


def test_killed_rank_ends_the_job():
    """Rank 1 is killed (SIGKILL) mid-backward: the job ends with an error, long before the
    (generous) timeout. With mpiexec (hydra) the launcher ends the job itself; where a launcher
    does not, the timeout of the test above applies."""
    rc, out, took = mpirun("fault.py", "kill", "60", timeout=90)
    assert rc != 0, out
    assert "rank 0 step 2 done" not in out and "finished without error" not in out, out
    assert took < 45, out


@pytest.mark.parametrize("after", ["linger", "hold-gil"])
def test_a_rank_that_catches_the_error_and_goes_on_still_ends(after, tmp_path):
    """Rank 0 catches the TimeoutError and goes on: sleeping (the abort timer ends the job
    abort_grace_s after the failure), or inside a C call that keeps the GIL, so that no Python
    thread can run (faulthandler's C watchdog ends the process abort_grace_s + 2 * HARD_EXIT_S after
    the failure, writing every thread's stack to the error file; the launcher ends the rest)."""
    from cgdp.comm.abort import HARD_EXIT_S
    timeout_s, grace = 2.0, 2.0
    rc, out, _ = mpirun("fault.py", "stop", str(timeout_s), after, str(grace),
                        str(tmp_path / "rank{rank}.error"), timeout=90)
    ended = time.time()
    assert rc != 0, out
    m = re.search(r"CAUGHT-AT ([\d.]+)", out)
    assert m and "CAUGHT TimeoutError" in out, out
    bound = grace + (2 * HARD_EXIT_S if after == "hold-gil" else 0) + 3
    assert ended - float(m.group(1)) <= bound, (ended - float(m.group(1)), out)
    kept = (tmp_path / "rank0.error").read_text()
    assert "rank 0 of 2 on host" in kept and "TimeoutError: rank 0 of 2:" in kept, kept
    if after == "hold-gil":  # the watchdog's dump of every thread, the main one inside fault.py
        assert re.search(r"Timeout \(0:00:\d+\)!", kept) and "fault.py" in kept, kept
    else:
        assert "ending the MPI job now (after the TimeoutError above)" in kept, kept


def test_mismatched_ranks_are_named_at_start_up():
    rc, out, _ = mpirun("mismatch.py")
    assert rc == 0, out
    for case in ("model", "devices", "optimizer"):
        assert len(re.findall(f"OK {case} rank [01]", out)) == 2, out
    assert "rank 0 has '2', rank 1 has '1'" in out


def test_training_cli_under_mpiexec(tmp_path):
    """``mpiexec -n 2 python -m cgdp.train``: MPI is picked up by itself, rank 0 writes results."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "cgdp.train", "--steps", "150", "--devices", "2",
           "--batch", "16", "--chunks", "1", "--out", str(tmp_path), "--progress", "off"]
    p = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stdout
    assert "2 MPI ranks" in p.stdout and p.stdout.count("eval accuracy") == 1, p.stdout
    import json
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["final"] is True and rows[-1]["eval_accuracy"] >= 0.9
    assert (tmp_path / "checkpoint.pt").exists()


def test_a_rank_whose_set_up_failed_ends_the_job():
    """Rank 1 never builds its comm (its link cut during start-up): rank 0's set-up times out, the
    error names the rank and what it waited for, and rank 0 ends the job at once. Before, it raised
    and then waited in MPI_Finalize at exit until rank 1 ended (never, behind a dead link)."""
    rc, out, took = mpirun("setup_fails.py", "2", timeout=90)
    assert rc != 0, out
    assert "TimeoutError: rank 0 of 2: duplicating the communicator" in out, out
    assert "built a comm alone" not in out, out
    assert took < 30, (took, out)  # rank 1 sleeps 60 s
