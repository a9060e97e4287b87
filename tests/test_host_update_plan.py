"""The host update's cost model and ``python -m cgdp.plan --update host``."""
from __future__ import annotations

import json

import pytest

from cgdp.cli.plan import main
from cgdp.planning.hardware import preset
from cgdp.planning.host_update import HostUpdateCost, estimate


def test_adamw_streams_28_bytes_per_element_and_the_rate_is_learned():
    cost = HostUpdateCost("adamw", gbps=100.0)
    assert cost.seconds(1e9) == pytest.approx(28e9 / 100e9)
    cost.observe(1e6, 0.002)  # one measured step: 28 MB in 2 ms
    assert cost.gbps == pytest.approx(14.0)
    assert HostUpdateCost("sgd_momentum").bytes_per_element == 20
    with pytest.raises(ValueError, match="knows"):
        HostUpdateCost("lion")


def test_a_1_5b_model_on_4_x_24gb_frees_the_adamw_moments():
    hw = preset("pcie4-8gpu")
    hw.gpus = 4
    e = estimate(hw, 1.5e9, backward_s=0.9)
    assert e.freed_per_gpu_bytes == 12e9
    assert e.gpu_bytes == {"devices": 24e9, "host": 12e9}
    assert e.host_bytes == 6e9 + 12e9 + 5 * 6e9  # masters, moments, (G + 1) rows
    assert e.hidden and e.exposed_s < e.update_s
    slow = estimate(hw, 1.5e9, backward_s=0.1)  # backward too short to hide the host's DRAM traffic
    assert not slow.hidden and slow.exposed_s == pytest.approx(slow.dram_s - 0.1)
    after = estimate(hw, 1.5e9, backward_s=0.9, overlap=False)
    assert after.exposed_s == after.update_s


def test_plan_cli_says_per_preset_whether_it_hides(capsys):
    assert main(["--update", "host", "--params", "1.5e9", "--gpus", "4", "--backward-ms", "900", "--model", "alexnet", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert "12.0 GB freed" in out and "pcie3-4gpu" in out and "hidden" in out
    assert main(["--update", "host", "--json", "--model", "alexnet", "--chunks", "2"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["host_update"]) >= {"pcie4-8gpu", "paper-p100"}
