"""The strict simulator (cgdp.testing.simulated_cuda), and the defects of the CUDA path it exposed.

Each ``test_defect_N_*`` reproduces item N of the review of the CUDA backend: it failed on the code
before the fix (the report of issue 17 says how each failed). The ``test_simulator_*`` tests prove
that the simulator is as strict as CUDA where it claims to be, and that its fakes take the
arguments torch 2.13's ``torch.cuda`` takes.
"""
import copy
import inspect
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.engine.backend import cuda as cuda_backend
from cgdp.engine.backend import cuda_runtime
from cgdp.testing import SideStream, simulated_cuda
from cgdp.testing import fake_cuda
from cgdp.testing.stream_check import AccessMode, StreamChecker, StreamRaceError, tensor_bytes
from helpers import assert_params_close, assert_replicas_identical, mlp, reference
from cgdp.testing import inside

SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731


def data(n_steps=2, n=10, width=12, classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, width, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(n_steps)]


# ------------------------------------------------------------------------- the fakes are torch's API
def test_simulator_fakes_take_the_arguments_torch_cuda_takes():
    """Every fake beneath TorchCuda has the parameters of the installed torch's function (names,
    kinds, defaults), so a renamed argument or API in the backend fails here, not on a GPU."""
    import importlib
    for sub in ("comm", "nccl"):
        importlib.import_module(f"torch.cuda.{sub}")
    real = torch.cuda
    wrong = []
    for name, fake in fake_cuda.MIRRORS:
        obj = real
        for part in name.split("."):
            obj = getattr(obj, part)
        want = [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]
        got = [(p.name, p.kind, p.default) for p in inspect.signature(fake).parameters.values()]
        if want != got:
            wrong.append(f"torch.cuda.{name}{inspect.signature(obj)} vs fake {inspect.signature(fake)}")
    assert not wrong, wrong
    # what TorchCuda calls on torch.cuda is all mirrored
    import ast
    src = inspect.getsource(cuda_runtime.TorchCuda)
    called = {n.attr for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "cuda"}
    mirrored = {name.split(".")[0] for name, _ in fake_cuda.MIRRORS} | {"nccl", "comm", "default_generators"}
    assert called <= mirrored, called - mirrored
    assert isinstance(torch.cuda.default_generators, tuple)  # (one generator per device on a GPU)
    tensor_calls = {n.attr for n in ast.walk(ast.parse(inspect.getsource(cuda_runtime)))
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "Tensor"}
    assert tensor_calls == {"is_pinned", "pin_memory"} and all(hasattr(torch.Tensor, a) for a in tensor_calls)
    with simulated_cuda(1) as sim:
        for fn, params in fake_cuda.CUDART.items():
            assert list(inspect.signature(getattr(sim.cudart, fn)).parameters) == list(params), fn


# ------------------------------------------------------------------------- defect 1: close() in flight
def test_defect_1_close_lets_the_last_copies_back_finish_before_unregistering():
    """A step returns after device-side waits only; close() used to unregister the host rows
    while the last H2D copies could still read them (StreamRaceError: cudaHostUnregister while a
    copy may still use it). Same for a DataParallel, and for a Trainer dropped without close()."""
    batches = data(2)
    with simulated_cuda(2, seed=1) as sim:
        tr = cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks=1, segment_bytes=1024)
        tr.step(*batches[0], F.cross_entropy)
        host = inside(tr).stream.host._host
        tr.close()
        assert sim.registered == {} and not sim.violations
        assert torch.isnan(host).all(), "unregistered rows are poisoned"
        tr = cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks=1)
        tr.step(*batches[1], F.cross_entropy)
        del tr  # the finalizer releases, in the same order
        import gc
        gc.collect()
        assert sim.registered == {} and not sim.violations
        net = mlp()
        dp = cgdp.DataParallel(net, ["cuda:0", "cuda:1"], chunks=1)
        opt = dp.bind(torch.optim.SGD(net.parameters(), lr=0.1))
        x, y = batches[0]
        F.cross_entropy(dp(x), y).backward()
        opt.step()
        dp.close()
        assert sim.registered == {} and not sim.violations


def test_defect_1_a_rejected_step_leaves_nothing_in_flight():
    """After NonFiniteGradientError the trainer says 'nothing needs recovering': the copies back
    were only ordered on the devices, so the host did not know they had finished."""
    x, y = data(1)[0]
    bad = x.clone()
    bad[-1, 0] = float("inf")
    with simulated_cuda(2, seed=2) as sim:
        with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:1"], chunks=1) as tr:
            with pytest.raises(cgdp.NonFiniteGradientError):
                tr.step(bad, y, F.cross_entropy)
            assert sim.checker.unsettled() == []
            tr.step(x, y, F.cross_entropy)
            assert sim.checker.unsettled(), "an ordinary step does leave its copies back in flight"


# ------------------------------------------------------------------------- defect 3: side streams
class SideOut(nn.Module):
    """Its output layer runs on a stream of its own (as a model with torch.cuda.stream in its
    forward): in backward that layer's gradients accumulate on the side stream."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Sequential(nn.Linear(12, 16), nn.Tanh())
        self.head = SideStream(nn.Linear(16, 5))

    def forward(self, x):
        return self.head(self.body(x))


def test_defect_3_the_chunk_waits_for_every_stream_its_gradients_accumulated_on():
    """One chunk holds both layers; the hook that completes it runs on the default stream, but the
    head's gradients accumulated on the side stream: the D2H copy must wait for both (it read the
    head's gradient unordered before: StreamRaceError, on a GPU stale gradients)."""
    batches = data(2)
    model = SideOut()
    with simulated_cuda(2, seed=3):
        ref, _ = reference(model, SGD, batches, F.cross_entropy)
        with cgdp.Trainer(copy.deepcopy(model), SGD, ["cuda:0", "cuda:1"], chunks=[[1, 0]]) as tr:
            for x, y in batches:
                tr.step(x, y, F.cross_entropy)
                assert_replicas_identical(tr)
            assert_params_close(tr.replicas[0], ref)


# ------------------------------------------------------------------------- defect 4: contexts
@pytest.mark.parametrize("face", ["Trainer", "DataParallel"])
def test_defect_4_a_process_using_cuda_1_creates_no_context_on_gpu_0(face):
    """An MPI rank that uses cuda:1 only: the host-sum thread leaving torch.cuda.stream(h2d), the
    completion thread's event waits and the host registration on the caller's thread each created
    a context on GPU 0 (~0.3-0.5 GB there per rank)."""
    x, y = data(1)[0]
    with simulated_cuda(2, seed=4) as sim:
        if face == "Trainer":
            with cgdp.Trainer(mlp(), SGD, ["cuda:1"], chunks=1) as tr:
                tr.step(x, y, F.cross_entropy)
        else:
            net = mlp()
            with cgdp.DataParallel(net, ["cuda:1"], chunks=1) as dp:
                F.cross_entropy(dp(x), y).backward()
        assert set(sim.contexts) == {1}, sim.contexts
        touched = {t: d for t, d in sim.thread_devices.items() if d != {1}}
        assert not touched, touched


def test_defect_4_the_comm_thread_works_on_its_rank_s_device():
    """Two in-process ranks, rank r on cuda:r only, over the MPI tier's engine path: the comm
    thread issues the copies back of its rank's device, and touches no other device."""
    from concurrent.futures import ThreadPoolExecutor
    from cgdp.comm.inproc import InProcGroup
    model, batches = mlp(), data(2, n=8)
    ref, _ = reference(model, SGD, batches, F.cross_entropy)

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, [f"cuda:{comm.rank}"], chunks=2, comm=comm,
                          timeout_s=30) as tr:
            for x, y in batches:
                tr.step(torch.tensor_split(x, 2)[comm.rank], torch.tensor_split(y, 2)[comm.rank],
                        F.cross_entropy)
            return copy.deepcopy(tr.replicas[0])

    with simulated_cuda(2, seed=5) as sim:
        group = InProcGroup(2, timeout_s=30)
        with ThreadPoolExecutor(2) as pool:
            out = [f.result(timeout=60) for f in [pool.submit(rank, c) for c in group.comms()]]
        for c in group.comms():
            c.close()
        for r in range(2):
            assert sim.thread_devices[f"cgdp-comm-r{r}"] == {r}
            assert sim.thread_devices[f"cgdp-cuda:{r}"] == {r}
            # the host thread waits on the copies' events and issues the copies back: its device too
            assert sim.thread_devices[f"cgdp-host-cuda:{r}"] == {r}
    for m in out:
        assert_params_close(m, ref)


# ------------------------------------------------------------------------- defect 5: page size
@pytest.mark.parametrize("page", [4096, 65536])
def test_defect_5_host_rows_own_their_pages(page):
    """On 64 KiB-page hosts (GH200) two host allocations aligned to 4 KiB shared a page, and the
    second registration failed (cudaErrorHostMemoryAlreadyRegistered) with 'raise ulimit -l'."""
    with simulated_cuda(1, page_size=page) as sim:
        trainers = [cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:0"], share_devices=True) for _ in range(4)]
        assert len(sim.registered) == 4
        for a, n in sim.registered.items():
            assert a % page == 0
        for tr in trainers:
            tr.close()


def test_simulator_refuses_overlapping_registrations_and_counts_pages():
    with simulated_cuda(1, page_size=65536) as sim:
        buf = torch.empty(4 * 65536, dtype=torch.uint8)
        base = buf.data_ptr() + (-buf.data_ptr()) % 65536
        assert sim.cudart.cudaHostRegister(base + 100, 1000, 0) == 0
        assert sim.cudart.cudaHostRegister(base + 60000, 100, 0) == 712  # the same 64 KiB page
        assert sim.cudart.cudaHostRegister(base + 65536, 100, 0) == 0    # the next page
        assert sim.cudart.cudaHostUnregister(base + 5) == 713            # not a registered base
        assert sim.cudart.cudaHostUnregister(base + 100) == 0
        assert sim.cudart.cudaHostRegister(base + 60000, 100, 0) == 0
        for a in list(sim.registered):
            sim.cudart.cudaHostUnregister(a)


# ------------------------------------------------------------------------- defect 6: user streams
def test_defect_6_buffers_and_steps_stay_off_a_user_stream():
    """Built under a user's stream, the flat buffers were allocated and zeroed there (unordered with
    the default stream that accumulates into them: StreamRaceError); set_plan, load_state_dict
    and DataParallel's optimizer.step() under one read or relaid gradients unordered."""
    x, y = data(1)[0]
    with simulated_cuda(1, seed=6) as sim:
        user = sim.cuda.Stream(0)
        with sim.cuda.stream(user):
            with pytest.raises(RuntimeError, match=r"cgdp.Trainer\(...\) outside any torch.cuda.stream"):
                cgdp.Trainer(mlp(), SGD, ["cuda:0"])
            with pytest.raises(RuntimeError, match="outside any torch.cuda.stream"):
                cgdp.DataParallel(mlp(), ["cuda:0"])
        with cgdp.Trainer(mlp(), SGD, ["cuda:0", "cuda:0"], share_devices=True) as tr:
            tr.step(x, y, F.cross_entropy)
            state = tr.state_dict()
            with sim.cuda.stream(user):
                with pytest.raises(RuntimeError, match="set_plan"):
                    tr.set_plan(2)
                with pytest.raises(RuntimeError, match="load_state_dict"):
                    tr.load_state_dict(state)
        net = mlp()
        with cgdp.DataParallel(net, ["cuda:0"], chunks=1) as dp:
            opt = dp.bind(torch.optim.SGD(net.parameters(), lr=0.1))
            F.cross_entropy(dp(x), y).backward()
            with sim.cuda.stream(user):
                with pytest.raises(RuntimeError, match=r"optimizer.step\(\) outside"):
                    opt.step()
            opt.step()


# ------------------------------------------------------------------------- defect 7
def test_defect_7_host_free_checks_the_unregister_result():
    with simulated_cuda(1):
        rt = cuda_runtime.runtime()
        t = rt.host_alloc(100, torch.float32)
        rt.host_free(t)
        with pytest.raises(RuntimeError, match="cudaHostUnregister .* failed .*713"):
            rt.host_free(t)  # no longer registered: the error is not ignored


def test_defect_7_a_failed_registration_leaves_no_error_behind():
    """cudaHostRegister's error stays as the thread's last error; the next kernel launch on that
    thread raised it as its own ('out of memory' from an unrelated op)."""
    with simulated_cuda(1, lockable_bytes=1024) as sim:
        with pytest.raises(RuntimeError, match="cudaHostRegister .* out of memory: raise the locked-memory"):
            cgdp.Trainer(mlp(), SGD, ["cuda:0"])
        with sim.cuda.stream(sim.cuda.Stream(0)):
            torch.ones(3).add_(1)  # a kernel on this thread: launches cleanly


def test_defect_7_the_clipping_coefficient_is_not_copied_from_pageable_memory(monkeypatch):
    """coef.to(device, non_blocking=True) from an ordinary host tensor: on a GPU a hidden
    synchronisation in every clipped step. The coefficient is now made on the device."""
    calls = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        if kwargs.get("non_blocking") and self.device.type == "cpu" and not self.is_pinned() \
                and "clip.py" in inspect.stack()[1].filename:
            calls.append(self)
        return real_to(self, *args, **kwargs)
    x, y = data(1)[0]
    model = mlp()
    with simulated_cuda(2, seed=7):
        with cgdp.Trainer(copy.deepcopy(model), SGD, ["cuda:0", "cuda:1"], clip_grad_norm=0.01) as tr:
            monkeypatch.setattr(torch.Tensor, "to", spy)
            tr.step(x, y, F.cross_entropy)
            monkeypatch.undo()
            assert tr.stats["grad_norm"] > 0.01
            assert_replicas_identical(tr)
    assert calls == []
    ref = copy.deepcopy(model)
    opt = SGD(ref.parameters())
    F.cross_entropy(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    opt.step()
    assert_params_close(tr.replicas[0], ref)


# ------------------------------------------------------------------------- the simulator itself
def test_simulator_waits_are_device_side():
    """A stream waiting on an event gives the host no knowledge: host memory a side-stream copy
    used is in flight until the host synchronises (unregistering it then is reported)."""
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        rt = cuda_runtime.runtime()
        side = rt.Stream(0)
        host = rt.host_alloc(64, torch.float32)
        dev = torch.ones(64, device=rt.torch_device(0))
        with rt.stream(side):
            rt.copy(host, dev)
        ev = rt.Event()
        ev.record(side)
        rt.default_stream(0).wait_event(ev)  # device-side: the default stream waits, not the host
        assert sim.checker.unsettled()
        with pytest.raises(StreamRaceError, match="cudaHostUnregister .* while copy_"):
            rt.host_free(host)
            sim.raise_pending()
        host = rt.host_alloc(64, torch.float32)
        with rt.stream(side):
            rt.copy(host, dev)
        side.synchronize()  # now the host knows
        rt.host_free(host)
        sim.raise_pending()


def test_simulator_threads_have_their_own_current_device():
    with simulated_cuda(3) as sim:
        seen = {}

        def work(d):
            sim.cuda.set_device(d)
            seen[d] = sim.cuda.current_device()
        threads = [threading.Thread(target=work, args=(d,), name=f"t{d}") for d in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == {1: 1, 2: 2} and sim.cuda.current_device() == 0
        assert sim.contexts.keys() == {1, 2}, "set_device(d) creates d's context, nothing else"
        fresh = threading.Thread(target=lambda: sim.cuda.Event(blocking=True).synchronize())
        fresh.start()
        fresh.join()
        assert 0 in sim.contexts, "a thread that never chose a device works on GPU 0"


def test_checker_compares_slices_with_their_buffer_and_sees_missing_waits():
    chk = StreamChecker()
    flat = torch.zeros(100)
    a, b = 1, 2
    rng = lambda t: [tensor_bytes(t)]  # noqa: E731
    chk.access(a, [], rng(flat[10:20]), "accumulate")
    chk.access(b, rng(flat), [], "copy out")  # the whole buffer, unordered with a slice's write
    assert len(chk.errors) == 1 and "accumulate" in str(chk.errors[0])
    chk.event_record(7, a)
    chk.event_wait(7, b)
    chk.access(b, rng(flat), [], "copy out")
    assert len(chk.errors) == 1


def test_checker_models_the_caching_allocator():
    """A block freed while another stream may still use it is reused at once on its stream (CUDA's
    caching allocator): reported unless record_stream, or an event, ordered that use first."""
    chk = StreamChecker()
    main, side = 1, 2
    for order in ("none", "record_stream", "event"):
        chk.access(main, [], [], "alloc", fresh=[(1000, 2000)])
        chk.access(side, [(1000, 2000)], [], "side read")
        if order == "record_stream":
            chk.record_stream(1000, 2000, side)
        if order == "event":
            chk.event_record(11, side)
            chk.event_wait(11, main)
        before = len(chk.errors)
        chk.access(main, [], [], "alloc again", fresh=[(1000, 2000)])
        assert (len(chk.errors) > before) == (order == "none"), order


def test_access_mode_records_a_missing_wait_between_real_kernels():
    """The dispatch mode on a thread records real operators on the stream the environment names."""
    chk = StreamChecker()
    current = {"s": 1}
    mode = AccessMode(chk, lambda ts: current["s"])
    flat = torch.zeros(10)
    with mode:
        flat[2:5].add_(1.0)  # on stream 1
        current["s"] = 2
        flat.sum()  # on stream 2, unordered
    assert chk.errors and "add_" in str(chk.errors[0])


def test_gpu_checks_run_on_the_simulator(tmp_path):
    """bench/gpu_checks.py, the first GPU run's ordering checks, runs here on the strict simulator:
    every run right, and the four controls (the update not waiting for the copies back, a D2H copy
    not waiting for its gradients; each under delays and under the checker) caught."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "bench/gpu_checks.py", "--simulate", "--quick", "--steps", "2",
                        "--out", str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert res["simulated"] and all(c["ok"] for c in res["checks"])
    assert sum(c["must_fail"] for c in res["checks"]) == 4 and not res["interrupted"]
    assert "SIMULATED" in (tmp_path / "gpu_checks.md").read_text()
    # DataParallel runs two replicas on the one GPU, as the Trainer does
    assert res["devices"] == ["cuda:0", "cuda:0", "cuda:1"]


def test_gpu_checks_stopped_by_their_limit_keep_what_they_checked(tmp_path):
    """A stage cut by ``timeout -s INT`` (bench/gpu_run.sh) still leaves gpu_checks.json: written
    after every check, marked interrupted, exit 1; the controls run right after the first check."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "bench/gpu_checks.py", "--simulate", "--steps", "2",
                          "--out", str(tmp_path)], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        for line in p.stdout:  # the last control has passed: stop it there
            if "PASS control (must fail): D2H copy does not wait for the gradients, under the checker" in line:
                break
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 1, rest[-3000:]
    res = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert res["interrupted"] and all(c["ok"] for c in res["checks"])
    assert [c["must_fail"] for c in res["checks"][:5]] == [False, True, True, True, True]
    assert "INTERRUPTED" in (tmp_path / "gpu_checks.md").read_text()


def test_dataparallel_under_the_strict_simulator():
    """DataParallel's own path on simulated GPUs (backward on the caller's thread, hooks there,
    the user's optimizer and its mirrors on the device threads): no race, no context outside the
    devices, the same parameters as one device, with accumulation under no_sync and clipping."""
    batches = data(3, n=12)
    model = mlp()
    ref = copy.deepcopy(model)
    ropt = SGD(ref.parameters())
    for x, y in batches:
        ropt.zero_grad()
        F.cross_entropy(ref(x[:6]), y[:6]).backward()  # two halves accumulated, as under no_sync
        F.cross_entropy(ref(x[6:]), y[6:]).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ropt.step()
    with simulated_cuda(3, seed=8) as sim:
        net = copy.deepcopy(model)
        with cgdp.DataParallel(net, ["cuda:1", "cuda:2"], chunks=2) as dp:
            opt = dp.bind(SGD(net.parameters()))
            for x, y in batches:
                opt.zero_grad()
                with dp.no_sync():
                    F.cross_entropy(dp(x[:6]), y[:6]).backward()
                F.cross_entropy(dp(x[6:]), y[6:]).backward()
                dp.clip_grad_norm_(0.5)
                opt.step()
                for r in dp.replicas[1:]:
                    for p, q in zip(net.parameters(), r.parameters()):
                        assert torch.equal(p, q)
        assert set(sim.contexts) == {1, 2}, sim.contexts
    assert_params_close(net, ref)


def test_backend_corners_without_nccl_and_with_failures():
    """The rest of TorchCuda and CudaDevice: the reduce without NCCL, host rows given back one by
    one, one segment sent and given back by hand, a timestamp that outlived its step, libcudart
    lookup."""
    lib = cuda_runtime._load_cudart()
    assert lib is None or hasattr(lib, "cudaGetLastError")
    batches = data(2)
    model = mlp()
    ref, _ = reference(model, SGD, batches, F.cross_entropy)
    with simulated_cuda(2, nccl=False, seed=9) as sim:
        with cgdp.Trainer(copy.deepcopy(model), SGD, ["cuda:0", "cuda:1"], mode="typical") as tr:
            for x, y in batches:
                tr.step(x, y, F.cross_entropy)
            assert_params_close(tr.replicas[0], ref)
            assert sim.counts["reduce"] == 0  # added in device order, not through NCCL
        failures = []
        dev = cuda_backend.CudaDevice("cuda:0", 0, failures.append)
        rows = dev.host_empty((3, 8), torch.float32)
        assert sim.registered
        dev.host_release(rows)
        assert not sim.registered
        from cgdp.engine.backend.base import Routes
        guard = cgdp.engine.sync.Guard(10.0)
        src = torch.ones(8)
        rows = dev.host_empty((2, 8), torch.float32)
        sent: list[int] = []
        dev.set_routes(Routes([(src, rows[0], None)], [(rows[1], src, None)], [range(1)], [32], [32],
                              ["chunk 0"], sent.append))
        dev.send(0)  # only issues: the host waits on the copy's event before reading the row
        dev.wait_arrived(0, guard)
        assert sent == [0] and torch.equal(rows[0], src)
        rows[1].fill_(3.0)
        dev.give_back(0)
        dev.synchronize(guard)
        assert torch.equal(src, torch.full((8,), 3.0)) and not failures
        stamp = sim.runtime.Event(enable_timing=True)
        with pytest.raises(RuntimeError, match="outlived its timed step"):
            dev.resolve(stamp)
        dev.close()


@pytest.mark.parametrize("flags, stages_s, limit_s", [([], 300, 360), (["--simulate"], 195, 250)])
def test_the_first_gpu_run_fits_one_call(flags, stages_s, limit_s):
    """``bench/gpu_run.sh``: a preflight first, then its stages in the order of what they prove, each
    with its own limit; the stages within 5 minutes on the GPU (6 with kill graces and summary), so
    a second call fits the lease; ``--only`` runs the preflight and the stages named."""
    import pathlib
    import re
    import subprocess
    root = pathlib.Path(__file__).resolve().parent.parent

    def dry(*more):
        out = subprocess.run(["bash", "bench/gpu_run.sh", *flags, *more, "--dry-run"], cwd=root,
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return re.findall(r"^stage (\S+) (-?\d+)s", out, re.M), int(re.search(r"at most (\d+)s", out).group(1))
    stages, worst = dry()
    assert [s for s, _ in stages] == ["preflight", "checks-quick", "pytest", "measure", "overlap", "replicas",
                                      "integrations", "checks-full"]
    assert all(int(t) >= 0 for _, t in stages) and int(stages[-1][1]) >= 20
    assert sum(int(t) for _, t in stages) == stages_s and stages_s + 8 * 5 + 10 == worst <= limit_s
    only, _ = dry("--only", "pytest,checks-full")
    assert [s for s, _ in only] == ["preflight", "pytest", "checks-full"]
    assert sum(int(t) for _, t in only) == stages_s
    bad = subprocess.run(["bash", "bench/gpu_run.sh", "--only", "nothing", "--dry-run"], cwd=root,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown stage 'nothing'" in bad.stderr


def test_an_event_recorded_on_another_devices_stream_is_refused():
    """As CUDAEvent::record: an event belongs to the device of its first record; recording it on
    another device's stream is an error (a wait on it from any device is not)."""
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        rt = sim.runtime
        ev = rt.Event()
        ev.record(rt.Stream(0))
        rt.Stream(1).wait_event(ev)
        with pytest.raises(RuntimeError, match="Event device 0 does not match recording stream's device 1"):
            ev.record(rt.Stream(1))
        sim.synchronize_device(0)


def test_streams_come_from_a_pool_of_32_per_device_round_robin():
    """``torch.cuda.Stream()`` takes torch's pooled streams (c10/cuda/CUDAStream.cpp): the 33rd on a
    device is the 1st again, one queue. Work assumed independent is then ordered behind the other's."""
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        rt = sim.runtime
        made = [rt.Stream(0) for _ in range(33)]
        assert made[32] is made[0] and len({id(s) for s in made}) == 32
        assert rt.Stream(1) is not made[0]
        with rt.stream(made[0]):
            rt.cuda._sleep(int(0.2e9))  # 0.2 s of device work on the first stream
        ev = rt.Event()
        ev.record(made[32])
        assert not ev.query()  # behind the first stream's work: the same queue
        ev.synchronize()
