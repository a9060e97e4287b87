"""The MPI tier across hosts: one rank per network namespace, the transport forced onto TCP.

Each test makes its own hosts (:class:`cgdp.testing.netns.Hosts`: namespaces joined by a bridge
in a namespace of its own, addresses only inside them, all removed at the end) and runs
``mpiexec -launcher manual`` in host 0 with one ``hydra_pmi_proxy`` per host, so the ranks, the
proxies and the launcher talk only over the hosts' links. Without forcing, UCX moves the data
through shared memory (the namespaces share ``/dev/shm``) and the link carries nothing:
``test_mpi_check_tells_shared_memory_from_the_network`` shows it. Skipped where namespaces cannot
be made (not root, no ``ip``, no ``CAP_SYS_ADMIN``) or MPI is missing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from cgdp.comm.abort import HARD_EXIT_S
from cgdp.testing import netns

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NETMODS = ["ucx", "ofi"]

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or shutil.which("mpiexec") is None,
                       reason='needs mpi4py and mpiexec: pip install "cgdp[mpi]"'),
]


@pytest.fixture(scope="module")
def can_make_hosts():
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"cannot emulate hosts with network namespaces: {why}")


@pytest.fixture
def hosts(can_make_hosts):
    with netns.Hosts(2) as h:
        yield h
    assert not any(name in os.popen("ip netns list").read() for name in h.names), "namespaces left behind"


def run(hosts: netns.Hosts, argv: list[str], netmod: str | None, timeout: float = 120,
        launcher: str = "manual") -> tuple[int, str, list]:
    """Run an MPI job across ``hosts``: (exit code, output, bytes (received, sent) per host)."""
    before = [hosts.bytes(i) for i in range(2)]
    job = netns.Job(hosts, argv, netns.job_env(netmod, [str(ROOT), str(HERE)]), launcher=launcher)
    try:
        rc = job.wait(timeout)
    finally:
        job.kill()
    moved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip((hosts.bytes(i) for i in range(2)), before)]
    return rc, job.output, moved


@pytest.mark.parametrize("netmod", NETMODS)
def test_ranks_on_two_hosts_are_exact_and_the_gradients_cross_the_link(hosts, netmod):
    rc, out, moved = run(hosts, [sys.executable, str(HERE / "mpi_scripts" / "multihost.py"), "3"], netmod)
    assert rc == 0, out
    m = re.search(r"OK multihost ranks=2 steps=3 grad_bytes=(\d+)", out)
    assert m, out
    grad_bytes = int(m.group(1))
    # a 2-rank allreduce sends each rank's gradient to the other once: every host's link carries
    # at least the gradient bytes in each direction (the launcher's own traffic is a few kB)
    for i, (rx, tx) in enumerate(moved):
        assert rx >= 0.9 * grad_bytes and tx >= 0.9 * grad_bytes, (i, moved, grad_bytes, out)


def test_mpi_check_tells_shared_memory_from_the_network(hosts):
    """Unforced, UCX puts (almost) nothing on the link and mpi_check says so; forced onto TCP, it
    names the interface and measures the bandwidth; ``--require-network`` fails the first. The
    second run is launched as over ssh (hydra's ssh launcher, through a stand-in for ssh that runs
    each proxy in its host), with the transport variables set in front of mpiexec only."""
    argv = [sys.executable, "-m", "cgdp.mpi_check", "--mib", "8", "--json", "--require-network"]
    rc, out, moved = run(hosts, argv, None)
    assert rc != 0, out
    report = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert report["verdict"] == "no-network", out
    assert all(tx < 1 << 20 for _, tx in moved), moved

    rc, out, moved = run(hosts, argv, "ucx", launcher="ssh")
    assert rc == 0, out
    report = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert report["verdict"] == "network", out
    for r in report["ranks"]:
        assert r["busiest_interface"] == netns.IFACE, out
        assert r["env"]["UCX_TLS"] == "tcp,self", out
    assert report["allreduce"]["bus_gbit_s"] > 0, out
    assert all(tx >= 8 << 20 for _, tx in moved), moved


def test_training_cli_across_two_hosts(hosts, tmp_path):
    argv = [sys.executable, "-m", "cgdp.train", "--steps", "60", "--devices", "2", "--batch", "16",
            "--chunks", "1", "--out", str(tmp_path), "--progress", "off", "--plots", "false"]
    rc, out, moved = run(hosts, argv, "ucx", timeout=240)
    assert rc == 0, out
    assert "2 MPI ranks" in out and out.count("eval accuracy") == 1, out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["final"] is True and rows[-1]["eval_accuracy"] >= 0.7, rows[-1]
    assert all(tx > 1 << 20 for _, tx in moved), moved  # 60 steps of a 20 kB gradient and more
    assert not list(tmp_path.glob("rank*.error")), "an error file after a run without error"


@pytest.mark.parametrize("netmod", NETMODS)
def test_cut_link_ends_every_process_and_each_rank_keeps_its_error(hosts, tmp_path, netmod):
    """Host 1's link goes down mid-training: every process on both sides (mpiexec, both proxies,
    both ranks) ends within timeout_s + 1 s (detection) + HARD_EXIT_S, and the far rank's error,
    which the launcher cannot forward any more, is in OUT/rank1.error on its own disk."""
    timeout_s = 3.0
    ended, out = netns.cut_during_training(hosts, netns.job_env(netmod, [str(ROOT)]), tmp_path, timeout_s)
    assert len(ended) == 5 and sum("python" in k for k in ended) == 2, ended
    bound = timeout_s + 1 + HARD_EXIT_S
    late = {k: v for k, v in ended.items() if v is None or v > bound}
    assert not late, f"still running or late (bound {bound:g} s): {late}; all: {ended}\n{out}"
    far = (tmp_path / "rank1.error").read_text()
    assert "rank 1 of 2" in far and "TimeoutError" in far, far
    near = (tmp_path / "rank0.error").read_text()
    assert "rank 0 of 2" in near and "TimeoutError" in near, near
    assert "rank 0 of 2" in out and "TimeoutError" in out, out  # the near rank's also reaches mpiexec


def test_ranks_whose_launcher_is_cut_off_finish_then_exit(can_make_hosts, tmp_path):
    """mpiexec alone in host 0 (a login node), one rank in each of hosts 1 and 2; host 0's link goes
    down once they train. The ranks still reach each other and finish; then MPI_Finalize waits for
    the launcher (over UCX, for ever), and finalize_timeout_s ends each process that long after."""
    finalize_s = 3.0
    script = [sys.executable, str(HERE / "mpi_scripts" / "launcher_cut.py"), str(tmp_path), str(finalize_s)]
    with netns.Hosts(3) as hosts:
        job = netns.Job(hosts, script, netns.job_env("ucx", [str(ROOT)]), rank_hosts=[1, 2])
        try:
            for r in (0, 1):
                job.wait_for(f"rank {r} started", 120)
            procs = {pid: name for pid, name in job.processes().items() if not name.startswith("host0")}
            t_cut = time.monotonic()
            hosts.set_link(0, up=False)
            ended = netns.end_times(procs, t_cut, limit=60)
        finally:
            job.kill()
    assert len(procs) == 4, procs  # a proxy and a rank in each of hosts 1 and 2
    assert all(v is not None for v in ended.values()), f"still running 60 s after the cut: {ended}"
    finished = max(float((tmp_path / f"rank{r}.done").read_text()) for r in (0, 1)) - t_cut
    assert max(ended.values()) <= finished + finalize_s + 2, (ended, finished)
