"""The comm contract on in-process ranks (threads), and the engine's multi-rank logic without mpiexec."""
from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cgdp
from cgdp.comm.inproc import InProcGroup
from cgdp.comm.mpi import describe_mismatch, probe_alpha_beta
from cgdp.comm.ordered import CommFailed
from helpers import assert_params_close, assert_replicas_identical, mlp, reference


def on_ranks(size: int, fn, timeout_s: float = 20.0):
    """Run ``fn(comm)`` on ``size`` in-process ranks at once; their results in rank order."""
    group = InProcGroup(size, timeout_s=timeout_s)
    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(fn, c) for c in group.comms()]
        out = [f.result(timeout=60) for f in futures]
    for c in group.comms():
        c.close()
    return out


def test_chunks_sum_in_place_in_post_order_on_the_comm_thread():
    n_chunks, r_size = 6, 3

    def rank(comm):
        rng = np.random.default_rng(comm.rank)
        acc = rng.standard_normal(1000).astype(np.float32)
        before = acc.copy()
        bounds = [(0, 10), (10, 11), (11, 400), (400, 401), (401, 999), (999, 1000)]
        done: list[tuple[int, str]] = []
        for k, (lo, hi) in enumerate(bounds):
            comm.post(k, acc[lo:hi], lambda k=k: done.append((k, threading.current_thread().name)))
        comm.fence(10)
        return before, acc, done

    res = on_ranks(r_size, rank)
    expect = res[0][0].copy()
    for before, _, _ in res[1:]:
        expect += before  # rank order, as the group sums
    for r, (_, acc, done) in enumerate(res):
        assert np.array_equal(acc, expect), f"rank {r} differs"  # bitwise identical on all ranks
        assert [k for k, _ in done] == list(range(n_chunks))
        assert {name for _, name in done} == {f"cgdp-comm-r{r}"}


def test_small_collectives_broadcast_and_check_same():
    def rank(comm):
        total = comm.allreduce_small(np.array([comm.rank + 1.0, 2.0]))
        plan = comm.broadcast_object([[3, 2], [1], [0]] if comm.rank == 0 else "ignored")
        comm.check_same({"layers": "a:4;b:8", "devices_per_rank": "2"})
        return total, plan

    for total, plan in on_ranks(3, rank):
        assert total.tolist() == [6.0, 6.0]
        assert plan == [[3, 2], [1], [0]]


def test_check_same_names_the_rank_and_field_that_differ():
    def rank(comm):
        sig = {"layers": "a:4;b:8", "devices_per_rank": "2" if comm.rank != 2 else "4"}
        with pytest.raises(RuntimeError) as err:
            comm.check_same(sig)
        return str(err.value)

    for message in on_ranks(3, rank):  # every rank raises the same words
        assert "rank 2" in message and "devices_per_rank" in message
        assert "'2'" in message and "'4'" in message and "rank 1 " not in message


def test_describe_mismatch_agrees_and_reports_missing_fields():
    same = {"signature": {"a": "1"}, "world_size": "2"}
    assert describe_mismatch([same, dict(same)]) is None
    msg = describe_mismatch([same, {"signature": {}, "world_size": "3", "host": "h", "pid": 7}])
    assert "rank 1 (host h, pid 7)" in msg and "<missing>" in msg and "world size" in msg


def test_a_rank_that_stops_gives_timeout_naming_chunk_and_rank():
    failures: list[BaseException] = []

    def rank(comm):
        comm.attach(failures.append)
        buf = np.ones(8, np.float32)
        if comm.rank == 1:
            return None  # this rank "dies": it never posts
        comm.post(0, buf, lambda: None)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            comm.fence(0.5)
        waited = time.monotonic() - t0
        with pytest.raises(CommFailed):
            comm.post(1, buf, lambda: None)  # out of step for good
        return str(err.value), waited

    message, waited = on_ranks(2, rank, timeout_s=0.5)[0]
    assert "rank 0 of 2" in message and "chunk 0" in message and "step 0" in message
    assert "[1] never posted it" in message
    assert waited < 30  # the 0.5 s fence timed out (a bound against a hang, not a speed test)
    assert failures and isinstance(failures[0], TimeoutError)


def test_small_collective_timeout_names_the_missing_rank():
    def rank(comm):
        if comm.rank == 0:
            with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] never joined"):
                comm.allreduce_small(np.zeros(2))

    on_ranks(2, rank, timeout_s=0.3)


def test_ranks_running_different_plans_are_caught():
    def rank(comm):
        comm.post(comm.rank, np.ones(4, np.float32), lambda: None)  # chunk 0 vs chunk 1
        with pytest.raises(CommFailed, match="different chunk plans"):
            comm.fence(5)

    on_ranks(2, rank)


def test_probe_alpha_beta_fits_positive_costs():
    alpha, beta = on_ranks(2, lambda c: probe_alpha_beta(c, reps=2))[0]
    assert alpha >= 0 and beta > 0


# ---------------------------------------------------------------------- the engine on in-process ranks
SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731


def _global_batches(n_steps, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g))
            for _ in range(n_steps)]


@pytest.mark.parametrize("chunks", [1, 2])
def test_two_ranks_two_devices_equal_single_device_training(chunks):
    """R=2 ranks × G=2 devices, uneven parts (11 samples), against autograd on the global batch."""
    model = mlp()
    data = _global_batches(3, 11)
    ref, ref_losses = reference(model, SGD, data, F.cross_entropy)

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, ["cpu:0", "cpu:1"], chunks=chunks, comm=comm,
                          timeout_s=30) as tr:
            losses = []
            for x, y in data:
                xs = torch.tensor_split(x, comm.size)[comm.rank]
                ys = torch.tensor_split(y, comm.size)[comm.rank]
                losses.append(tr.step(xs, ys, F.cross_entropy))
                assert_replicas_identical(tr)
            return {k: v.clone() for k, v in tr.replicas[0].state_dict().items()}, losses

    (sd0, l0), (sd1, l1) = on_ranks(2, rank, timeout_s=30)
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), f"ranks differ in {k}"
    got = mlp()
    got.load_state_dict(sd0)
    assert_params_close(got, ref)
    assert l0 == l1 and l0 == pytest.approx(ref_losses, rel=1e-5)


def test_ranks_with_different_initial_parameters_are_named_at_start_up():
    def rank(comm):
        try:
            cgdp.Trainer(mlp(seed=comm.rank), SGD, ["cpu:0"], comm=comm, timeout_s=10)
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    for msg in on_ranks(2, rank):
        assert "initial_parameters" in msg


@pytest.mark.parametrize("face, setting, values", [
    ("Trainer", "grad_transfer", (None, "bf16")),
    ("Trainer", "update", ("devices", "host")),
    ("Trainer", "segment_bytes", (4 << 20, 1 << 12)),
    ("Trainer", "host_memory", (None, 1 << 20)),
    ("Trainer", "clip_grad_norm", (None, 1.0)),
    ("Trainer", "micro_batches", (1, 2)),
    ("DataParallel", "update", ("devices", "host")),
    ("DataParallel", "segment_bytes", (4 << 20, 1 << 12)),
    ("DataParallel", "host_memory", (None, 1 << 20)),
    ("DataParallel", "scalar_outputs", ("auto", "sum")),
])
def test_ranks_started_with_different_settings_fail_at_start_up_naming_the_setting(face, setting, values):
    """A setting that changes what crosses the wire or what a step computes must agree on every rank: a rank started
    differently fails on every rank, with words naming the setting and the rank (it would otherwise train apart)."""
    def rank(comm):
        kwargs = {setting: values[comm.rank]}
        try:
            if face == "Trainer":
                cgdp.Trainer(mlp(), SGD, ["cpu:0"], comm=comm, timeout_s=10, **kwargs).close()
            else:
                cgdp.DataParallel(mlp(), ["cpu:0"], comm=comm, timeout_s=10, **kwargs).close()
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    for msg in on_ranks(2, rank):
        assert f"setting {setting}" in msg and "rank 1" in msg, msg


def test_auto_tuner_learns_the_mpi_stage_from_the_probe():
    model = mlp()

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, ["cpu:0"], chunks="auto", comm=comm, timeout_s=30) as tr:
            return tr.tuner.comm, tr.tuner.ranks

    (c0, r0), (c1, r1) = on_ranks(2, rank, timeout_s=30)
    assert r0 == r1 == 2
    assert c0 == c1 and c0.latency_s > 0 and c0.per_byte_s >= 0  # rank 0's fit, on every rank


def test_non_finite_gradient_on_one_rank_is_rejected_on_every_rank_and_training_goes_on():
    model = mlp()
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, ["cpu:0", "cpu:1"], comm=comm, timeout_s=30) as tr:
            bad = x.clone()
            if comm.rank == 1:
                bad[0, 0] = float("nan")
            try:
                tr.step(bad, y, F.cross_entropy)
                return "no error"
            except cgdp.NonFiniteGradientError:
                pass
            tr.step(x, y, F.cross_entropy)  # still usable, and the ranks still agree
            return {k: v.clone() for k, v in tr.replicas[0].state_dict().items()}

    a, b = on_ranks(2, rank, timeout_s=30)
    assert a != "no error" and b != "no error"
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Tempered(torch.nn.Module):
    """A model with a parameter the loss reads directly (not through the gathered output)."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.temp = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.body(x)


def _dp_loss(model, module, x, y):
    penalty = 1e-2 * sum((p * p).sum() for p in module.body.parameters())
    return F.cross_entropy(model(x) * module.temp, y) + penalty


def test_dataparallel_ranks_average_gradient_reaching_replica_0_outside_the_output():
    """Every rank's gradient is averaged over ranks (as DDP), also a weight penalty's and a parameter's that only the
    loss reads, whose gradient hook then runs once per backward, in autograd (on the rank's part, as DDP's); input
    gradients stay the rank's own. Equal to one device on the global batch; ranks bitwise identical."""
    torch.manual_seed(0)
    model = _Tempered()
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))
    ref = copy.deepcopy(model)
    ref.temp.register_hook(lambda g: g * 2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        _dp_loss(ref, ref, x, y).backward()
        opt.step()
    xr = x[8:].clone().requires_grad_()
    F.cross_entropy(ref(xr) * ref.temp, y[8:]).backward()  # rank 1's local input gradient, after the steps

    def rank(comm):
        calls = []
        m = cgdp.DataParallel(copy.deepcopy(model), ["cpu:0", "cpu:1"], comm=comm, timeout_s=30)
        m.module.temp.register_hook(lambda g: calls.append(1) or g * 2)
        dp_opt = m.bind(torch.optim.SGD(m.parameters(), lr=0.1))
        part = slice(8 * comm.rank, 8 * comm.rank + 8)
        for _ in range(3):
            dp_opt.zero_grad()
            _dp_loss(m, m.module, x[part], y[part]).backward()
            dp_opt.step()
        xi = x[part].clone().requires_grad_()
        F.cross_entropy(m(xi) * m.module.temp, y[part]).backward()
        out = copy.deepcopy(m.module)
        m.close()
        return out, len(calls), xi.grad

    (m0, calls0, _), (m1, calls1, grad1) = on_ranks(2, rank, timeout_s=60)
    assert calls0 == calls1 == 4
    for a, b in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(a, b)
    assert_params_close(m0, ref, rtol=1e-5)
    torch.testing.assert_close(grad1, xr.grad, rtol=1e-5, atol=1e-7)


def test_a_hooked_parameters_gradient_from_an_earlier_backward_is_not_hooked_again():
    """``penalty.backward()`` on replica 0's parameter, then a backward through the model: the hook ran on the
    penalty's part in autograd and runs on the model's sum alone, as on one device; with ranks the penalty's parts are
    averaged over them (and the ranks stay identical)."""
    torch.manual_seed(0)
    base = mlp()
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))
    first = lambda m: next(m.parameters())  # noqa: E731
    penalty = lambda m: 0.1 * (first(m) ** 2).sum()  # noqa: E731
    ref = copy.deepcopy(base)
    first(ref).register_hook(lambda g: g * 2)
    penalty(ref).backward()
    F.cross_entropy(ref(x), y).backward()

    def run(comm, part):
        m = cgdp.DataParallel(copy.deepcopy(base), ["cpu:0", "cpu:1"], comm=comm, timeout_s=30)
        first(m.module).register_hook(lambda g: g * 2)
        penalty(m.module).backward()  # reaches replica 0's parameter only, outside the engine's backward
        F.cross_entropy(m(x[part]), y[part]).backward()
        grad = first(m.module).grad.clone()
        m.close()
        return grad

    one = run(None, slice(None))
    g0, g1 = on_ranks(2, lambda comm: run(comm, slice(8 * comm.rank, 8 * comm.rank + 8)), timeout_s=60)
    assert torch.equal(g0, g1)
    for g in (one, g0):
        torch.testing.assert_close(g, first(ref).grad, rtol=1e-5, atol=1e-6)


def test_dataparallel_with_ranks_refuses_buffers_that_require_grad():
    """Their gradients would stay each rank's own (only parameters' are averaged over ranks): refused, with what to do."""
    net = mlp()
    net.register_buffer("shift", torch.zeros(12, requires_grad=True))

    def rank(comm):
        try:
            cgdp.DataParallel(net, ["cpu:0"], comm=comm, timeout_s=10).close()
        except NotImplementedError as exc:
            return str(exc)
        return "no error"

    for msg in on_ranks(2, rank):
        assert "buffers that require grad" in msg and "nn.Parameter" in msg, msg


def test_dataparallel_with_ranks_refuses_a_trainable_parameter_outside_it():
    """Its gradient would stay the rank's own (only the model's are averaged over ranks): refused at bind on every rank
    alike; a frozen one outside is fine."""
    torch.manual_seed(0)
    net, head = mlp(), torch.nn.Linear(5, 3)

    def rank(comm):
        with cgdp.DataParallel(copy.deepcopy(net), ["cpu:0"], comm=comm, timeout_s=30) as model:
            h = copy.deepcopy(head)
            with pytest.raises(ValueError, match="trainable parameters outside the cgdp.DataParallel .* this rank's "
                                                 "own"):
                model.bind(torch.optim.SGD([*model.parameters(), *h.parameters()], lr=0.1))
            h.requires_grad_(False)
            opt = model.bind(torch.optim.SGD([*model.parameters(), *h.parameters()], lr=0.1))
            F.cross_entropy(h(model(torch.randn(4, 12))), torch.tensor([0, 1, 2, 0])).backward()
            opt.step()
            return [p.detach().clone() for p in model.parameters()]

    r0, r1 = on_ranks(2, rank, timeout_s=60)
    assert all(torch.equal(a, b) for a, b in zip(r0, r1))
