"""Tuners: Algorithm 1 exactly (the paper's worked example), and the model-based tuner on a
simulated machine."""
import json
import math
import re

import numpy as np
import pytest

from cgdp.planning.calibrate import synthetic_profile
from cgdp.planning.chunks import paper_plan
from cgdp.planning.costs import Linear, ModelCosts, StageCosts
from cgdp.planning.planner import best_uniform
from cgdp.planning.simulator import predict_step
from cgdp.planning.tuner import AutoTuner, AutoTunerConfig, PaperChunkSearch, PaperTuner, Tuner, make_tuner


def run_search(search, time_of_chunk, max_iters=10_000):
    chunks = []
    while not search.done and search.iteration < max_iters:
        chunks.append(search.chunk)
        search.observe(time_of_chunk(search.chunk))
    return chunks


def test_worked_example_step10_range5():
    """§5.3: best at chunk 9 (iteration 90); stops at iteration 150 and uses chunk 9."""
    s = PaperChunkSearch(step=10, range=5)
    chunks = run_search(s, lambda k: 0.1 * (1 + abs(k - 9) / 100))  # fastest at 9
    assert s.done and s.stop_iteration == 150 and s.best_chunk == 9 and s.chunk == 9
    assert [(it, k) for it, k, _ in s.history] == [
        (10, 1), (20, 2), (30, 3), (40, 4), (50, 5), (60, 6), (70, 7), (80, 8), (90, 9),
        (100, 10), (110, 20), (120, 30), (130, 40), (140, 50)]
    # iterations 141..150 ran chunk 60: the stop test (60 >= 9 + 10*5) comes before its measurement
    assert chunks[140:150] == [60] * 10 and len(chunks) == 150
    assert s.lapse_min == pytest.approx(10 * 0.1)  # lapse is the sum over the interval


def test_best_below_step_runs_step_minus_best_plus_range_more():
    """§4.2: if best_chunk < step, the search runs (step − best + range) more measurements."""
    s = PaperChunkSearch(step=10, range=5)
    run_search(s, lambda k: 1.0 + abs(k - 3))
    assert s.best_chunk == 3
    later = [k for _, k, _ in s.history if k > 3]
    assert len(later) == 10 - 3 + 5 - 1 and s.stop_iteration == (len(s.history) + 1) * 10


def test_stop_before_measurement_and_strict_improvement():
    s = PaperChunkSearch(step=1, range=2, interval=2)
    # chunk 1 measured at it 2, chunk 2 at it 4 (a tie keeps the first); at it 6 chunk 3 >= 1 + 1*2:
    # stop, and the 9 s of iterations 5-6 are never measured
    for t in [1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 9.0]:
        s.observe(t)
    assert s.done and s.stop_iteration == 6 and s.best_chunk == 1 and s.chunk == 1
    assert [k for _, k, _ in s.history] == [1, 2]


def test_search_state_round_trip_and_errors():
    a = PaperChunkSearch(4, 2, interval=3)
    for i in range(17):
        a.observe(1.0 + (i % 5) * 0.1)
    b = PaperChunkSearch(1, 1)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for i in range(40):
        a.observe(0.5 + (i % 3) * 0.2)
        b.observe(0.5 + (i % 3) * 0.2)
        assert (a.chunk, a.best_chunk, a.done) == (b.chunk, b.best_chunk, b.done)
    with pytest.raises(ValueError, match="positive int"):
        PaperChunkSearch(0, 5)
    with pytest.raises(ValueError, match="finite"):
        a.observe(math.nan)


def test_paper_tuner_drives_paper_plan():
    t = PaperTuner(30, step=10, range=5)
    assert isinstance(t, Tuner) and t.plan() == paper_plan(30, 1)
    while not t.done:
        t.observe(1.0 + abs(len(t.plan()) - 6) * 0.01)
    assert t.plan() == paper_plan(30, t.search.best_chunk)


def simulated_machine(L=40, seed=0):
    rng = np.random.default_rng(seed)
    model = ModelCosts([int(b) for b in rng.integers(50_000, 3_000_000, L)], list(rng.uniform(2e-4, 2e-3, L)),
                       forward_s=0.01, update_s=0.003)
    costs = StageCosts(devices=4, sync_s=6e-4, d2h=Linear(2e-5, 1 / 3e9), h2d=Linear(2e-5, 1 / 3e9),
                       acc=Linear(5e-5, 1 / 1.5e9))
    return model, costs


def drive(tuner, model, costs, noise=0.01, seed=1, max_steps=500):
    rng = np.random.default_rng(seed)
    steps = 0
    while not tuner.done and steps < max_steps:
        plan = tuner.plan()
        prof = synthetic_profile(model, costs, plan) if tuner.wants_profile else None
        tuner.observe(predict_step(model, costs, plan) * (1 + noise * rng.random()), prof)
        steps += 1
    return steps


def test_auto_tuner_is_fast_and_close_to_best_uniform():
    model, costs = simulated_machine()
    auto = make_tuner("auto", model.layer_bytes, 4)
    steps = drive(auto, model, costs)
    paper = make_tuner("paper", model.layer_bytes, 4)
    paper_steps = drive(paper, model, costs)
    _, _, best_uniform_s = best_uniform(model, costs)
    t_auto = predict_step(model, costs, auto.plan())
    assert steps <= 20 < paper_steps
    assert t_auto <= best_uniform_s * 1.02
    assert t_auto <= predict_step(model, costs, paper.plan()) * 1.02
    assert "auto tuner (model)" in auto.describe()


def test_a_tuner_prints_what_it_is_and_how_far_it_is():
    """``print(trainer.tuner)`` says what the tuner is doing, not ``<AutoTuner object at 0x...>``."""
    model, costs = simulated_machine(L=12)
    auto = AutoTuner(model.layer_bytes, 4)
    assert repr(auto) == "<AutoTuner for 12 layers on 4 device(s), (model): step 0 of 5>"
    drive(auto, model, costs)
    assert re.fullmatch(r"<AutoTuner for 12 layers on 4 device\(s\), \(model\): chose .+ \(\d+ chunks\) after "
                        r"\d+ steps>", repr(auto)), repr(auto)
    paper = PaperTuner(30)
    assert repr(paper) == "<PaperTuner for 30 layers: best chunk 1, searching (chunk 1)>"


def test_auto_tuner_deterministic_and_replays():
    model, costs = simulated_machine(seed=3)
    a, b = AutoTuner(model.layer_bytes, 4), AutoTuner(model.layer_bytes, 4)
    drive(a, model, costs, seed=9)
    drive(b, model, costs, seed=9)
    assert a.plan() == b.plan()
    half = AutoTuner(model.layer_bytes, 4)
    rng = np.random.default_rng(2)
    for _ in range(8):  # stop mid-way, save, restore into a fresh tuner, continue identically
        plan = half.plan()
        half.observe(predict_step(model, costs, plan) * (1 + 0.01 * rng.random()),
                     synthetic_profile(model, costs, plan) if half.wants_profile else None)
    restored = AutoTuner([1], 1)
    restored.load_state_dict(json.loads(json.dumps(half.state_dict())))
    assert restored.plan() == half.plan() and restored.wants_profile == half.wants_profile
    drive(half, model, costs, seed=4)
    drive(restored, model, costs, seed=4)
    assert half.plan() == restored.plan()


def test_auto_tuner_falls_back_without_profiles():
    model, costs = simulated_machine(L=12)
    t = AutoTuner(model.layer_bytes, 4, AutoTunerConfig(verify_rounds=2))
    steps = 0
    while not t.done:
        t.observe(predict_step(model, costs, t.plan()), None)  # the engine never profiles
        steps += 1
    assert t.method.startswith("measure-only") and steps < 20
    assert t.plan() in [paper_plan(12, k) for k in (1, 2, 4, 8, 12)]


def test_make_tuner_errors():
    with pytest.raises(ValueError, match="'auto'"):
        make_tuner("fast", [4, 4], 2)
    t = PaperTuner(3)
    assert make_tuner(t, [4, 4, 4], 2) is t
