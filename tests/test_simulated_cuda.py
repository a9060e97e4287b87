"""The CUDA backend's own code (``TorchCuda`` included), run on the strict simulated runtime (cgdp.testing).

Streams complete in random orders (seeded delays), so a copy that is not ordered by an event shows
as a wrong result; the tests that break an ordering on purpose prove that it would. The fixes of
the defects the strict simulator found are proven in ``tests/test_cuda_strict.py``.
"""
import copy
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.engine.backend import cuda as cuda_backend
from cgdp.testing import simulated_cuda
from cgdp.testing.stream_check import StreamRaceError
from helpers import SmallCNN, WithBN, assert_params_close, assert_replicas_identical, mlp, reference
from cgdp.testing import inside

SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731


def data(n_steps=3, n=11, shape=(12,), classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(n_steps)]


def train(devices, batches, model=None, opt=SGD, check=True, **kw):
    model = model or mlp()
    with cgdp.Trainer(copy.deepcopy(model), opt, devices, **kw) as tr:
        for x, y in batches:
            tr.step(x, y, F.cross_entropy)
            if check:
                assert_replicas_identical(tr)
        return tr, [p.detach().clone() for p in tr.replicas[0].parameters()]


@pytest.mark.parametrize("mode, devices, chunks", [
    ("cgdp", 2, 1), ("cgdp", 3, 2), ("cgdp", 2, "one"), ("typical", 2, 1), ("single", 1, 1),
    ("cgdp", ["cuda:0", "cuda:0", "cuda:0"], 1),  # three replicas on one GPU
])
def test_equivalence_under_simulated_cuda(mode, devices, chunks):
    batches = data()
    model = mlp()
    ref, _ = reference(model, SGD, batches, F.cross_entropy)
    n = len(set(devices)) if isinstance(devices, list) else devices
    names = devices if isinstance(devices, list) else [f"cuda:{i}" for i in range(n)]
    plan = [[3, 2, 1, 0]] if chunks == "one" else chunks
    with simulated_cuda(n, seed=1) as sim:
        tr, _ = train(names, batches, model, mode=mode, chunks=plan, segment_bytes=1024,
                      share_devices=isinstance(devices, list))
        assert_params_close(tr.replicas[0], ref)
        assert all(r.weight.device.type == "cpu" for r in tr.replicas[0] if hasattr(r, "weight"))
    assert not sim.errors
    if mode == "cgdp":
        assert sim.copied_bytes["d2h"] > 0 and sim.copied_bytes["h2d"] == sim.copied_bytes["d2h"]
    if mode == "typical":  # one coalesced reduce and one coalesced broadcast per step (item 7)
        assert sim.counts["reduce"] == len(batches)
        assert sim.counts["broadcast_coalesced"] == len(batches)


def test_cnn_with_batchnorm_and_adam_uneven_split():
    batches = data(3, n=7, shape=(1, 8, 8), classes=10)
    model = SmallCNN()
    with simulated_cuda(3, seed=2):
        ref, _ = reference(model, ADAM, batches, F.cross_entropy)
        tr, _ = train([f"cuda:{i}" for i in range(3)], batches, model, ADAM, chunks=2)
        assert_params_close(tr.replicas[0], ref)
    batches = data(2, n=9, shape=(6,), classes=3)
    model = WithBN()
    ref, _ = reference(model, SGD, batches, F.cross_entropy, n_parts=2)
    with simulated_cuda(2, seed=3):
        tr, _ = train(["cuda:0", "cuda:1"], batches, model, chunks=1)
        assert_params_close(tr.replicas[0], ref, rtol=1e-4)


def slow_stream(monkeypatch, method: str, stream: str, seconds: float = 0.05) -> None:
    """Every ``method`` call first puts ``seconds`` of work on the device's ``stream``
    (``torch.cuda._sleep``, as on a GPU), so that the copies it issues land late for sure (not
    only by the random delays' chance)."""
    real = getattr(cuda_backend.CudaDevice, method)

    def slow(self, *args, **kw):
        with self.rt.stream(getattr(self, stream)):
            self.rt.cuda._sleep(int(seconds * 1e9))
        return real(self, *args, **kw)
    monkeypatch.setattr(cuda_backend.CudaDevice, method, slow)


def test_a_missing_wait_before_the_update_shows_as_a_wrong_result(monkeypatch):
    """Break the ordering on purpose: the update no longer waits for the copies back. The
    simulator lands them late, so replicas update with their own (unaveraged) gradients."""
    batches = data(3)
    model = mlp()
    ref, _ = reference(model, SGD, batches, F.cross_entropy)
    # the right run first, with the same slow H2D stream: the wait makes it right
    slow_stream(monkeypatch, "give_back", "h2d")
    with simulated_cuda(2, seed=4, max_delay_s=0.003):
        tr, _ = train(["cuda:0", "cuda:1"], batches, model, chunks=1)
        assert_params_close(tr.replicas[0], ref)
    monkeypatch.setattr(cuda_backend.CudaDevice, "compute_wait", lambda self, marker, guard: None)
    with pytest.raises(StreamRaceError, match="reads bytes that copy_"):  # the checker sees it too
        with simulated_cuda(2, seed=4, max_delay_s=0.003) as sim:
            sim.raise_pending = lambda: None  # let the run finish, to see the wrong result first
            tr, got = train(["cuda:0", "cuda:1"], batches, model, check=False, chunks=1)
            del sim.raise_pending
    wrong = any((a - b).abs().max() > 1e-5 * b.abs().max() for a, b in zip(got, ref.parameters()))
    assert wrong, "the simulator did not catch a copy back that lands after the update"


def test_a_host_sum_before_the_copy_landed_shows_as_a_wrong_result(monkeypatch):
    """Break the other ordering: the host sums a segment as soon as every device has issued its
    copy, without waiting for the copies to land. The early sum reads slots the copies have not
    filled: wrong parameters, or NaN caught as such."""
    batches = data(2)
    model = mlp()
    ref, _ = reference(model, SGD, batches, F.cross_entropy)
    monkeypatch.setattr(cuda_backend.CudaDevice, "wait_arrived", lambda self, s, guard: None)
    slow_stream(monkeypatch, "send", "d2h")
    with simulated_cuda(2, seed=5, max_delay_s=0.003) as sim:
        sim.raise_pending = lambda: None  # the host's reads are numpy's: the checker cannot see them
        try:
            _, got = train(["cuda:0", "cuda:1"], batches, model, check=False, chunks=1)
        except cgdp.NonFiniteGradientError:
            return  # the host summed slots the copies had not filled yet (uninitialised memory)
    assert any((a - b).abs().max() > 1e-5 * b.abs().max() for a, b in zip(got, ref.parameters()))


def test_profiled_traced_and_auto_steps(monkeypatch):
    """Item 1: profiled and traced CUDA steps resolve their device events (a TypeError before)."""
    batches = data(4)
    with simulated_cuda(2, seed=6) as sim:
        with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], profile=True, chunks=1) as tr:
            for x, y in batches[:2]:
                tr.step(x, y, F.cross_entropy)
            p = tr.last_profile
            assert p is not None and len(p.chunks) == len(tr.plan)
            assert all(c.d2h_s > 0 and c.h2d_s > 0 and c.bytes > 0 for c in p.chunks)
            assert all(t >= 0 for t in p.layer_ready_s)
            tr.trace_next()
            tr.step(*batches[2], F.cross_entropy)
            kinds = {(e["device"], e["stream"]) for e in tr.last_trace}
            assert {("cuda:0", "d2h"), ("cuda:1", "h2d"), ("cuda:0", "compute"), ("host", "accumulate")} <= kinds
            assert all(e["end"] >= e["start"] for e in tr.last_trace)
        with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks="auto") as tr:
            for _ in range(6):
                for x, y in batches:
                    tr.step(x, y, F.cross_entropy)
            assert_replicas_identical(tr)
    assert sim.counts["spin_waits"] == 0  # every host wait is on a blocking-sync event


def test_phase_times_come_from_device_events():
    """Item 2: a forward whose device work takes 60 ms is issued at once. Its device time is
    forward's, not backward's."""
    with simulated_cuda(1, seed=7, max_delay_s=0.0) as sim:
        class Slow(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(12, 5)

            def forward(self, x):
                sim.busy(0.06)  # device work; the host goes on
                return self.lin(x)
        with cgdp.Trainer(Slow(), SGD, ["cuda:0"], mode="single") as tr:
            x, y = data(1)[0]
            tr.step(x, y, F.cross_entropy)
            tr.profile_next()
            tr.step(x, y, F.cross_entropy)
            s = tr.stats
            assert s["forward_s"] >= 0.055, s
            assert s["backward_s"] < 0.03, s


def test_untimed_steps_do_not_wait_on_the_host_beyond_the_loss(monkeypatch):
    """Item 3: per step one host read of the losses (all devices at once, tests/test_cuda_syncs.py);
    the copies' completions wait on the host sum's thread; no settle, no device synchronise, no
    spinning."""
    batches = data(3)
    with simulated_cuda(2, seed=8) as sim:
        with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks=1) as tr:
            tr.step(*batches[0], F.cross_entropy)
            before = dict(sim.counts)
            tr.step(*batches[1], F.cross_entropy)
            segments = len(inside(tr).stream.layout.segments)
            diff = {k: sim.counts[k] - before.get(k, 0) for k in sim.counts}
    assert diff.get("spin_waits", 0) == 0 and diff.get("device_syncs", 0) == 0
    assert diff["host_waits"] == 2 * segments  # each segment's completion, on each device
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cuda_backend.host_threads(4) == 12  # a core left for each device thread


def test_send_costs_one_event_wait_and_context_per_chunk():
    """Item 4: per chunk one ready event, one stream wait and one context; per segment one copy
    and one completion event, none for timing in untimed steps. The events are made once per
    plan and recorded again every step: an untimed step creates none."""
    batches = data(2)
    with simulated_cuda(2, seed=9) as sim:
        with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks=1, segment_bytes=1024) as tr:
            tr.step(*batches[0], F.cross_entropy)
            before = dict(sim.counts)
            tr.step(*batches[1], F.cross_entropy)
            lay = inside(tr).stream.layout
            diff = {k: sim.counts[k] - before.get(k, 0) for k in sim.counts}
    chunks, segments, g = len(lay.plan), len(lay.segments), 2
    assert segments > chunks
    assert diff.get("events", 0) == 0
    assert diff["stream_contexts"] == g * chunks + g * segments  # d2h per chunk, h2d per segment
    assert diff["wait_event"] == g * chunks + g  # d2h on each chunk's ready event; compute on the H2D marker


def test_host_rows_are_registered_exactly_and_freed_on_close():
    """Item 5: one registration of exactly (G + 1) x the flat buffer, unregistered on close()."""
    with simulated_cuda(2) as sim:
        tr = cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"])
        total = inside(tr).stream.layout.total
        assert list(sim.registered.values()) == [3 * total * 4]
        tr.step(*data(1)[0], F.cross_entropy)
        tr.close()
        assert sim.registered == {}
        assert sim.counts["host_register"] == sim.counts["host_unregister"] == 1


class Masked(nn.Module):
    """Records the dropout mask each replica drew."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 5)
        self.mask = None

    def forward(self, x):
        h = F.dropout(torch.ones_like(x), 0.5, self.training)
        self.mask = h.detach().clone()
        return self.lin(x * h)


def test_each_cuda_replica_draws_its_own_dropout_masks():
    """Item 8: every replica gets its own random stream (not the same seed on every GPU), and
    the run is reproducible."""
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        with simulated_cuda(2, seed=10):
            with cgdp.Trainer(Masked(), SGD, ["cuda:0", "cuda:1"]) as tr:
                tr.step(x, y, F.cross_entropy)
                runs.append([r.mask for r in tr.replicas])
                assert inside(tr).rng.states[0].shape == inside(tr).rng.states[1].shape
    (a0, a1), (b0, b1) = runs
    assert not torch.equal(a0, a1), "both replicas drew the same mask"
    assert torch.equal(a0, b0) and torch.equal(a1, b1)
    g0, g1 = (cuda_backend.cuda_replica_seed(2**64 - 1, j) for j in range(2))
    assert g0 != g1 and max(g0, g1) < 2**63


def test_a_failure_on_a_stream_surfaces_and_the_trainer_recovers():
    batches = data(3)
    with simulated_cuda(2, seed=11) as sim:
        with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks=1, timeout_s=20) as tr:
            tr.step(*batches[0], F.cross_entropy)
            bad = batches[1][0].clone()
            bad[-1, 0] = float("inf")
            with pytest.raises(cgdp.NonFiniteGradientError):
                tr.step(bad, batches[1][1], F.cross_entropy)
            with pytest.raises(RuntimeError, match="boom"):
                tr.step(*batches[1], lambda o, t: (_ for _ in ()).throw(RuntimeError("boom")))
            tr.step(*batches[2], F.cross_entropy)
            assert_replicas_identical(tr)
            sim.inject_error("an illegal memory access was encountered")
            with pytest.raises(RuntimeError, match="illegal memory access"):
                tr.step(*batches[2], F.cross_entropy)
            # sticky: every later call fails, the trainer is unusable, close() reports it too
            with pytest.raises(RuntimeError, match="illegal memory access"):
                sim.cuda.Event().record()
            with pytest.raises(RuntimeError, match="cannot continue"):
                tr.step(*batches[2], F.cross_entropy)
            with pytest.raises(RuntimeError, match="illegal memory access"):
                tr.close()


def test_several_replicas_on_one_gpu_need_the_opt_in():
    with simulated_cuda(1):
        with pytest.raises(ValueError, match="share_devices=True"):
            cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:0"])
        with pytest.raises(ValueError, match="cuda:1 is not there"):
            cgdp.Trainer(mlp(), SGD, ["cuda:1"])
    with pytest.raises(ValueError, match="CPU-emulated devices are separate"):
        cgdp.Trainer(mlp(), SGD, ["cpu:0", "cpu:0"], share_devices=True)


def test_plan_switch_relays_the_flat_buffers_in_place():
    """Item 6 (on emulated devices and simulated CUDA): the same buffers, the gradients moved."""
    for devices, ctx in ((["cpu:0", "cpu:1"], None), (["cuda:0", "cuda:1"], 2)):
        sim = simulated_cuda(ctx) if ctx else None
        with (sim or _null()):
            with cgdp.Trainer(mlp(), SGD, devices, chunks=1) as tr:
                tr.step(*data(1)[0], F.cross_entropy)
                ptrs = [f.data_ptr() for f in inside(tr).stream.flats]
                grads = [p.grad.clone() for p in tr.replicas[0].parameters()]
                tr.set_plan([[3, 2], [1, 0]])
                assert [f.data_ptr() for f in inside(tr).stream.flats] == ptrs
                for p, g in zip(tr.replicas[0].parameters(), grads):
                    assert torch.equal(p.grad, g)
                    assert p.grad.data_ptr() >= ptrs[0]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_only_the_cuda_backend_touches_torch_cuda():
    """The runtime indirection holds: no code of the engine but the runtime uses ``torch.cuda``
    (the devices of ``cuda.py`` included: they call the runtime of ``cuda_runtime.py``)."""
    import ast
    import pathlib

    def uses(tree) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "cuda" and isinstance(n.value, ast.Name)
                   and n.value.id == "torch" for n in ast.walk(tree))
    engine = pathlib.Path(cgdp.__file__).parent / "engine"
    users = sorted(str(f.relative_to(engine)) for f in engine.rglob("*.py")
                   if f.name != "cuda_runtime.py" and uses(ast.parse(f.read_text())))
    assert users == [], users
    tree = ast.parse((engine / "backend" / "cuda_runtime.py").read_text())
    outside = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
               and n.name != "TorchCuda" and uses(n)]
    assert outside == [], f"{outside} must go through the runtime object"


def test_two_ranks_on_simulated_gpus_equal_single_device_training():
    """The MPI tier's engine logic (in-process ranks) over the CUDA backend: R=2 ranks x G=2
    simulated GPUs, uneven parts, against autograd on the global batch."""
    from cgdp.comm.inproc import InProcGroup
    from concurrent.futures import ThreadPoolExecutor
    model, batches = mlp(), data(3, n=11)
    ref, _ = reference(model, SGD, batches, F.cross_entropy)

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, ["cuda:0", "cuda:1"], chunks=2, comm=comm,
                          timeout_s=30) as tr:
            for x, y in batches:
                tr.step(torch.tensor_split(x, 2)[comm.rank], torch.tensor_split(y, 2)[comm.rank],
                        F.cross_entropy)
                assert_replicas_identical(tr)
            return copy.deepcopy(tr.replicas[0])

    with simulated_cuda(2, seed=12):
        group = InProcGroup(2, timeout_s=30)
        with ThreadPoolExecutor(2) as pool:
            out = [f.result(timeout=60) for f in [pool.submit(rank, c) for c in group.comms()]]
        for c in group.comms():
            c.close()
    for m in out:
        assert_params_close(m, ref)


class _Probe(threading.Thread):
    """Reads, after its target has returned, what is left on its own torch mode stacks."""

    def run(self) -> None:
        super().run()
        self.left = (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack())


def test_threads_leave_no_mode_behind_them():
    """A thread started under the simulator runs watched, and pops the modes before it ends: a mode left on a thread's
    C++ stacks is released after the join, racing the interpreter's exit (a process abort at exit, pytorch#38228)."""
    seen = []
    with simulated_cuda(1):
        t = _Probe(target=lambda: seen.append((torch._C._len_torch_function_stack(),
                                               torch._C._len_torch_dispatch_stack())))
        t.start()
        t.join()
    assert seen[0][0] >= 1 and seen[0][1] >= 1  # watched while it ran
    assert t.left == (0, 0)
