"""Tuners and the simulator against the real engine on CPU-emulated devices."""
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.planning.calibrate import calibrate, profile_and_time
from cgdp.planning.chunks import paper_plan
from cgdp.planning.simulator import predict_step
from helpers import assert_params_close, assert_replicas_identical, mlp, reference

ADAM = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731


def batches(n, width=12, classes=5, size=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, width, generator=g), torch.randint(0, classes, (size,), generator=g))
            for _ in range(n)]


def steady_clock(tuner, fastest=3):
    """Feed the tuner a noise-free iteration time (fastest at chunk size ``fastest``) instead of the
    wall clock: Algorithm 1 then walks its documented path (chunks 1..9 at iterations 10..90, then
    10, 20, ... from iteration 100) and, for a fastest chunk below 10, stops at iteration 150 whatever
    the machine's load, while the engine still switches its real plans at every decision."""
    observe = tuner.observe

    def fake(seconds, profile=None):
        observe(1.0 + abs(tuner.search.chunk - fastest), profile)
    tuner.observe = fake


@pytest.mark.parametrize("spec, steps", [("auto", 30), ("paper", 160)])
def test_live_tuner_never_changes_the_result(spec, steps):
    """Plans switch between steps while the tuner searches; parameters still equal single-device
    training (SPEC's 1e-5) and every replica stays identical. The paper tuner's stop depends on the
    times it sees (noise on a shared runner can keep a flat curve searching), so it sees a steady
    clock; the auto tuner takes a fixed number of steps."""
    model = mlp((12, 24, 24, 24, 16, 5))
    data = batches(steps)
    ref, _ = reference(model, ADAM, data, F.cross_entropy)
    with cgdp.Trainer(model, ADAM, ["cpu:0", "cpu:1", "cpu:2"], chunks=spec) as tr:
        if spec == "paper":
            steady_clock(tr.tuner)
        plans = set()
        for x, y in data:
            plans.add(repr(tr.plan))
            tr.step(x, y, F.cross_entropy)
        # it really switched plans: the auto tuner calibrates on two (every layer alone, one chunk),
        # then measures its candidates: on some runs' measured times every alternative the planner
        # ranks is the same plan as one of those two (and the naive plan), so two plans in all
        assert tr.tuner.done and len(plans) >= (3 if spec == "paper" else 2)
        if spec == "paper":
            assert tr.tuner.search.best_chunk == 3 and tr.tuner.search.stop_iteration == 150
            assert repr(tr.plan) == repr(cgdp.paper_plan(len(tr.layers), 3))
        assert_params_close(tr.replicas[0], ref)
        assert_replicas_identical(tr)


def deep_mlp(width=256, depth=12):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def simulator_errors(rounds=9):
    """One attempt: calibrate on profiled steps of two plans, predict four other plans' step times
    and measure them (median of ``rounds``). Profiled and measured steps are interleaved round by
    round so that both see the same load. Returns the relative error per plan."""
    width, lf = 256, F.cross_entropy
    x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
    with cgdp.Trainer(deep_mlp(width), lambda p: torch.optim.SGD(p, lr=1e-3), ["cpu:0", "cpu:1"], chunks=1) as tr:
        L = len(tr.layers)
        for _ in range(3):
            tr.step(x, y, lf)
        plans = {f"k={k}": paper_plan(L, k) for k in (2, 4, 8)}
        plans["halves"] = [list(range(L - 1, L // 2 - 1, -1)), list(range(L // 2 - 1, -1, -1))]
        profiles, times = profile_and_time(tr, plans, rounds, lambda: tr.step(x, y, lf))
    cal = calibrate(profiles)
    costs = cal.costs  # as the auto tuner uses it
    errors = {}
    for name, plan in plans.items():
        measured = statistics.median(times[name])
        errors[name] = (predict_step(cal.model, costs, plan) - measured) / measured
        print(f"{name:8s} measured {measured * 1e3:7.2f} ms  predicted error {errors[name]:+.1%}")
    return errors


def test_simulator_predicts_the_engine():
    """The simulator, calibrated on the engine's own profiles, predicts its step time for plans it
    was not calibrated on: every prediction within 30%, the mean error within 20%.

    The emulated devices, the host threads and anything else running share two cores, so a burst of
    load from outside the test (a shared CI runner) can skew one attempt as a whole; the bound is
    judged on the best of up to three independent attempts (a wrong model fails all three).
    Errors are printed (pytest -s)."""
    attempts = []
    for _ in range(3):
        errors = simulator_errors()
        attempts.append((statistics.mean(abs(e) for e in errors.values()), max(abs(e) for e in errors.values())))
        if attempts[-1][0] < 0.20 and attempts[-1][1] < 0.30:
            break
    assert any(m < 0.20 and x < 0.30 for m, x in attempts), f"(mean, max) error per attempt: {attempts}"
