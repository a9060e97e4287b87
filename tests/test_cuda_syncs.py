"""Every blocking wait of the host, counted by the simulated CUDA runtime (``sim.host_syncs()``), and
pinned per face and feature: what docs/cuda.md states as the waits of a steady-state step."""
import copy
import threading
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.engine.trainer.hyperparameters import HyperparameterMismatchError
from cgdp.testing import simulated_cuda
from cgdp.testing.stream_check import StreamRaceError
from helpers import queued_upload

HOST = "cgdp-host-cuda:0"


def test_each_kind_is_counted_under_the_thread_that_waited():
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        rt = sim.runtime
        d0, d1 = rt.torch_device(0), rt.torch_device(1)
        host = torch.arange(4.0)
        t = torch.ones(4, device=d0)
        sim.reset_host_syncs()
        u = (t * 2).sum()  # computed from device data: device data, no wait
        float(host.sum())  # host data: no wait
        assert sim.host_syncs() == Counter()
        u.item()
        t.cpu()
        t.tolist()
        assert sim.syncs.device_of(t.to(d1, non_blocking=True)) == 1  # device to device: no wait
        torch.tensor(3.0, device=d0)  # a copy from pageable memory the call waits for
        host.to(d0, non_blocking=True)  # pageable: CUDA stages it synchronously
        staged = rt.torch.Tensor.pin_memory(host)
        assert rt.torch.Tensor.is_pinned(staged) and not rt.torch.Tensor.is_pinned(host)
        staged.to(d0, non_blocking=True)  # from page-locked memory: no wait
        t.to("cpu", non_blocking=True)  # torch copies into page-locked memory: no wait
        sim.cuda.synchronize(0)
        s = rt.Stream(1)
        ev = rt.Event(blocking=True)
        ev.record(s)
        w = threading.Thread(target=ev.synchronize, name="waiter")
        w.start()
        w.join()
        assert sim.host_syncs() == Counter({("MainThread", "read"): 4, ("MainThread", "pageable"): 1,
                                            ("MainThread", "synchronize"): 1, ("waiter", "arrival"): 1})
        sim.reset_host_syncs()
        assert sim.host_syncs() == Counter()


def test_moves_behave_as_torch_moves():
    """As ``Tensor.to`` on CUDA: a move to another device is a copy autograd records (staging
    through page-locked memory included), a move to the device a tensor is on returns the tensor,
    a sparse tensor moves, and a tensor reports its device as the engine's torch device."""
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        rt = sim.runtime
        d0, d1 = rt.torch_device(0), rt.torch_device(1)
        x = torch.randn(5, 3, requires_grad=True)
        staged = rt.torch.Tensor.pin_memory(x)
        on0 = staged.to(d0, non_blocking=True)
        on1 = on0.to(d1)
        assert on0.to(d0) is on0 and on1.to(on1.device) is on1 and on0.to(d0, torch.float64).dtype == torch.float64
        assert (on0.device, on1.device, x.device) == (d0, d1, torch.device("cpu"))
        back = on1.to("cpu")
        assert back.device == torch.device("cpu") and back.data_ptr() != on1.data_ptr()
        w = torch.randn(5, 3)
        (x_grad,) = torch.autograd.grad((back * w).sum(), x)
        torch.testing.assert_close(x_grad, w, rtol=0, atol=0)
        sparse = torch.randn(4, 4).to_sparse().to(d1)
        torch.testing.assert_close(sparse.to("cpu").to_dense(), sparse.to_dense())


def test_a_freed_device_storage_leaves_its_bytes_to_the_host():
    """Simulated device memory is host memory: a device storage freed gives its bytes back to the
    host's allocator, which may hand them to a host tensor made by a call no mode sees allocate
    (``torch.tensor(0)``, as BatchNorm makes ``num_batches_tracked``; ``torch.from_numpy``). That
    tensor is host memory: its deep copy is host work, and moving the copy to another device is
    ordered as any upload (a device mark outliving its storage made the deep copy a write on the
    freed storage's device, which the move then read from another device's stream: a race
    reported now and then when a replica's buffer was made at such an address)."""
    with simulated_cuda(3, max_delay_s=0.0) as sim:
        d1, d2 = sim.runtime.torch_device(1), sim.runtime.torch_device(2)
        memory = np.zeros(1, np.int64)
        on1 = torch.from_numpy(memory)
        sim.syncs.place(on1, 1)  # a cuda:1 storage at these bytes (the allocator's reuse, made exact)
        assert on1.device == d1
        del on1
        host = torch.from_numpy(memory)  # the same bytes, the host's now
        assert host.device == torch.device("cpu") and sim.syncs.device_of(host) is None
        moved = copy.deepcopy(host).to(d2)
        assert moved.device == d2 and moved.item() == 0
        sim.synchronize_device(2)


# (what the operator does, its waits on a GPU: one per memcpy_and_sync or .item() in torch's CUDA kernel)
SYNCING = [
    ("blocking _foreach_copy_ to the host", lambda t, m: torch._foreach_copy_([torch.empty(6)] * 3, [t] * 3), 3),
    ("torch.nonzero", lambda t, m: torch.nonzero(t), 1),
    ("Tensor.nonzero", lambda t, m: t.nonzero(), 1),
    ("torch.argwhere", lambda t, m: torch.argwhere(t), 1),
    ("torch.where(cond)", lambda t, m: torch.where(m), 1),
    ("t[mask]", lambda t, m: t[m], 1),
    ("t[mask] = device tensor", lambda t, m: t.clone().__setitem__(m, t[0]), 1),
    ("masked_select", lambda t, m: torch.masked_select(t, m), 1),
    ("tolist", lambda t, m: t.tolist(), 1),
    ("torch.unique", lambda t, m: torch.unique(t), 1),
    ("unique_consecutive", lambda t, m: torch.unique_consecutive(t), 1),
    ("repeat_interleave without output_size", lambda t, m: torch.repeat_interleave(t.long()), 2),
    ("bincount", lambda t, m: torch.bincount(t.long()), 2),
    ("histc, range from the data", lambda t, m: torch.histc(t), 2),
    ("a device scalar as a Scalar argument", lambda t, m: t.add(t, alpha=t[1]), 1),
    ("torch.linalg.inv (its error check)", lambda t, m: torch.linalg.inv(torch.diag(t + 1)), 1),
    # none of these waits on a GPU
    ("repeat_interleave with output_size", lambda t, m: torch.repeat_interleave(t.long(), output_size=15), 0),
    ("nonzero_static", lambda t, m: torch.nonzero_static(t, size=3), 0),
    ("t[mask] = host scalar (masked_fill_)", lambda t, m: t.clone().__setitem__(m, 0.0), 0),
    ("masked_fill", lambda t, m: t.masked_fill(m, 0.0), 0),
    ("torch.where(cond, a, b)", lambda t, m: torch.where(m, t, 0.0), 0),
    ("histc over a given range", lambda t, m: torch.histc(t, 3, 0, 5), 0),
    ("a cast on the device", lambda t, m: t.sum().to(torch.float64), 0),
    ("type_as", lambda t, m: t.type_as(torch.ones(1, dtype=torch.float64, device=t.device)), 0),
    ("to(other)", lambda t, m: t.to(torch.ones(1, dtype=torch.float64, device=t.device)), 0),
    ("to(device, dtype)", lambda t, m: t.to(t.device, torch.float64), 0),
]


@pytest.mark.parametrize("what, op, waits", SYNCING, ids=[w for w, _, _ in SYNCING])
def test_every_operator_that_synchronises_on_a_gpu_is_counted(what, op, waits):
    """As torch's CUDA kernels: a blocking ``_foreach_copy_`` between the host and a device is one
    ``copy_`` per tensor (ForeachBinaryOpList.cu's slow path), each a memcpy_and_sync; an output
    sized by the data (nonzero, boolean masks, unique) reads its size first; a device scalar passed
    as a Scalar is an ``.item()``. A cast stays on its device and waits for nothing."""
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        t = torch.arange(6.0, device=sim.runtime.torch_device(0))
        m = t > 2
        sim.reset_host_syncs()
        out = op(t, m)
        assert sim.host_syncs() == Counter({("MainThread", "read"): waits} if waits else {})
        if isinstance(out, torch.Tensor) and what.startswith(("a cast", "type_as", "to(")):
            assert out.dtype == torch.float64 and sim.syncs.device_of(out) == 0


def test_a_non_blocking_foreach_copy_into_page_locked_memory_does_not_wait():
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        rt = sim.runtime
        t = torch.arange(6.0, device=rt.torch_device(0))
        rows = rt.host_alloc(12, torch.float32)
        sim.reset_host_syncs()
        torch._foreach_copy_([rows[:6], rows[6:]], [t, t * 2], non_blocking=True)
        assert sim.host_syncs() == Counter()
        torch._foreach_copy_([torch.empty(6), torch.empty(6)], [t, t], non_blocking=True)  # pageable
        assert sim.host_syncs() == Counter({("MainThread", "read"): 2})
        rt.default_stream(0).synchronize()
        rt.host_free(rows)


@pytest.mark.parametrize("cast", ["sum().to(float64)", "double()", "to(device, float64)", "type_as"])
def test_a_cast_on_the_device_leaves_a_host_write_racing_a_queued_copy(cast):
    """A dtype cast without a change of device stays on the device, asynchronous: the host learns
    nothing from it, so a host write into page-locked memory that a queued copy still reads is a
    race with the cast in between (the cast was taken as a copy to the host, which drained the
    stream and told the checker the host had synchronised: the race went unreported)."""
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        rt = sim.runtime
        host, d = queued_upload(rt)
        sim.reset_host_syncs()
        x = {"sum().to(float64)": lambda: d.sum().to(torch.float64), "double()": lambda: d.double(),
             "to(device, float64)": lambda: d.to(d.device, torch.float64),
             "type_as": lambda: d.type_as(torch.zeros(1, dtype=torch.float64, device=d.device))}[cast]()
        assert x.dtype == torch.float64 and x.device == d.device and sim.host_syncs() == Counter()
        host.fill_(2.0)  # the host reuses the staging bytes before the copy is known to have run
        with pytest.raises(StreamRaceError, match=r"fill_.* on stream the host writes .* copy_"):
            sim.synchronize_device(0)
        rt.host_free(host)


def mlp(bn=False):
    torch.manual_seed(0)
    if bn:
        return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


def counted_step(sim, step, warm=3, host_sum=True):
    """The waits of one steady-state step (after ``warm`` steps), arrivals apart (none without a
    ``host_sum``: ``mode="typical"``)."""
    for _ in range(warm):
        step()
    sim.reset_host_syncs()
    step()
    got = sim.host_syncs()
    arrivals = {k: v for k, v in got.items() if k[1] == "arrival"}
    assert set(arrivals) == ({(HOST, "arrival")} if host_sum else set()), got  # only the host sum waits for copies
    return Counter({k: v for k, v in got.items() if k[1] != "arrival"})


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def tensor_lr(params):
    """A learning rate on the replica's device, as torch's optimizers take it (``capturable``); foreach, as torch
    picks on a GPU (the simulator's tensors are host tensors, for which it would pick its per-tensor loop)."""
    params = list(params)
    return torch.optim.SGD(params, lr=torch.tensor(0.05, device=params[0].device), foreach=True)


def pair_loss(model, part):
    x, y = part
    return F.cross_entropy(model(x), y, reduction="sum"), (y >= 0).sum()


@pytest.mark.parametrize("feature, kw, want", [
    ("plain", {}, {("MainThread", "read"): 1}),
    ("batchnorm", {}, {("MainThread", "read"): 1}),
    ("micro-batches", {"micro_batches": 3}, {("MainThread", "read"): 1}),
    ("clipping", {"clip_grad_norm": 0.5}, {("MainThread", "read"): 1}),
    ("bf16 transfer", {"grad_transfer": "bf16"}, {("MainThread", "read"): 1}),
    # the counts and 1 / C stay on the devices; read with the losses
    ("(loss_sum, count)", {}, {("MainThread", "read"): 1}),
    ("(loss_sum, count), micro-batches", {"micro_batches": 2}, {("MainThread", "read"): 1}),
    # the host optimizer steps during backward: the counts are read (once) and checked before it
    ("(loss_sum, count), update='host'", {"update": "host"}, {("MainThread", "read"): 2}),
    # with a ring the host holds no full row: replica 0's averaged gradient comes to the host in one copy (one wait;
    # it was one blocking copy per parameter, which the counter did not see)
    ("update='host', host_memory", {"update": "host", "host_memory": 1 << 16, "segment_bytes": 1024},
     {("MainThread", "read"): 2}),
    # the non-finite count of the reduced gradient: read with the losses
    ("typical", {"mode": "typical"}, {("MainThread", "read"): 1}),
    ("typical, clipping", {"mode": "typical", "clip_grad_norm": 0.5}, {("MainThread", "read"): 1}),
    # replica 1's lr compared with replica 0's on the device, the count read with the losses; the
    # rest is torch's SGD, not cgdp: its foreach step reads a tensor lr once per device
    # (``alpha=-lr``, an ``.item()``)
    ("tensor lr", {}, {("MainThread", "read"): 1, ("cgdp-cuda:0", "read"): 1, ("cgdp-cuda:1", "read"): 1}),
    # the user's gradient hooks run on the average once it is known to be finite (at the read);
    # the norm of what they return is read after them
    ("gradient hook, clipping", {"clip_grad_norm": 0.5}, {("MainThread", "read"): 2}),
])
def test_trainer_waits_per_step(feature, kw, want):
    """One wait per step beyond the host sum's arrivals: the loss it returns, read once for all
    devices (and micro-batches). Before: a backward-done wait and a loss read per device, a flag
    read per device for BatchNorm, a loss read per device and micro-batch, inputs from pageable
    memory."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 12, generator=g), torch.randint(0, 4, (12,), generator=g)
    model = mlp(feature == "batchnorm")
    if feature.startswith("gradient hook"):
        model[0].weight.register_hook(lambda grad: grad * 0.5)
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        with cgdp.Trainer(model, tensor_lr if feature == "tensor lr" else sgd,
                          ["cuda:0", "cuda:1"], chunks=1, **kw) as tr:
            if feature.startswith("(loss_sum, count)"):
                got = counted_step(sim, lambda: tr.step((x, y), pair_loss))
            else:
                host_sum = not feature.startswith("typical")
                got = counted_step(sim, lambda: tr.step(x, y, F.cross_entropy), host_sum=host_sum)
    assert got == Counter(want)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("clipping", [None, "model.clip_grad_norm_", "torch.nn.utils.clip_grad_norm_"])
@pytest.mark.parametrize("batchnorm", [False, True])
def test_dataparallel_waits_per_iteration(optimizer, clipping, batchnorm):
    """One wait per iteration, whatever the loop adds: no wait in forward (BatchNorm's buffers: a mask on the device),
    none in clipping (the norm is taken on replica 0's device, the coefficient stays there; torch's own
    clip_grad_norm_ on the model's parameters as on one device), inputs through page-locked memory; what is left is
    the check for gradients edited through ``.data`` at optimizer.step() (docs/cuda.md). Before: two reads per check,
    a flag read per device in a BatchNorm forward, the coefficient from pageable memory, inputs from pageable memory,
    and one more check (a read) in model.clip_grad_norm_."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 12, generator=g), torch.randint(0, 4, (12,), generator=g)
    with simulated_cuda(2, max_delay_s=0.0) as sim:
        with cgdp.DataParallel(mlp(batchnorm), ["cuda:0", "cuda:1"], chunks=1) as dp:
            opt = dp.bind(torch.optim.AdamW(dp.parameters(), lr=1e-3) if optimizer == "adamw"
                          else torch.optim.SGD(dp.parameters(), lr=0.05))
            yd = y.to(sim.runtime.torch_device(0))  # the user's own upload, once

            def step():
                opt.zero_grad()
                F.cross_entropy(dp(x), yd).backward()
                if clipping == "model.clip_grad_norm_":
                    dp.clip_grad_norm_(0.5)
                elif clipping:
                    torch.nn.utils.clip_grad_norm_(dp.parameters(), 0.5)
                opt.step()
            got = counted_step(sim, step)
    assert got == Counter({("MainThread", "read"): 1})


def test_torch_code_moving_a_tensor_to_the_device_it_read_stays_on_that_device():
    """On a GPU, torch's clip_grad_norm_ moves each norm and the coefficient to the device it read from the gradients
    (``.to(cuda:0)`` of a tensor on cuda:0: no copy). The simulator shows torch's code ``cpu`` as that device, so a
    move there must stay on it too (it counted a read per parameter); a move to the host by name still reads."""
    with simulated_cuda(1, max_delay_s=0.0) as sim:
        d0 = sim.runtime.torch_device(0)
        grads = [torch.ones(3, device=d0), torch.ones(2, device=d0)]
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        sim.reset_host_syncs()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        assert sim.host_syncs() == Counter()
        assert sim.syncs.device_of(norm) == 0 and sim.syncs.device_of(params[0].grad) == 0
        float(norm)
        grads[0].to("cpu")
        assert sim.host_syncs() == Counter({("MainThread", "read"): 2})
        # torch's other moves to a cpu device object are reads, as on a GPU: Module.to("cpu"), an average kept on
        # the host (AveragedModel(device=cpu), an EMA)
        from torch.optim.swa_utils import AveragedModel
        net = torch.nn.Linear(4, 4).to(d0)
        ema = AveragedModel(net, device=torch.device("cpu"))
        sim.reset_host_syncs()
        ema.update_parameters(net)
        assert sim.host_syncs() == Counter({("MainThread", "read"): 2})
        net.to("cpu")
        assert sim.host_syncs() == Counter({("MainThread", "read"): 4}) and sim.syncs.device_of(net.weight) is None


def test_tensor_hyperparameters_that_differ_reject_the_step_after_backward():
    """Compared on the devices, read with the losses: a tensor lr changed on one replica only is
    found when the step reads its losses, before the update; the error names it, nothing is
    applied, and the fix the message names lets training go on."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 12, generator=g), torch.randint(0, 4, (12,), generator=g)
    with simulated_cuda(2, max_delay_s=0.0):
        with cgdp.Trainer(mlp(), tensor_lr, ["cuda:0", "cuda:1"], chunks=1) as tr:
            tr.step(x, y, F.cross_entropy)
            before = {k: v.clone() for k, v in tr.replicas[0].state_dict().items()}
            with torch.no_grad():
                tr.optimizers[0].param_groups[0]["lr"].fill_(0.01)
            with pytest.raises(HyperparameterMismatchError, match=r"optimizers\[1\].*'lr'"):
                tr.step(x, y, F.cross_entropy)
            assert tr.step_count == 1
            assert all(torch.equal(v, before[k]) for k, v in tr.replicas[0].state_dict().items())
            with torch.no_grad():
                tr.optimizers[1].param_groups[0]["lr"].fill_(0.01)
            tr.step(x, y, F.cross_entropy)
            assert tr.step_count == 2
            for r in tr.replicas[1:]:
                assert all(torch.equal(v.cpu(), p.cpu()) for v, p in zip(r.parameters(), tr.replicas[0].parameters()))
