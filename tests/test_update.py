"""Clipping, micro-batches, schedulers and the hyperparameter check, against single-device training."""
import copy

import pytest
import torch
import torch.nn.functional as F

import cgdp
from cgdp.engine.trainer.hyperparameters import HyperparameterMismatchError
from helpers import Gated, assert_params_close, assert_replicas_identical, mlp
from test_comm_inproc import on_ranks
from cgdp.testing import inside

SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
STEP_LR = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
MAX_NORM = 0.05  # the MLP's gradient norm is ~0.3-1: every step clips


def devs(g):
    return [f"cpu:{i}" for i in range(g)]


def batches(n_steps, n, seed=1, features=12):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, features, generator=g), torch.randint(0, 5, (n,), generator=g))
            for _ in range(n_steps)]


def reference(model, make_opt, data, *, clip=None, scheduler=None):
    """Single-device autograd training with torch's own clipping and scheduler; the norms."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    sched = scheduler(opt) if scheduler else None
    norms, losses = [], []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return model, norms, losses


def train(model, make_opt, devices, data, **kw):
    with cgdp.Trainer(copy.deepcopy(model), make_opt, devices, **kw) as tr:
        norms, losses = [], []
        for x, y in data:
            losses.append(tr.step(x, y, F.cross_entropy))
            norms.append(tr.stats.get("grad_norm"))
            assert_replicas_identical(tr)
        return copy.deepcopy(tr.replicas[0]), norms, losses, tr.state_dict()


# ---------------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("mode,g", [("cgdp", 1), ("cgdp", 2), ("cgdp", 3), ("cgdp", 4),
                                    ("typical", 3), ("single", 1)])
def test_clipping_equals_clip_grad_norm_on_one_device(mode, g):
    model, data = mlp(), batches(4, 10)  # 10 samples: uneven across 3 and 4 devices
    ref, ref_norms, _ = reference(model, SGD, data, clip=MAX_NORM)
    assert all(n > 5 * MAX_NORM for n in ref_norms)  # clipping really happens
    got, norms, _, _ = train(model, SGD, devs(g), data, mode=mode, clip_grad_norm=MAX_NORM, chunks=2)
    assert_params_close(got, ref)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    unclipped, _, _ = reference(model, SGD, data)
    with pytest.raises(AssertionError):  # the test can tell clipped from unclipped training
        assert_params_close(got, unclipped)


@pytest.mark.parametrize("max_norm", [1e6, float("inf")])
def test_clipping_above_the_norm_changes_nothing(max_norm):
    model, data = mlp(), batches(2, 9)
    ref, ref_norms, _ = reference(model, SGD, data, clip=max_norm)
    got, norms, _, _ = train(model, SGD, devs(2), data, clip_grad_norm=max_norm)
    assert_params_close(got, reference(model, SGD, data)[0])
    assert norms == pytest.approx(ref_norms, rel=1e-5)


@pytest.mark.parametrize("micro", [1, 2])
def test_host_norm_is_the_global_norm_across_ranks(micro):
    """2 in-process ranks × 2 devices, 11 samples: the norm is that of the allreduced gradient
    (also with micro-batches)."""
    model, data = mlp(), batches(3, 11)
    ref, ref_norms, _ = reference(model, SGD, data, clip=MAX_NORM)

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, devs(2), comm=comm, timeout_s=30,
                          clip_grad_norm=MAX_NORM,
                          chunks=1, micro_batches=micro) as tr:
            norms = []
            for x, y in data:
                tr.step(torch.tensor_split(x, 2)[comm.rank], torch.tensor_split(y, 2)[comm.rank],
                        F.cross_entropy)
                norms.append(tr.stats["grad_norm"])
            return {k: v.clone() for k, v in tr.replicas[0].state_dict().items()}, norms

    (sd0, n0), (sd1, n1) = on_ranks(2, rank, timeout_s=30)
    assert n0 == n1 and n0 == pytest.approx(ref_norms, rel=1e-5)
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), f"ranks differ in {k}"
    got = mlp()
    got.load_state_dict(sd0)
    assert_params_close(got, ref)


def test_bad_clip_value_is_refused():
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="clip_grad_norm must be a positive"):
            cgdp.Trainer(mlp(), SGD, devs(1), clip_grad_norm=bad)


# ---------------------------------------------------------------------------------- micro-batches
@pytest.mark.parametrize("mode,g,k", [("cgdp", 1, 3), ("cgdp", 2, 2), ("cgdp", 3, 2), ("cgdp", 4, 3),
                                      ("typical", 3, 2), ("single", 1, 4)])
def test_micro_batches_equal_one_device_on_the_global_batch(mode, g, k):
    model, data = mlp(), batches(3, 26)  # uneven across devices and across micro-batches
    ref, _, ref_losses = reference(model, ADAM, data)
    got, _, losses, _ = train(model, ADAM, devs(g), data, mode=mode, micro_batches=k, chunks=1)
    assert_params_close(got, ref)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_micro_batches_with_clipping_and_data_dependent_layers():
    """``Gated.extra`` runs only on some samples: here only in early micro-batches."""
    model = Gated()
    g = torch.Generator().manual_seed(2)
    data = []
    for _ in range(3):
        x = torch.randn(12, 6, generator=g)
        x[1, 0] = 200.0  # device 0's first micro-batch only
        data.append((x, torch.randn(12, 4, generator=g)))
    ref = copy.deepcopy(model)
    opt = SGD(ref.parameters())
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], MAX_NORM)
        opt.step()
    with cgdp.Trainer(copy.deepcopy(model), SGD, devs(2), micro_batches=3, clip_grad_norm=MAX_NORM) as tr:
        for x, y in data:
            tr.step(x, y, F.mse_loss)
            assert_replicas_identical(tr)
        assert tr.replicas[0].never.weight.grad is None
        assert_params_close(tr.replicas[0], ref)


def test_chunks_travel_in_the_last_micro_batch_only():
    model, data = mlp(), batches(1, 12)
    with cgdp.Trainer(copy.deepcopy(model), SGD, devs(2), micro_batches=3, chunks=1) as tr:
        sends = []
        for j, dev in enumerate(inside(tr).devices):
            def send(*args, _orig=dev.send, _j=j):
                sends.append((_j, inside(tr).stream.hooks[_j].mode.streaming))
                return _orig(*args)
            dev.send = send
        tr.step(*data[0], F.cross_entropy)
        # each device sends each of the 4 chunks once, all during the streaming (last) backward
        assert sorted(sends) == [(0, True)] * 4 + [(1, True)] * 4


def test_micro_batches_need_enough_samples():
    with cgdp.Trainer(mlp(), SGD, devs(2), micro_batches=4) as tr:
        with pytest.raises(ValueError, match="at least 4 samples on every device"):
            tr.step(torch.randn(7, 12), torch.randint(0, 5, (7,)), F.cross_entropy)
        tr.step(torch.randn(8, 12), torch.randint(0, 5, (8,)), F.cross_entropy)  # still usable
    with pytest.raises(ValueError, match="micro_batches must be an int"):
        cgdp.Trainer(mlp(), SGD, devs(1), micro_batches=0)


# ---------------------------------------------------------------------------------- schedulers
@pytest.mark.parametrize("g", [1, 3])
def test_scheduler_equals_one_device_and_is_saved(g):
    model, data = mlp(), batches(5, 10)
    ref, _, _ = reference(model, SGD, data, scheduler=STEP_LR)
    got, _, _, state = train(model, SGD, devs(g), data, scheduler=STEP_LR)
    assert_params_close(got, ref)
    assert state["scheduler"]["last_epoch"] == 5
    # resumed from a checkpoint after 3 steps, it ends where uninterrupted training ends
    with cgdp.Trainer(copy.deepcopy(model), SGD, devs(g), scheduler=STEP_LR) as tr:
        for x, y in data[:3]:
            tr.step(x, y, F.cross_entropy)
        mid = copy.deepcopy(tr.state_dict())
    with cgdp.Trainer(copy.deepcopy(model), SGD, devs(g), scheduler=STEP_LR) as tr:
        tr.load_state_dict(mid)
        assert [o.param_groups[0]["lr"] for o in tr.optimizers] == [0.05 * 0.5] * g
        for x, y in data[3:]:
            tr.step(x, y, F.cross_entropy)
        assert_params_close(tr.replicas[0], ref)


def test_scheduler_does_not_step_after_a_rejected_update():
    model = mlp()
    with cgdp.Trainer(copy.deepcopy(model), SGD, devs(2), scheduler=STEP_LR) as tr:
        x, y = batches(1, 8)[0]
        bad = x.clone()
        bad[0, 0] = float("nan")
        with pytest.raises(cgdp.NonFiniteGradientError):
            tr.step(bad, y, F.cross_entropy)
        assert tr.state_dict()["scheduler"]["last_epoch"] == 0
        tr.step(x, y, F.cross_entropy)
        assert tr.state_dict()["scheduler"]["last_epoch"] == 1


def test_scheduler_must_be_a_factory():
    with pytest.raises(TypeError, match="scheduler must be a callable"):
        cgdp.Trainer(mlp(), SGD, devs(1), scheduler="cosine")
    with pytest.raises(TypeError, match="must return a learning-rate scheduler"):
        cgdp.Trainer(mlp(), SGD, devs(1), scheduler=lambda opt: 3)


# ---------------------------------------------------------------------------------- hyperparameters
def test_changing_one_replica_only_is_an_error_and_the_trainer_stays_usable():
    model, data = mlp(), batches(2, 8)
    with cgdp.Trainer(copy.deepcopy(model), SGD, devs(3)) as tr:
        tr.step(*data[0], F.cross_entropy)
        before = copy.deepcopy(tr.replicas[0].state_dict())
        tr.optimizers[0].param_groups[0]["lr"] = 0.01
        with pytest.raises(HyperparameterMismatchError, match=r"optimizers\[1\].*'lr'.*scheduler="):
            tr.step(*data[1], F.cross_entropy)
        for k, v in tr.replicas[0].state_dict().items():
            assert torch.equal(v, before[k])  # not applied
        for opt in tr.optimizers:
            opt.param_groups[0]["lr"] = 0.01  # the fix the message names
        tr.step(*data[1], F.cross_entropy)
        assert_replicas_identical(tr)
        tr.optimizers[2].param_groups[0]["momentum"] = 0.5
        with pytest.raises(ValueError, match=r"optimizers\[2\].*'momentum'"):
            tr.step(*data[1], F.cross_entropy)


def test_ranks_with_different_hyperparameters_reject_the_step_together():
    model, data = mlp(), batches(2, 8)

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, devs(2), comm=comm, timeout_s=30) as tr:
            x, y = (torch.tensor_split(t, 2)[comm.rank] for t in data[0])
            tr.step(x, y, F.cross_entropy)
            if comm.rank == 1:
                for opt in tr.optimizers:
                    opt.param_groups[0]["lr"] = 0.01  # every replica of rank 1, not rank 0's
            with pytest.raises(HyperparameterMismatchError, match="differ between MPI ranks"):
                tr.step(x, y, F.cross_entropy)
            tr.optimizers[1].param_groups[0]["lr"] = 0.02  # now one replica of every rank
            with pytest.raises(HyperparameterMismatchError, match=r"optimizers\[1\]"):
                tr.step(x, y, F.cross_entropy)
            for opt in tr.optimizers:
                opt.param_groups[0]["lr"] = 0.02
            tr.step(x, y, F.cross_entropy)  # agreed again: training goes on
            return {k: v.clone() for k, v in tr.replicas[0].state_dict().items()}

    sd0, sd1 = on_ranks(2, rank, timeout_s=30)
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k])


def test_scheduler_in_typical_mode():
    model, data = mlp(), batches(4, 10)
    ref, _, _ = reference(model, SGD, data, scheduler=STEP_LR)
    got, _, _, _ = train(model, SGD, devs(3), data, mode="typical", scheduler=STEP_LR)
    assert_params_close(got, ref)


def test_split_tree_splits_batch_tensors_and_keeps_the_rest_whole():
    from cgdp.engine.trainer.batch import micro_rounds, split_tree
    mask = torch.ones(3, 3)  # not batch-sized: goes whole
    tree = {"ids": torch.arange(7), "pair": (torch.arange(14).reshape(7, 2), "tag"), "mask": mask}
    pieces = split_tree(tree, 7, 3)
    assert [p["ids"].tolist() for p in pieces] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [p["pair"][0][:, 0].tolist() for p in pieces] == [[0, 2, 4], [6, 8], [10, 12]]
    assert all(p["pair"][1] == "tag" and p["mask"] is mask for p in pieces)
    rounds = micro_rounds([torch.arange(5), torch.arange(4)], [5, 4], 9, 2)
    assert [w for _, w in rounds] == [[3 / 9, 2 / 9], [2 / 9, 2 / 9]]  # tensor_split's sizes / N


def test_reduce_lr_on_plateau_is_stepped_by_the_user_on_every_replica():
    plateau = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)  # noqa: E731
    with cgdp.Trainer(mlp(), SGD, devs(2), scheduler=plateau) as tr:
        for x, y in batches(3, 8):
            tr.step(x, y, F.cross_entropy)  # not stepped here: it needs a metric
            for s in tr.schedulers:
                s.step(1.0)  # a metric that never improves: halve after the first
        assert [o.param_groups[0]["lr"] for o in tr.optimizers] == [0.05 / 4] * 2
