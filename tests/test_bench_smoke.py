"""The benchmarks run and check their answers (quick mode; figures are not asserted here).

Benchmarks are only worth their figures if they still run: this runs ``bench/run_all.py --quick``
(host accumulation against copy, NumPy and torch; the engine against typical and DDP over gloo,
each checked against single-device training first) and ``bench/gpu_all.py --quick`` (on a
simulated ``cuda:0``: the CUDA backend's own code, G = 1, 2 and 4 replicas), into a temporary folder.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each runs benchmark scripts in processes of their own

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_cpu_benchmarks_run_quick(tmp_path):
    p = _run(["bench/run_all.py", "--quick", "--results", str(tmp_path)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    page = (tmp_path / "cpu.md").read_text()
    for needle in ("Command: `python bench/run_all.py --quick", "torch:", "numba:", "copy limit",
                   "cgdp / DDP", "cgdp / copy"):
        assert needle in page, needle
    acc = json.loads((tmp_path / "accumulate.json").read_text())
    assert {(r["dtype"], r["parts"]) for r in acc["results"]} >= {("f32", 2), ("bf16", 2)}
    eng = json.loads((tmp_path / "engine.json").read_text())
    r = eng["results"][0]
    assert all(e <= 1e-5 for e in r["rel_err"].values())
    assert set(r["step_s"]) == {"single", "cgdp", "typical", "DDP"}


def test_gpu_script_runs_emulated(tmp_path):
    """In two calls of different ``--parts`` (as on a GPU machine whose calls are time-limited),
    then one page merged from both."""
    a, b = tmp_path / "a", tmp_path / "b"
    for out, parts in ((a, "bandwidth,networks,replicas"), (b, "sweep,alg1")):
        p = _run(["bench/gpu_all.py", "--quick", "--parts", parts], env={"OUT": str(out)})
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((a / "gpu.json").read_text())
    assert not res["errors"] and "chunk_sweep" not in res
    assert res["bandwidth"]["gbps"]["D2H"] > 0
    assert {n["model"] for n in res["networks"]} == {"mlp", "digits_cnn"}
    for n in res["networks"]:
        assert all(e <= 1e-5 for e in n["check_rel_err"].values())
        assert n["modes"]["cgdp"]["per_layer"]
    assert res["simulated"] and res["device"] == "cuda:0"
    for r in res["replicas"]:  # G = 2 and 4 replicas on the one (simulated) GPU, checked, timed
        assert set(r["runs"]) == {"2", "4"}
        for run in r["runs"].values():
            assert run["check_rel_err"]["cgdp"] <= 1e-5 and run["check_rel_err"]["cgdp_bf16"] <= 1e-3
            assert run["cgdp_ms"] > 0 and run["cgdp_bf16_ms"] > 0 and run["typical_ms"] > 0
    page = (a / "gpu.md").read_text()
    assert "No GPU was used" in page and "simulator predictions" in page and "G replicas on one GPU" in page
    res = json.loads((b / "gpu.json").read_text())
    assert not res["errors"] and not res["networks"] and "bandwidth" not in res
    assert res["chunk_sweep"]["sizes"] and res["algorithm1"][0]["done"]
    # the page is built from the json files alone, merged
    q = _run(["bench/gpu_all.py", "--report", str(a / "gpu.json"), str(b / "gpu.json")])
    assert q.returncode == 0, q.stderr[-3000:]
    for needle in ("Table 4", "Copy bandwidth", "Figure 2", "Figure 5"):
        assert needle in q.stdout, needle
    bad = _run(["bench/gpu_all.py", "--quick", "--parts", "sweep,nope"], env={"OUT": str(tmp_path / "c")})
    assert bad.returncode == 2 and "unknown part" in bad.stderr


def test_tuner_benchmark_runs_quick(tmp_path):
    p = _run(["bench/bench_tuners.py", "--quick", "--md", str(tmp_path / "tuners.md")])
    assert p.returncode == 0, p.stdout + p.stderr
    page = (tmp_path / "tuners.md").read_text()
    assert "Algorithm 1's choice" in page and "auto tuner's choice" in page


def test_host_cost_bench_runs_quick(tmp_path):
    """bench/bench_host_cost.py on null CUDA devices (2 of them) and its page."""
    out = tmp_path / "host_cost.json"
    p = _run(["bench/bench_host_cost.py", "--quick", "--sections", "null,ring", "--devices", "2",
              "--settings", "1", "--md", str(tmp_path / "host_cost.md"), "--json", str(out)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    (r,) = res["null"]
    assert r["G"] == 2 and r["chunks"] == 76 and r["calls_per_step"]["copy"] >= 2 * 2 * r["segments"]
    assert all(m["bitwise_equal"] and m["registered_ring"] == res["ring"]["host_memory"] for m in res["ring"]["models"])
