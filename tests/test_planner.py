"""The planner's DP is optimal: checked against brute force over all 2^(l-1) plans."""
import numpy as np
import pytest

from cgdp.planning.chunks import paper_plan
from cgdp.planning.costs import Linear, ModelCosts, StageCosts
from cgdp.planning.flowshop import plan_of
from cgdp.planning.planner import all_sizes, best_uniform, brute_force, byte_bucket_sizes, choose_plan, dp_plan
from cgdp.planning.simulator import predict_step, simulate


def random_case(rng, L):
    model = ModelCosts([int(b) for b in rng.integers(1_000, 8_000_000, L)], list(rng.uniform(1e-4, 4e-3, L)),
                       forward_s=0.01, update_s=0.002, other_s=0.001, tail_s=float(rng.uniform(0, 3e-3)))
    G = int(rng.integers(1, 5))
    costs = StageCosts(devices=G, sync_s=float(rng.uniform(0, 2e-3)),
                       d2h=Linear.from_bandwidth(rng.uniform(0.5, 12), rng.uniform(0, 5e-5)),
                       h2d=Linear.from_bandwidth(rng.uniform(0.5, 12), rng.uniform(0, 5e-5)),
                       acc=Linear.from_bandwidth(rng.uniform(0.5, 10), rng.uniform(0, 1e-4)),
                       ranks=int(rng.integers(1, 3)), comm=Linear(1e-4, 1 / rng.uniform(1e9, 1e10)),
                       link_groups=[[0, 1], [2, 3]] if G == 4 and rng.random() < 0.5 else None)
    return model, costs


def test_all_sizes_counts_proposition_4_1():
    for L in range(1, 9):
        plans = list(all_sizes(L))
        assert len(plans) == 2 ** (L - 1) and len({tuple(p) for p in plans}) == len(plans)
        assert all(sum(p) == L for p in plans)


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    model, costs = random_case(rng, int(rng.integers(1, 11)))
    plan, t, exact = dp_plan(model, costs)
    best_plan, best_t = brute_force(model, costs)
    assert exact
    assert t == pytest.approx(best_t, rel=1e-12, abs=1e-15)
    assert simulate(model, costs, plan).step_s == pytest.approx(t, rel=1e-12)  # the event simulation agrees


def test_dp_not_worse_than_uniform_on_deep_model():
    rng = np.random.default_rng(7)
    model, _ = random_case(rng, 120)
    costs = StageCosts(devices=4, sync_s=3e-4, d2h=Linear.from_bandwidth(12, 1e-5), h2d=Linear.from_bandwidth(12, 1e-5),
                       acc=Linear.from_bandwidth(6, 2e-5))
    choice = choose_plan(model, costs, max_front=16)
    k, _, t_uniform = best_uniform(model, costs)
    assert choice.predicted_s <= t_uniform + 1e-12
    assert choice.predicted_s == pytest.approx(predict_step(model, costs, choice.plan))
    assert sorted(x for ch in choice.plan for x in ch) == list(range(120))


def test_uniform_plans_are_the_papers():
    model = ModelCosts([4] * 10, [1e-3] * 10)
    assert plan_of(model, [len(c) for c in paper_plan(10, 3)]) == paper_plan(10, 3)


def test_byte_buckets():
    model = ModelCosts([10, 10, 30, 5, 5, 50], [0.0] * 6)  # backward order: 50, 5, 5, 30, 10, 10
    assert byte_bucket_sizes(model, 40) == [1, 3, 2]
    assert byte_bucket_sizes(model, 40, tail_singles=2) == [1, 3, 1, 1]
