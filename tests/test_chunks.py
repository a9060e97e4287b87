import pytest

import cgdp
from cgdp.planning.chunks import validate_plan


def test_paper_plan_formulas():
    # 8 mod 3 != 0: floor(8/3)=2 chunks of 3, then 8 mod 3 = 2 chunks of 1
    assert cgdp.paper_plan(8, 3) == [[7, 6, 5], [4, 3, 2], [1], [0]]
    # 6 mod 3 == 0: 6/3-1 = 1 chunk of 3, then 3 chunks of 1
    assert cgdp.paper_plan(6, 3) == [[5, 4, 3], [2], [1], [0]]
    assert cgdp.paper_plan(4, 1) == [[3], [2], [1], [0]]
    # k >= L: the formulas give only chunks of size 1
    assert cgdp.paper_plan(3, 3) == [[2], [1], [0]]
    assert cgdp.paper_plan(3, 10) == [[2], [1], [0]]
    assert cgdp.paper_plan(10, 4) == [[9, 8, 7, 6], [5, 4, 3, 2], [1], [0]]


@pytest.mark.parametrize("L", range(1, 30))
@pytest.mark.parametrize("k", [1, 2, 3, 5, 7, 40])
def test_paper_plan_is_a_partition_in_backward_order(L, k):
    plan = cgdp.paper_plan(L, k)
    flat = [i for c in plan for i in c]
    assert flat == list(range(L - 1, -1, -1))
    sizes = [len(c) for c in plan]
    big = L // k - 1 if L % k == 0 else L // k
    assert sizes == [k] * max(big, 0) + [1] * (L - k * max(big, 0))


@pytest.mark.parametrize("k", [0, -2])
def test_paper_plan_rejects_k_below_one(k):
    with pytest.raises(ValueError, match="k must be >= 1"):
        cgdp.paper_plan(5, k)


def test_paper_plan_rejects_non_int():
    with pytest.raises(TypeError):
        cgdp.paper_plan(5, 2.5)


@pytest.mark.parametrize("plan, match", [
    ([[2, 1], [0], [3]], "layer 3"),
    ([[2, 1]], r"leaves out layer\(s\) \[0\]"),
    ([[2, 1, 0], [1]], "appears in chunk 0 and again"),
    ([[2, 1, 0], []], "empty"),
    ([[2, "1", 0]], "int"),
])
def test_validate_plan_errors(plan, match):
    with pytest.raises((ValueError, TypeError), match=match):
        validate_plan(plan, 3)
