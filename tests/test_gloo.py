"""The gloo tier with real processes on loopback: plain ``env://`` processes, and torchrun.

Each test starts its ranks as subprocesses with a timeout (a bug never hangs CI), each rank with
2 CPU-emulated devices, ``MASTER_ADDR=127.0.0.1`` and a free port. Faults are in
tests/test_gloo_faults.py; two hosts in network namespaces in tests/test_gloo_multihost.py.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, size: int, port: int, **extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]), **extra)


def start_ranks(argv: list[str], size: int = 2, **extra: str) -> list[subprocess.Popen]:
    """``size`` processes of ``argv``, rank r with RANK=r (what torchrun sets), output captured."""
    port = free_port()
    return [subprocess.Popen(argv, env=rank_env(r, size, port, **extra), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for r in range(size)]


def finish(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int | None], list[str], float]:
    """Wait for every process (killing those past ``timeout``): exit codes (None: killed), outputs,
    seconds until the last one ended."""
    t0 = time.monotonic()
    codes, outs = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, timeout - (time.monotonic() - t0)))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            codes.append(None)
        outs.append(out)
    return codes, outs, time.monotonic() - t0


def script(name: str) -> list[str]:
    return [sys.executable, str(HERE / "gloo_scripts" / name)]


def test_two_ranks_equal_one_device_bitwise_identical_with_ring_micro_batches_and_bf16_then_gloo_check():
    codes, outs, _ = finish(start_ranks(script("equivalence.py")), timeout=240)
    assert codes == [0, 0], "\n---\n".join(outs)
    out = outs[0]
    for case in ("contract", "user-group", "mlp-sgd-k1-uneven", "mlp-adam-k2-micro-batches", "host-ring", "bf16",
                 "dataparallel"):
        assert f"OK {case}" in out, out
    # python -m cgdp.gloo_check's report, from the same ranks: on one machine the bytes went through lo
    import json
    report = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert report["backend"] == "gloo" and report["verdict"] == "loopback" and report["sum_ok"], out
    assert all(r["busiest_interface"] == "lo" and r["library"].startswith("gloo") for r in report["ranks"]), out
    assert report["allreduce"]["bus_gbit_s"] > 0, out


def test_env_world_reads_torchrun_slurm_and_says_what_is_missing():
    from cgdp.comm.gloo import env_world, first_slurm_host
    tr = env_world({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "29400",
                    "TORCHELASTIC_RUN_ID": "x"})
    assert tr == {"rank": 1, "size": 2, "addr": "h0", "port": 29400, "source": "torchrun"}
    sl = env_world({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu[007-010],cpu1"})
    assert sl == {"rank": 3, "size": 4, "addr": "gpu007", "port": 29500, "source": "SLURM"}
    assert first_slurm_host("node1,node2") == "node1"
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT not; start every rank with torchrun"):
        env_world({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="does not say where the other ranks are"):
        env_world({})


@pytest.mark.parametrize("env, match", [
    ({"MASTER_PORT": "296232422"}, r"MASTER_PORT=296232422 \(RANK/WORLD_SIZE\) is not a TCP port, which must be "
                                   r"in 1..65535; set MASTER_PORT to a free port"),
    ({"MASTER_PORT": "0"}, r"MASTER_PORT=0 .* is not a TCP port"),
    ({"MASTER_PORT": "29x00"}, r"MASTER_PORT='29x00' \(RANK/WORLD_SIZE\) is not a whole number"),
    ({"RANK": "one"}, r"RANK='one' .* is not a whole number"),
    ({"MASTER_ADDR": "h0:29500"}, r"MASTER_ADDR='h0:29500' .* looks like HOST:PORT; put the host in MASTER_ADDR"),
    ({"MASTER_ADDR": "tcp://h0"}, r"MASTER_ADDR='tcp://h0' .* is a URL"),
    ({"MASTER_ADDR": "h0 "}, r"MASTER_ADDR='h0 ' .* holds a space"),
])
def test_env_world_refuses_a_bad_port_or_address_before_the_rendezvous(env, match):
    """Said before any connection is tried: not as a rendezvous timeout with the cause in brackets."""
    from cgdp.comm.gloo import env_world
    with pytest.raises(ValueError, match=match):
        env_world({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **env})
    assert env_world({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "::1", "MASTER_PORT": "65535"})["port"] == 65535


def test_training_cli_says_what_is_wrong_with_master_port(monkeypatch, capsys):
    from cgdp.cli.train import main
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "296232422"}.items():
        monkeypatch.setenv(k, v)
    assert main(["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cgdp.train: error: comm='gloo': MASTER_PORT=296232422") and "Traceback" not in err, err


def test_training_cli_picks_gloo_from_the_launchers_environment(tmp_path):
    """``python -m cgdp.train`` in processes started as torchrun starts them (RANK, WORLD_SIZE,
    MASTER_*): gloo is picked up by itself (``--comm auto``); rank 0 writes the results. (torchrun
    itself launches the training job in tests/test_gloo_multihost.py.)"""
    argv = [sys.executable, "-m", "cgdp.train", "--steps", "60", "--devices", "2", "--batch", "16", "--chunks",
            "1", "--out", str(tmp_path), "--progress", "off", "--plots", "false"]
    codes, outs, _ = finish(start_ranks(argv), timeout=300)
    assert codes == [0, 0], "\n---\n".join(outs)
    out = outs[0]
    assert "2 gloo ranks" in out and out.count("eval accuracy") == 1 and "eval accuracy" not in outs[1], out
    import json
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["final"] is True and rows[-1]["eval_accuracy"] >= 0.7, rows[-1]
    assert not list(tmp_path.glob("rank*.error")), "an error file after a run without error"
