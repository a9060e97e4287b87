"""The paper's cost model (§3.2), checked on hand-worked numbers and against the simulator."""
import numpy as np
import pytest

from cgdp.planning.costmodel import (ChunkTimes, backprop_time, cgdp_backward_time, cgdp_exact_overhead, cgdp_overhead,
                            cgdp_wins, chunk_times, layer_completion_times, paper_win_condition,
                            typical_backward_time, typical_overhead)
from cgdp.planning.flowshop import chain_makespan


# three layers in backward order (paper's layers 3, 2, 1)
BP, AS, AA, BC = [4.0, 2.0, 1.0], [0.5, 0.5, 0.5], [3.0, 1.0, 0.2], [2.0, 0.5, 0.1]


def test_definitions_by_hand():
    # T_BP^3 = 4.5 + 3 + 2 = 9.5; T_BP^2 = 7 + 1 + .5 = 8.5; T_BP^1 = 8.5 + .2 + .1 = 8.8
    assert layer_completion_times(BP, AS, AA, BC) == pytest.approx([9.5, 8.5, 8.8])
    assert cgdp_backward_time(BP, AS, AA, BC) == pytest.approx(9.5)  # Definition 3.3: the max
    assert backprop_time(BP) == 7.0  # Definition 3.1
    assert typical_backward_time(BP, AA, BC) == pytest.approx(7 + 4.2 + 2.6)  # Definition 3.4


def test_overheads_and_win_condition():
    assert typical_overhead(AA, BC) == pytest.approx(6.8)  # T'_O = Σ (t_aa + t_bc)
    assert cgdp_overhead(AS, AA, BC) == pytest.approx(1.5 + 0.2 + 0.1)  # Σ t_as + t_aa^1 + t_bc^1
    assert cgdp_exact_overhead(BP, AS, AA, BC) == pytest.approx(9.5 - 7.0)
    assert cgdp_wins(AS, AA, BC)
    assert paper_win_condition(AS, AA, BC)  # 1.5 < (3 + 1) + (2 + .5)
    many_syncs = [3.0] * 3
    assert not cgdp_wins(many_syncs, AA, BC) and not paper_win_condition(many_syncs, AA, BC)


def test_no_layers_and_bad_input():
    assert cgdp_backward_time([], [], [], []) == 0.0
    with pytest.raises(ValueError, match="backward order"):
        cgdp_backward_time([1.0], [1.0, 2.0], [1.0], [1.0])
    with pytest.raises(ValueError, match="non-negative"):
        typical_backward_time([-1.0], [0.0], [0.0])


def test_chunk_times_sum_layers_and_pay_one_sync():
    ct = chunk_times([2, 1], BP, 0.5, AA, BC)
    assert ct == ChunkTimes([6.0, 1.0], [0.5, 0.5], [4.0, 0.2], [2.5, 0.1])
    # §4.1: fewer chunks, fewer syncs; the chunk's host work starts after its last layer
    assert cgdp_backward_time(*ct.__dict__.values()) == pytest.approx(max(6.5 + 4 + 2.5, 7.5 + .3))


def test_simulator_without_queueing_is_definition_3_3():
    """With stages so short that nothing ever queues, the flow shop is the paper's max formula."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 8))
        bp = rng.uniform(1, 2, n)
        d2h, acc, h2d = (rng.uniform(0, 0.3, n) for _ in range(3))
        p = np.stack([bp + 0.1, d2h, acc, np.zeros(n), np.zeros(n), h2d], axis=1)  # no comm, no DRAM limit
        # the paper's t_aa is the send plus the accumulation (step B-4-2)
        assert chain_makespan(p) == pytest.approx(cgdp_backward_time(bp, [0.1] * n, d2h + acc, h2d))
