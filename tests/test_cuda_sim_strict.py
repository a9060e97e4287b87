"""The strict simulator where CUDA is stricter than a plain reading of the code suggests.

Each test here failed before the simulator or checker change it names: the ordering checker keys
each device's default stream apart (torch hands out handle 0 for every device's default stream),
kernels of every thread are checked, and the host may run ahead of the streams for copies.
"""
import pytest
import torch

from cgdp.testing import simulated_cuda
from cgdp.testing.stream_check import StreamChecker, StreamRaceError, stream_key
from helpers import queued_upload


# ------------------------------------------------------------------- default streams of two devices
def test_default_streams_have_torch_handle_0_on_every_device():
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        s0, s1 = sim.runtime.default_stream(0), sim.runtime.default_stream(1)
        assert s0.cuda_stream == s1.cuda_stream == 0 and stream_key(s0) != stream_key(s1)
        assert sim.cuda.Stream(stream_id=0, device_index=1, device_type=1) is s1


@pytest.mark.parametrize("ordered", [False, True])
def test_two_devices_default_streams_race_on_one_host_buffer(ordered):
    """GPU 0's default stream copies into page-locked bytes, GPU 1's copies them out: without an
    event between the two it is a race (keyed by handle alone, both were "stream 0": hidden)."""
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        rt = sim.runtime
        host = rt.host_alloc(64, torch.float32)
        a, b = torch.ones(64, device=rt.torch_device(0)), torch.zeros(64, device=rt.torch_device(1))
        rt.copy(host, a)  # on cuda:0's default stream
        if ordered:
            ev = rt.Event()
            ev.record(rt.default_stream(0))
            rt.default_stream(1).wait_event(ev)
        rt.copy(b, host)  # on cuda:1's default stream
        if not ordered:
            with pytest.raises(StreamRaceError, match="cuda:1/default .* cuda:0/default"):
                sim.synchronize_device(1)
        sim.synchronize_device(0)
        sim.synchronize_device(1)
        rt.host_free(host)


def test_device_synchronize_orders_only_that_devices_streams():
    """``torch.cuda.synchronize(0)`` waits for GPU 0 only (cudaDeviceSynchronize on the current
    device): host memory GPU 1 still copies into is in flight after it."""
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        rt = sim.runtime
        host = rt.host_alloc(64, torch.float32)
        rt.copy(host, torch.ones(64, device=rt.torch_device(1)))
        sim.synchronize_device(0)
        with pytest.raises(StreamRaceError, match="cudaHostUnregister .* cuda:1/default"):
            rt.host_free(host)
            sim.raise_pending()


def test_torch_trace_callbacks_are_keyed_by_the_current_device():
    """On a GPU, torch fires the trace callbacks with the stream's handle under a guard of its
    device: the checker keys by (current device, handle)."""
    import torch.cuda._gpu_trace as gt
    dev = {"d": 0}
    chk = StreamChecker()
    chk.install_trace(lambda: dev["d"])
    try:
        buf = (1000, 2000)
        chk.access((0, 0), [], [buf], "write on GPU 0")
        dev["d"] = 1
        chk.access((1, 0), [buf], [], "read on GPU 1")
        assert len(chk.errors) == 1
        dev["d"] = 0
        gt.EventRecordCallbacks.fire_callbacks(77, 0)
        dev["d"] = 1
        gt.EventWaitCallbacks.fire_callbacks(77, 0)
        chk.access((1, 0), [buf], [], "read on GPU 1")
        assert len(chk.errors) == 1, "the event orders GPU 0's default stream before GPU 1's"
        chk.access((0, 0), [], [(3000, 4000)], "another write on GPU 0")
        gt.DeviceSynchronizationCallbacks.fire_callbacks()  # GPU 1 only
        assert chk.unsettled() == ["another write on GPU 0 on (0, 0)"]  # not known complete
        dev["d"] = 0
        gt.DeviceSynchronizationCallbacks.fire_callbacks()
        assert chk.unsettled() == []
    finally:
        chk.uninstall_trace()


# ------------------------------------------------------------------- kernels of every thread
def _side_copy_into(sim, d, host):
    """A ``non_blocking`` copy from page-locked memory into ``d`` on a side stream of cuda:0,
    still in flight when this returns."""
    rt = sim.runtime
    side = rt.Stream(0)
    with rt.stream(side):
        rt.cuda._sleep(int(0.05e9))  # the copy lands 50 ms later
        rt.copy(d, host)
    return side


@pytest.mark.parametrize("ordered", [False, True])
def test_a_kernel_of_a_thread_that_never_chose_a_device_is_checked(ordered):
    """A thread that never called torch.cuda (nor chose a device) adds into device memory a side
    stream still copies into: on a GPU its kernel runs on cuda:0's default stream, unordered with
    the copy. Before, such a thread's kernels were not recorded at all."""
    import threading
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        rt = sim.runtime
        host = rt.host_alloc(64, torch.float32)
        host.fill_(1.0)
        d = torch.zeros(64, device=rt.torch_device(0))
        side = _side_copy_into(sim, d, host)
        if ordered:
            side.synchronize()
        out = {}

        def user():
            out["sum"] = float(d.add_(1.0).sum())
        t = threading.Thread(target=user, name="never-bound")
        t.start()
        t.join()
        if ordered:
            assert out["sum"] == 128.0
            side.synchronize()
        else:
            with pytest.raises(StreamRaceError, match=r"add_.*never-bound.*cuda:0/default.*copy_"):
                side.synchronize()
        rt.host_free(host)


def test_copies_between_devices_are_ordered_as_torch_orders_them():
    """A copy from cuda:0 to cuda:1 (on any thread) runs on cuda:0's stream between two barriers
    (Copy.cu): what cuda:1 then computes from it needs no event of the caller's; the result is right."""
    with simulated_cuda(2, max_delay_s=0.001) as sim:
        a = torch.arange(64.0, device=sim.runtime.torch_device(0))
        b = a.to(sim.runtime.torch_device(1))
        c = b * 2
        assert sim.syncs.device_of(b) == 1 and sim.syncs.device_of(c) == 1
        assert torch.equal(c.cpu(), torch.arange(64.0) * 2)
        a.add_(1)  # cuda:0 writes its source again: ordered after the copy, on cuda:0's stream
        sim.synchronize_device(0)
        sim.synchronize_device(1)


# ------------------------------------------------------------------- the host runs ahead of the streams
@pytest.mark.parametrize("ordered", [False, True])
def test_a_host_write_into_page_locked_memory_a_queued_copy_reads(ordered):
    """A ``non_blocking`` copy from page-locked memory on the default stream is queued behind the
    stream's work, as on a GPU: the host writing the buffer before the copy ran is a race (and the
    device gets the new bytes); after an event's synchronize it is right."""
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        rt = sim.runtime
        host, d = queued_upload(rt)
        ev = rt.Event()
        ev.record(rt.default_stream(0))
        if ordered:
            ev.synchronize()
        host.fill_(2.0)  # the host reuses the staging bytes
        if ordered:
            assert float(d.sum()) == 64.0
        else:
            with pytest.raises(StreamRaceError, match=r"fill_.* on stream the host writes .* copy_"):
                ev.synchronize()
            assert float(d.sum()) == 128.0, "the copy read the host's later bytes, as on a GPU"
        rt.host_free(host)


@pytest.mark.parametrize("how", ["none", "query", "synchronize"])
def test_a_host_read_of_page_locked_memory_a_queued_copy_writes(how):
    """A device-to-host copy into page-locked memory on the default stream lands later: the host
    reading it first is a race; a query that returned True, or a synchronize, orders it."""
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        rt = sim.runtime
        host = rt.host_alloc(64, torch.float32)
        host.zero_()
        d = torch.ones(64, device=rt.torch_device(0))
        rt.cuda._sleep(int(0.02e9))
        rt.copy(host, d)
        ev = rt.Event()
        ev.record(rt.default_stream(0))
        if how == "query":
            while not ev.query():
                pass
        elif how == "synchronize":
            rt.default_stream(0).synchronize()
        total = float(host.sum())
        if how == "none":
            assert total == 0.0, "the copy had not landed"
            with pytest.raises(StreamRaceError, match=r"sum.* on stream the host reads .* copy_"):
                ev.synchronize()
        else:
            assert total == 64.0
        rt.host_free(host)


def test_inputs_staged_through_page_locked_memory_keep_their_bytes():
    """``upload`` stages each input in a fresh page-locked block (torch's caching host allocator
    reuses a block only after its copy ran): with the copies queued behind a busy default stream,
    each device tensor still gets its own input."""
    from cgdp.engine.backend.cuda_runtime import upload
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        rt = sim.runtime
        rt.cuda._sleep(int(0.02e9))
        outs = [upload(torch.full((1000,), float(i)), rt.torch_device(0)) for i in range(6)]
        assert [float(o.sum()) for o in outs] == [1000.0 * i for i in range(6)]
        assert sim.counts["queued_copies"] == 6, "each was queued on the default stream"


# ------------------------------------------------------------------- autograd's device threads
def test_each_devices_backward_runs_on_its_own_autograd_thread():
    """As autograd's engine on a GPU: a graph on cuda:d runs (hooks included) on the device
    thread for d, which does not see the caller's thread-locals and has d as its current device;
    two devices' backwards issued from two threads run their hooks at once."""
    import threading
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        mine = threading.local()
        both = threading.Barrier(2, timeout=20)
        seen = {}

        def work(d):
            mine.caller = d
            w = torch.ones(4, device=sim.runtime.torch_device(d), requires_grad=True)

            def hook(g):
                seen[d] = (threading.current_thread().name, getattr(mine, "caller", None),
                           sim.cuda.current_device())
                both.wait()  # the other device's hook runs at the same time
                return g
            w.register_hook(hook)
            (w * 2).sum().backward()
            seen[f"grad{d}"] = float(w.grad.sum())
        threads = [threading.Thread(target=work, args=(d,), name=f"caller-{d}") for d in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == {0: ("pt_autograd_0", None, 0), 1: ("pt_autograd_1", None, 1),
                        "grad0": 8.0, "grad1": 8.0}


@pytest.mark.parametrize("non_blocking", [False, True])
def test_a_move_to_the_host_is_waited_for_unless_non_blocking(non_blocking):
    """``.to("cpu")`` waits for the device's stream; with ``non_blocking=True`` torch copies into
    page-locked memory and returns at once: the host reading it before a synchronisation races."""
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        d = torch.ones(64, device=sim.runtime.torch_device(0)) * 3
        h = d.to("cpu", non_blocking=non_blocking)
        h2 = h * 2  # the host reads it
        if non_blocking:
            assert sim.syncs.is_pinned(h)
            with pytest.raises(StreamRaceError, match=r"mul.* on stream the host reads"):
                sim.synchronize_device(0)
        else:
            assert float(h2.sum()) == 384.0


def test_the_gpu_checker_watches_every_thread_started_while_in_use():
    """``stream_check.checked`` (the GPU run's checker) pushes its mode on threads that never call
    the runtime, as the simulator does."""
    import threading
    import types
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from cgdp.testing.stream_check import checked
    fake = types.SimpleNamespace(current_device=lambda: 0, current_stream=lambda d: None)
    wrapped = checked(types.SimpleNamespace(cuda=fake))
    seen = []

    def look():
        seen.append(_get_current_dispatch_mode() is wrapped.mode)
    try:
        t = threading.Thread(target=look)
        t.start()
        t.join()
    finally:
        wrapped.close()
    t = threading.Thread(target=look)
    t.start()
    t.join()
    assert seen == [True, False]
