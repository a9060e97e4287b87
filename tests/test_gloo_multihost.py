"""The gloo tier across two hosts emulated by network namespaces, torchrun on each; then a cut link.

One test (it needs root; skipped with the reason elsewhere): ``torchrun --nnodes 2
--nproc-per-node 1`` in each namespace (:class:`cgdp.testing.netns.TorchrunJob`; rendezvous at
host 0's address, gloo on ``hnet0``). The ranks train to the single-device result, bitwise
identical, and the kernel's byte counters of each host's link show that the gradient crossed it.
Then host 1's link goes down mid-training: both workers end within ``timeout_s`` + the
watchdog's look + ``MARGIN_S``, both torchrun agents ``AGENT_S`` after that at most, and each
worker's error, naming its rank and the chunk it waited for, is in its own file.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from cgdp.testing import netns

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARGIN_S = 5.0
AGENT_S = 10.0
"""torchrun's agent, after its worker ended: it reports the failure and exits (3.2 to 7.7 s here)."""


@pytest.fixture(scope="module")
def can_make_hosts():
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"cannot emulate hosts with network namespaces: {why}")


def test_torchrun_on_two_hosts_exact_the_gradient_crosses_the_link_and_a_cut_ends_everything(
        can_make_hosts, tmp_path):
    timeout_s = 3.0
    argv = [str(HERE / "gloo_scripts" / "multihost.py"), "3", str(timeout_s), str(tmp_path)]
    with netns.Hosts(2) as hosts:
        before = [hosts.bytes(i) for i in range(2)]
        job = netns.TorchrunJob(hosts, argv, netns.job_env(None, [str(ROOT), str(HERE)]))
        try:
            job.wait_for("OK multihost", 240)
            job.wait_for("rank 1 step 2", 60)  # training goes on
            moved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip((hosts.bytes(i) for i in range(2)), before)]
            procs = hosts.processes()
            t_cut = time.monotonic()
            hosts.set_link(1, up=False)
            ended = netns.end_times(procs, t_cut, limit=90)
        finally:
            job.kill()
        names = list(hosts.names)
    assert not any(n in os.popen("ip netns list").read() for n in names), "namespaces left behind"
    out = job.output
    grad_bytes = int(re.search(r"OK multihost steps=3 grad_bytes=(\d+)", out).group(1))
    # a 2-rank allreduce sends each rank's gradient to the other once
    for i, (rx, tx) in enumerate(moved):
        assert rx >= 0.9 * grad_bytes and tx >= 0.9 * grad_bytes, (i, moved, grad_bytes, out)
    # the workers are "python", torchrun's agents "pt_elastic"
    assert sum(":python" in k for k in ended) == 2 and sum(":pt_elastic" in k for k in ended) == 2, ended
    bound = {"python": timeout_s + 1 + MARGIN_S, "pt_elastic": timeout_s + 1 + MARGIN_S + AGENT_S}
    late = {k: v for k, v in ended.items() if v is None or v > bound[k.split(":")[1].split("[")[0]]}
    assert not late, f"still running or late (bounds {bound}): {late}; all: {ended}\n{out}"
    for r in (0, 1):
        kept = (tmp_path / f"rank{r}.error").read_text()
        assert f"rank {r} of 2" in kept and "TimeoutError" in kept, kept
