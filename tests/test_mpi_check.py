"""``python -m cgdp.mpi_check``: the verdict from byte counters, and the command under ``mpiexec -n 2``.

Across hosts (network namespaces, the transport forced or not) it is tested in
tests/test_multihost.py::test_mpi_check_tells_shared_memory_from_the_network.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from cgdp.cli import mpi_check

MIB = 2**20


def test_verdict_names_the_interface_that_carried_the_ring_bytes():
    ring = 64 * MIB
    assert mpi_check.verdict({"eth0": (64 * MIB, 65 * MIB), "lo": (10, 10)}, ring) == ("network", "eth0")
    # some ssh traffic on a second NIC does not make it the carrier
    assert mpi_check.verdict({"eth0": (200, 3000), "ib0": (64 * MIB, 64 * MIB)}, ring) == ("network", "ib0")
    assert mpi_check.verdict({"lo": (64 * MIB, 64 * MIB), "eth0": (10, 10)}, ring) == ("loopback", "lo")
    assert mpi_check.verdict({"eth0": (20_000, 18_000)}, ring) == ("no-network", "eth0")  # launcher chatter
    assert mpi_check.verdict({}, ring) == ("no-network", None)


def test_summary_of_ranks_that_disagree_is_mixed_and_bandwidth_is_per_ring():
    ranks = [{"rank": 0, "moved": {"eth0": (MIB, MIB)}}, {"rank": 1, "moved": {}}]
    report = mpi_check.summarise(ranks, MIB, 1, [0.5, 0.25, 1.0])
    assert report["verdict"] == "mixed"
    assert [r["verdict"] for r in report["ranks"]] == ["network", "no-network"]
    assert report["allreduce"]["median_s"] == 0.5
    assert report["allreduce"]["bus_gbit_s"] == pytest.approx(MIB / 0.5 * 8 / 1e9)  # 2(R-1)/R = 1 for R = 2


def test_netmod_comes_from_the_setting_or_the_build():
    lib = "MPICH Version:      5.0.2\nMPICH Device:       ch4:ucx ofi\n"
    assert mpi_check.netmod(lib, {}).startswith("ucx (the library's default")
    assert mpi_check.netmod(lib, {"MPIR_CVAR_CH4_NETMOD": "ofi"}) == "ofi (MPIR_CVAR_CH4_NETMOD)"
    assert "not MPICH" in mpi_check.netmod("Open MPI v5.0.3", {})


def test_alone_or_with_bad_numbers_it_says_what_to_do():
    for mib in ("0", "1e9"):  # nothing, or a petabyte
        p = subprocess.run([sys.executable, "-m", "cgdp.mpi_check", "--mib", mib], capture_output=True, text=True)
        assert p.returncode == 2 and "--mib" in p.stderr and "Traceback" not in p.stderr, p.stderr
    if importlib.util.find_spec("mpi4py") is not None:
        p = subprocess.run([sys.executable, "-m", "cgdp.mpi_check"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "mpiexec -n 2" in p.stderr, p.stderr


@pytest.mark.mpi
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or shutil.which("mpiexec") is None,
                    reason='needs mpi4py and mpiexec: pip install "cgdp[mpi]"')
def test_two_ranks_on_one_machine_share_memory():
    """Under ``mpiexec -n 2`` here MPICH moves the data through shared memory: the sum is right,
    no interface carried it, and ``--require-network`` says so with exit code 1."""
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "cgdp.mpi_check", "--mib", "4", "--reps", "2",
           "--require-network"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "wrong sum" not in p.stderr, p.stdout + p.stderr
    assert "verdict: the data of rank(s) [0, 1] crossed no network interface" in p.stdout, p.stdout
    rows = [line.split() for line in p.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [r[0] for r in rows] == ["0", "1"] and all(r[-1] == "no-network" for r in rows), p.stdout
    assert "allreduce of 4 MiB through cgdp's comm thread, 2 times" in p.stdout, p.stdout
