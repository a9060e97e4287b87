"""Faults of the gloo tier, with real processes on loopback: every rank that can run ends by itself.

Rank 1 is killed or frozen mid-backward, or never starts: rank 0 raises an error naming its rank
and what it waited for (the chunk's allreduce, or the rendezvous), within ``timeout_s`` plus a
margin, and its process ends at once although a gloo thread may still sit in a collective (the
rendezvous is tested in this process: no training process is needed to fail it). (A
frozen process can only be ended from outside: the test does it, as a launcher or the scheduler
would; docs/multinode.md.) Cut links are in tests/test_gloo_multihost.py.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from test_gloo import finish, script, start_ranks

TIMEOUT_S = 3.0
MARGIN_S = 5.0  # the watchdog's look (<= 1 s) and the process's own end (os._exit)


def run(mode: str, tmp_path):
    return start_ranks(script("fault.py") + [mode, str(TIMEOUT_S), str(tmp_path / "rank{rank}.error")])


@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_a_dead_or_frozen_rank_fails_the_other_which_ends(mode, tmp_path):
    procs = run(mode, tmp_path)
    try:
        codes, outs, _ = finish(procs[:1], timeout=90)
        ended = time.monotonic()
    finally:
        for p in procs:
            p.kill()
    out = outs[0]
    assert codes[0] not in (0, None), out
    m = re.search(r"CAUGHT (\w+) after ([\d.]+) s: rank 0 of 2: (.*)", out)
    assert m, out
    kind, took, what = m.group(1), float(m.group(2)), m.group(3)
    if mode == "kill":  # the peer's sockets close: gloo fails at once, cgdp says what that means
        assert kind == "RuntimeError" and took < TIMEOUT_S, out
        assert re.match(r"the allreduce of chunk \d+ \(\d+ values\) in step 2 failed: a peer closed its "
                        r"connection: another rank died", what) or "allreduce_small" in what, out
    else:  # frozen: nothing closes, the watchdog gives up after timeout_s
        assert kind == "TimeoutError" and TIMEOUT_S - 0.5 <= took <= TIMEOUT_S + MARGIN_S, out
        assert re.match(r"(the allreduce of chunk \d+ .* in step 2 made no progress for 3 s|allreduce_small "
                        r"of \d+ values in step [23] did not complete within 3 s)", what), out
    caught_at = float(re.search(r"CAUGHT-AT ([\d.]+)", out).group(1))
    assert ended - caught_at < MARGIN_S, (ended - caught_at, out)  # the process ended at once
    kept = (tmp_path / "rank0.error").read_text()
    assert "rank 0 of 2" in kept and kind in kept, kept


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_never_comes_fails_the_rendezvous_in_time(rank, monkeypatch):
    """The other rank is never started (or its link was cut during start-up): rank 0 waits for it
    at its store, rank 1 cannot reach rank 0; each fails in ``timeout_s`` plus gloo's connection
    retry, naming itself, the address and where it came from (in this process: nothing of it stays)."""
    import torch.distributed as dist

    from cgdp.comm.gloo import init_from_env
    from test_gloo import free_port
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"rank {rank} of 2: the gloo rendezvous at 127.0.0.1:{port} \(from "
                                           rf"RANK/WORLD_SIZE\) did not complete within 2.0 s: a rank was not started"):
        init_from_env(2.0)
    assert time.monotonic() - t0 <= 2.0 + MARGIN_S
    assert not dist.is_initialized()


def test_the_cli_rendezvous_takes_timeout_s_and_says_so_in_a_sentence(tmp_path):
    """``python -m cgdp.train --comm gloo --timeout_s 2`` whose other rank never comes: a sentence and exit code 2
    within the given timeout, not a traceback after the default 300 s."""
    import subprocess
    import sys

    from test_gloo import free_port
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "cgdp.train", "--comm", "gloo", "--timeout_s", "2", "--steps", "1"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(f"cgdp.train: error: rank 0 of 2: the gloo rendezvous at 127.0.0.1:{port}"), p.stderr
    assert "within 2.0 s" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert took < 2.0 + MARGIN_S + 20, took  # the interpreter's start and torch's import besides
