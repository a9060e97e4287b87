"""The cost model knows the host: hooks, sends and segments cost host CPU, and host DRAM carries
(3G + 1) x the gradient bytes; the planner weighs them and ``cgdp.plan`` says when they bind."""
import dataclasses

import numpy as np
import pytest

from cgdp.cli.plan import main as plan_main
from cgdp.planning.chunks import one_chunk_plan, paper_plan
from cgdp.planning.costs import Linear, ModelCosts, StageCosts
from cgdp.planning.flowshop import chain_makespan, stage_times
from cgdp.planning.hardware import Hardware, host_traffic, stage_costs
from cgdp.planning.planner import choose_plan, dp_plan, brute_force
from cgdp.planning.simulator import simulate


def random_model(rng, L):
    return ModelCosts([int(b) for b in rng.integers(1, 4_000_000, L)], list(rng.uniform(0, 3e-3, L)),
                      layer_tensors=[int(t) for t in rng.integers(1, 4, L)])


def test_event_simulation_equals_closed_form_with_host_costs():
    rng = np.random.default_rng(7)
    for _ in range(15):
        L = int(rng.integers(1, 25))
        model = random_model(rng, L)
        costs = StageCosts(devices=3, sync_s=2e-4, d2h=Linear(1e-5, 1e-9), h2d=Linear(1e-5, 2e-10),
                           acc=Linear(2e-5, 5e-10), dram=Linear(0, float(rng.uniform(0, 4e-9))),
                           hook_s=float(rng.uniform(0, 2e-5)), segment_bytes=1 << 20,
                           segment_s=float(rng.uniform(0, 1e-4)), segment_device_s=2e-5)
        k = int(rng.integers(1, L + 1))
        sizes = [len(c) for c in paper_plan(L, k)]
        assert simulate(model, costs, paper_plan(L, k)).phase_s == pytest.approx(
            chain_makespan(stage_times(model, costs, sizes)), rel=1e-12)


def test_dp_is_exact_with_host_costs():
    rng = np.random.default_rng(8)
    for _ in range(4):
        model = random_model(rng, 9)
        costs = StageCosts(devices=4, sync_s=1e-4, d2h=Linear(1e-5, 1e-9), h2d=Linear(1e-5, 1e-9),
                           acc=Linear(1e-5, 1e-9), dram=Linear(0, 3e-9), hook_s=1e-5,
                           segment_bytes=1 << 20, segment_s=5e-4, segment_device_s=1e-4)
        plan, t, exact = dp_plan(model, costs)
        assert exact and t == pytest.approx(brute_force(model, costs)[1], rel=1e-12)


def test_host_dram_binds_before_pcie_on_a_desktop():
    """(3G + 1) x S through host DRAM: at 2 devices on 25 GB/s of DRAM and PCIe 4, the DRAM needs
    7 S / 25 GB/s while a link needs S / 25 GB/s: DRAM sets the pace."""
    model = ModelCosts([50_000_000] * 4, [1e-3] * 4)
    hw = Hardware(gpus=2, pcie_gen=4, host_mem_gbps=25.0, host_threads=16, thread_gbps=50.0)
    r = simulate(model, stage_costs(hw), paper_plan(4, 1))
    assert r.binding == "dram"
    assert r.phase_s >= host_traffic(2) * 200e6 / 25e9
    rich = dataclasses.replace(hw, host_mem_gbps=400.0)
    assert simulate(model, stage_costs(rich), paper_plan(4, 1)).binding in ("d2h", "h2d", "acc")


def test_per_segment_host_cost_pushes_the_planner_to_fewer_chunks():
    L = 40
    model = ModelCosts([400_000] * L, [2e-4] * L, layer_tensors=[2] * L)
    cheap = StageCosts(devices=8, d2h=Linear(1e-6, 1 / 20e9), h2d=Linear(1e-6, 1 / 20e9), acc=Linear(1e-6, 1 / 20e9))
    dear = dataclasses.replace(cheap, segment_s=50e-6, segment_device_s=30e-6, sync_s=20e-6)
    many = len(choose_plan(model, cheap).plan)
    few = len(choose_plan(model, dear).plan)
    assert few < many
    r = simulate(model, dear, paper_plan(L, 1))
    assert r.binding == "hostcpu" and r.critical_s["hostcpu"] > 0


def test_hooks_add_to_the_compute_of_their_layer():
    model = ModelCosts([1000, 1000], [1.0, 1.0], layer_tensors=[3, 1])
    costs = StageCosts(devices=2, hook_s=0.1)
    assert simulate(model, costs, [[1], [0]]).compute_s == pytest.approx(2 + 0.4)
    assert simulate(model, costs, one_chunk_plan(2)).compute_s == pytest.approx(2 + 0.4)


def test_plan_says_what_binds(capsys):
    assert plan_main(["--model", "vgg16", "--hardware", "pcie4-8gpu", "--host-gbps", "40"]) == 0
    out = capsys.readouterr().out
    assert "host DRAM: (3G+1) x S = 25 x" in out and "host DRAM binds first" in out
    assert "limit: host DRAM bandwidth" in out
    assert plan_main(["--model", "alexnet", "--hardware", "pcie4-8gpu", "--gpus", "2", "--host-gbps", "400"]) == 0
    assert "PCIe binds first" in capsys.readouterr().out
    # a flat model on many devices with dear hooks: the host CPU, not the devices, sets the pace
    assert plan_main(["--model", "resnet152", "--hardware", "pcie4-8gpu", "--minibatch", "1",
                      "--hook-us", "60", "--sync-us", "80", "--segment-us", "200"]) == 0
    assert "the host CPU binds" in capsys.readouterr().out
