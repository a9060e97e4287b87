"""PyTorch's own DataParallel tests (``test/distributed/test_data_parallel.py``, torch 2.x), ported to
``cgdp.DataParallel``: our own port, case by case, with each adaptation said where it is made.

Common adaptations:

* Devices: torch's cases need two GPUs. Each case here runs twice (the ``devices`` fixture): on
  two CPU-emulated devices (``"cpu:0", "cpu:1"``) and on ``"cuda:0", "cuda:1"`` under
  ``cgdp.testing.simulated_cuda(2)``, where cgdp's CUDA backend runs on a simulated asynchronous
  runtime over host memory (its tensors live on the CPU and report ``cpu:N`` as their device,
  except to torch's own code, so ``torch.testing`` compares them with host results). Device ids ``(0, 1)`` become ``devices``, ``(1, 0)`` ``devices[::-1]``.
* ``nn.DataParallel(m, ids)`` and the functional ``data_parallel(m, inputs, ids)`` both become
  ``cgdp.DataParallel(m, devices)`` called on the inputs, closed after use. cgdp has no functional
  API (``parallel_apply``, ``scatter``, ``gather``, ``replicate``): what those cases check is
  checked through the module, or against cgdp's own internal scatter and gather.
* torch sets the default dtype to float64 for the whole file; here float64 is given where a case
  depends on it (gradcheck), so the rest of the suite is not affected.
* ``out.get_device() == 0`` becomes ``out.device == model.output_device`` (``devices[0]``).

Each documented difference (where cgdp does something else on purpose) is tested as cgdp's
behaviour, and listed in docs/migration.md ("PyTorch's own DataParallel tests").
"""
import contextlib
import gc
import io
import re
from collections import OrderedDict
from copy import deepcopy
from itertools import product

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.engine.dataparallel.scatter import gather as cgdp_gather
from cgdp.engine.dataparallel.scatter import scatter as cgdp_scatter
from cgdp.testing import simulated_cuda
from cgdp.testing import inside

HOST = [torch.device("cpu"), torch.device("cpu")]
"""The torch devices of two emulated (or simulated) devices: both in host memory."""
PREC = {torch.float: 1e-5, torch.double: 1e-5, torch.half: 1e-2}
"""torch's dtype2prec_DONTUSE for the dtypes used here."""


@pytest.fixture(params=["emulated", "simulated_cuda"])
def devices(request):
    torch.manual_seed(0)
    if request.param == "emulated":
        yield ["cpu:0", "cpu:1"]
    else:
        with simulated_cuda(2, seed=3, max_delay_s=0.0005):
            yield ["cuda:0", "cuda:1"]


@contextlib.contextmanager
def wrapped(module, devices, **kw):
    model = cgdp.DataParallel(module, devices, **kw)
    try:
        yield model
    finally:
        model.close()


def data_parallel(module, inputs, devices, module_kwargs=None):
    """torch's functional ``data_parallel``: wrap, run once, unwrap."""
    with wrapped(module, devices) as model:
        return model(*inputs, **(module_kwargs or {}))


# ------------------------------------------------------------------ TestDataParallel
class _BuffersRequiringGrad(nn.Module):
    """torch's TestModule of the two cases below."""

    def __init__(self, t):
        super().__init__()
        self.register_buffer("t_rg", t)
        self.register_buffer("t_not_rg", t.clone().detach())

    def forward(self, x):
        return x * self.t_rg + self.t_not_rg


def test_data_parallel_buffers_requiring_grad(devices):
    # adaptation: 10 features instead of 100 (gradcheck's cost grows with them), float64 given
    m = _BuffersRequiringGrad(torch.randn(10, dtype=torch.double, requires_grad=True))
    assert m.t_rg.requires_grad
    with wrapped(m, devices) as dpm:
        inp = torch.randn(2, 10, dtype=torch.double)
        assert torch.autograd.gradcheck(lambda t: dpm(inp), (m.t_rg,), check_batched_grad=False)


def test_data_parallel_buffers_requiring_grad_backward(devices):
    """torch's case above, by backward instead of gradcheck: the summed gradient reaches the buffer's leaf. Difference:
    torch's case creates the buffer on the GPU; here it is created on the host, so on a GPU (the simulated runtime)
    wrapping moves it, as ``model.to()`` does, which makes the module's buffer a non-leaf: the gradient goes to the
    tensor it was moved from, as in torch, and cgdp says so when wrapping."""
    t = torch.randn(10, dtype=torch.double, requires_grad=True)
    inp = torch.randn(4, 10, dtype=torch.double)
    ref = _BuffersRequiringGrad(t.detach().clone().requires_grad_())
    (ref(inp) ** 2).sum().backward()
    moved = devices[0].startswith("cuda")
    with contextlib.ExitStack() as stack:
        if moved:
            stack.enter_context(pytest.warns(UserWarning, match="t_rg require grad and were moved"))
        m = _BuffersRequiringGrad(t)
        with wrapped(m, devices) as dpm:
            (dpm(inp) ** 2).sum().backward()
    assert m.t_rg.is_leaf is not moved
    torch.testing.assert_close(t.grad, ref.t_rg.grad, rtol=1e-12, atol=1e-12)


def test_data_parallel_rnn(devices):
    # adaptation: LSTM(30, 64) instead of LSTM(300, 1024), to keep CI lean
    class TestModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(30, 64, 1, batch_first=True, bidirectional=True)

        def forward(self, x):
            self.rnn.flatten_parameters()
            return self.rnn(x)

    def step(model):
        opt = torch.optim.SGD(model.parameters(), lr=10)
        output = model(torch.ones(4, 4, 30))
        F.mse_loss(output[0], torch.zeros_like(output[0])).backward()
        opt.step()

    with torch.no_grad():
        model = TestModule()
        model_dp = cgdp.DataParallel(deepcopy(model), devices)
        model_dp(torch.rand(2, 4, 30))  # no crash with grad disabled (torch #21108)
    try:
        step(model)
        step(model_dp)
        for p1, p2 in zip(model.parameters(), model_dp.parameters()):
            assert p1.allclose(p2)
    finally:
        model_dp.close()


def test_data_parallel_lazy_linear(devices):
    # difference: refused when wrapping (cgdp copies the replicas once), with torch's words;
    # torch refuses at the first forward
    with pytest.raises(RuntimeError, match="Modules with uninitialized parameters"):
        model_dp = cgdp.DataParallel(nn.LazyLinear(10), devices)
        model_dp(torch.rand(10, 10))


def test_parallel_apply(devices):
    # difference: no parallel_apply function. What it checks, each replica running its own inputs
    # (on its own device thread) with the outputs in device order, is checked through forward
    l1 = nn.Linear(10, 5)
    i1, i2 = torch.randn(2, 10), torch.randn(2, 10)
    expected = torch.cat([l1(i1), l1(i2)]).detach()
    with wrapped(l1, devices) as model:
        torch.testing.assert_close(model(torch.cat([i1, i2])), expected)
        for j, (r, part) in enumerate(zip(model.replicas, (i1, i2))):
            torch.testing.assert_close(r(part), expected[2 * j:2 * j + 2])


def test_parallel_apply_autocast(devices):
    # difference as above; adaptation: CPU autocast to bfloat16 instead of CUDA autocast to float16
    # (the replicas' tensors are in host memory on emulated and simulated devices)
    l1 = nn.Linear(10, 5)
    i = torch.randn(4, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = l1(i)
    with wrapped(l1, devices) as model, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(i)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)


def test_parallel_apply_passes_exception(devices):
    # difference as above: a replica's exception reaches the caller with its own type and
    # message; the note that follows it names the replica and device (torch prefixes "Caught
    # KeyError in replica 0 on device 0"). Adaptation: two devices (cgdp does not put two
    # replicas on one device unless asked)
    class TestModule(nn.Module):
        def forward(self, *args):
            return {}["wonderful"]

    with wrapped(TestModule(), devices) as model:
        with pytest.raises(KeyError, match="wonderful") as info:
            model(torch.randn(4, 3))
    # whichever replica's failure was recorded first
    assert any(re.fullmatch(r"\(raised in replica (\d) of cgdp.DataParallel, on (cpu|cuda):\1\)", n)
               for n in info.value.__notes__)


def test_data_parallel_multiple_input(devices):
    class TestModule(nn.Module):
        def forward(self, var1, var2, float1, var3=None):
            if var3 is None:
                return float1 * (var1 * var2)
            return float1 * (var1 * var2 + var3)

    m = TestModule()
    var1 = torch.randn(5, 5, requires_grad=True)
    var2 = torch.randn(5, 5, requires_grad=True)
    var3 = torch.randn(5, 5, requires_grad=False)
    float1 = torch.randn(1).item()

    expected = m(var1, var2, float1)
    expected.sum().backward()
    gvar1_exp, gvar2_exp = var1.grad.clone(), var2.grad.clone()

    def local_test(out):
        with torch.no_grad():
            var1.grad.fill_(0.0)
            var2.grad.fill_(0.0)
        out.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(var1.grad, gvar1_exp)
        torch.testing.assert_close(var2.grad, gvar2_exp)

    local_test(data_parallel(m, (var1, var2, float1), devices))
    local_test(data_parallel(m, (var1, var2, float1), devices[::-1]))
    local_test(data_parallel(m, (var1, var2, float1), devices[:1]))

    with torch.no_grad():
        var1.grad.fill_(0.0)
        var2.grad.fill_(0.0)
    expected = m(var1, var2, float1, var3=var3)
    expected.sum().backward()
    gvar1_exp, gvar2_exp = var1.grad.clone(), var2.grad.clone()

    with wrapped(TestModule(), None) as dpm:  # devices=None: every device, as device_ids=None
        local_test(dpm(var1, var2, float1, var3=var3))
    with wrapped(TestModule(), devices[:1]) as dpm:
        local_test(dpm(var1, var2, float1, var3=var3))
    local_test(data_parallel(m, (var1, var2, float1), devices, module_kwargs={"var3": var3}))
    local_test(data_parallel(m, (var1, var2, float1), devices[:1], module_kwargs={"var3": var3}))


def test_data_parallel_small_back(devices):
    lin = nn.Linear(10, 5)
    i = torch.randn(20, 10)
    out = data_parallel(lin, (i,), devices)
    torch.testing.assert_close(out, lin(i))


def test_data_parallel_model_device(devices):
    # difference: torch refuses a module that is not on device_ids[0] ("module must have its
    # parameters and buffers on device ..."); cgdp moves it there itself (replica 0 is trained in
    # place, as with Trainer), and refuses to move the wrapper afterwards (it would move replica 0
    # alone). torch's 21 placements of a Linear, a Sequential of one and of two Linears all run
    l = nn.Linear(2, 2)
    inp = torch.randn(2, 2)
    expected = l(inp)
    for ids in (devices, devices[::-1], devices[:1]):
        for module in (l, nn.Sequential(l), nn.Sequential(deepcopy(l), nn.Identity())):
            with wrapped(module, ids) as dpm:
                torch.testing.assert_close(dpm(inp), expected)
                assert all(p.device == dpm.output_device for p in dpm.module.parameters())
                with pytest.raises(RuntimeError, match="Convert the model before wrapping"):
                    dpm.to(torch.float64)


def test_data_parallel_model_no_refcycles(devices):
    # adaptation: the first cgdp model of a process compiles the host sum (Numba), whose compiler
    # leaves reference cycles of its own; that is done before counting. Then, as torch checks,
    # building a model and running a forward leaves no cycle behind
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(1, 1)

        def forward(self, x):
            return self.linear(x)

    with wrapped(Model(), devices) as warm:
        warm(torch.randn(1))
    gc.collect()
    model = cgdp.DataParallel(Model(), devices)
    model(torch.randn(1))
    refcycles = gc.collect()
    model.close()
    assert refcycles == 0


def test_data_parallel_no_grad(devices):
    class Layer(nn.Module):
        def forward(self, x):
            assert not torch.is_grad_enabled()
            return x

    layer = Layer()
    i = torch.randn(20, 10)
    with torch.no_grad():
        data_parallel(layer, (i,), devices)
    with pytest.raises(AssertionError):
        data_parallel(layer, (i,), devices)


def _against_one_device(lin, i, devices):
    """torch's test_data_parallel and test_data_parallel_sparse: both device orders, then None."""
    expected_out = lin(i)
    expected_out.sum().backward()
    expected_grads = [p.grad.clone() for p in lin.parameters()]
    for ids in (devices, devices[::-1]):
        lin.zero_grad()
        with wrapped(lin, ids) as model:
            out = model(i)
            out.sum().backward()
            assert out.device == model.output_device
            torch.testing.assert_close(out, expected_out)
            for expected, param in zip(expected_grads, lin.parameters()):
                got = param.grad
                assert got.layout == expected.layout
                if expected.is_sparse:
                    got, expected = got.coalesce(), expected.coalesce()
                torch.testing.assert_close(got, expected)
    data_parallel(lin, (i,), None)  # devices=None: every device


def test_data_parallel(devices):
    _against_one_device(nn.Linear(10, 5), torch.randn(20, 10), devices)


def test_data_parallel_sparse(devices):
    _against_one_device(nn.Embedding(10, 5, sparse=True), torch.randint(10, (20, 5), dtype=torch.long), devices)


def test_data_parallel_nested_output(devices):
    def fn(input):
        return [input, (input.sin(), input.cos(), [input.add(1)]), input,
                OrderedDict(a=input, b=[input.sin()])]

    class Net(nn.Module):
        def forward(self, input):
            return fn(input)

    i = torch.randn(2, 2)
    output = data_parallel(Net(), (i,), devices)
    torch.testing.assert_close(output, fn(i))
    assert isinstance(output[0], torch.Tensor)
    assert isinstance(output[1], tuple)
    assert isinstance(output[1][0], torch.Tensor) and isinstance(output[1][1], torch.Tensor)
    assert isinstance(output[1][2], list) and isinstance(output[1][2][0], torch.Tensor)
    assert isinstance(output[2], torch.Tensor)
    assert isinstance(output[3], dict) and len(output[3]) == 2
    assert isinstance(output[3]["a"], torch.Tensor)
    assert isinstance(output[3]["b"], list) and isinstance(output[3]["b"][0], torch.Tensor)


def test_data_parallel_nested_input(devices):
    def fn(input):
        return input[1][0]

    class Net(nn.Module):
        def forward(self, *input):
            return fn(input)

    i = torch.randn(20, 3)
    input = (i.cos(), (i.sin(), i), i.sin())
    torch.testing.assert_close(data_parallel(Net(), input, devices), fn(input))


def test_data_parallel_module_zero_inputs(devices):
    class TestModule(nn.Module):
        def forward(self):
            t = torch.eye(2, 3)
            return t + (1 - t)

    expected = torch.ones(2, 3)
    for ids in (devices[:1], devices):
        with wrapped(TestModule(), ids) as model:
            out = model()  # nothing to split: replica 0 runs it, as torch runs device 0
            assert out.device == model.output_device
            torch.testing.assert_close(out, expected)


def test_data_parallel_device_args(devices):
    # difference: there is no output_device argument; outputs are gathered on devices[0]
    # (model.output_device). Devices given as torch.device work, as in torch
    lin = nn.Linear(10, 5)
    i = torch.randn(20, 10, requires_grad=True)
    expected = lin(i)
    with wrapped(lin, [torch.device(d) for d in devices]) as model:
        out = model(i)
        assert model.devices == devices and out.device == model.output_device
        torch.testing.assert_close(out, expected)
    with pytest.raises(TypeError, match="output_device"):
        cgdp.DataParallel(lin, devices, output_device=devices[0])


def test_data_parallel_function_deletion(devices):
    # difference: a gradient penalty (torch.autograd.grad with create_graph=True, then backward of
    # that gradient) through a model that trains is refused with a clear error: the second
    # backward reaches the replicas' parameters without passing through the gather, where cgdp
    # arms its engine, and would give replica 0's share only. Input gradients without
    # create_graph, and of a frozen model, work (tests/test_dataparallel_dropin.py)
    def gradient_penalty(net, x):
        output = net(x)
        return torch.autograd.grad(outputs=output, inputs=x, grad_outputs=x.new_ones(output.size()),
                                   create_graph=True, retain_graph=True)[0].mean()

    net = nn.Linear(4, 1)
    with wrapped(net, devices) as dpn:
        x = torch.ones(2, 4, requires_grad=True)
        dpn.zero_grad()
        with pytest.raises(RuntimeError, match="create_graph=True"):
            gradient_penalty(dpn, x)
        # and the model goes on training
        dpn(x).sum().backward()
        torch.testing.assert_close(net.bias.grad, torch.tensor([2.0]))


def _test_scatter(tensor):
    # adaptation: against cgdp's own scatter (no public functional API); both parts in host memory
    x = tensor.detach().requires_grad_()
    parts, sizes = cgdp_scatter((x,), {}, HOST)
    result = [p[0][0] for p in parts]
    assert len(result) == 2 and sizes == [2, 2]
    torch.testing.assert_close(result[0], x[:2])
    torch.testing.assert_close(result[1], x[2:])
    grad = result[0].detach().clone().fill_(2)
    result[0].backward(grad)
    torch.testing.assert_close(x.grad[:2], grad)
    torch.testing.assert_close(x.grad[2:], grad.clone().zero_())
    fn = lambda y: tuple(p[0][0] for p in cgdp_scatter((y,), {}, HOST)[0])  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), check_batched_grad=False)
    assert torch.autograd.gradgradcheck(fn, (x,), check_batched_grad=False)


def test_scatter_cpu():
    _test_scatter(torch.randn(4, 4, dtype=torch.double))


def test_scatter_gpu():
    # adaptation: simulated devices keep their tensors in host memory: the same as the CPU case
    with simulated_cuda(2):
        _test_scatter(torch.randn(4, 4, dtype=torch.double))


def test_data_parallel_complex(devices):
    # difference: complex parameters are refused with a clear error (the host sums float32,
    # float64, bfloat16 or float16); torch broadcasts them through view_as_real
    class Cplx(nn.Module):
        def __init__(self):
            super().__init__()
            self.cplx = nn.Parameter(torch.zeros(1, 10, dtype=torch.cfloat))

        def forward(self, x):
            return x + self.cplx

    with pytest.raises(TypeError, match="complex64"):
        cgdp.DataParallel(Cplx(), devices)


def _test_gather():
    # adaptation: against cgdp's own gather, on devices[0] (there is no output_device)
    dst = HOST[0]
    inputs = (torch.randn(2, 4, dtype=torch.double, requires_grad=True),
              torch.randn(2, 4, dtype=torch.double, requires_grad=True))
    result = cgdp_gather(inputs, [2, 2], dst, None)
    assert result.size() == torch.Size([4, 4])
    torch.testing.assert_close(result[:2], inputs[0])
    torch.testing.assert_close(result[2:], inputs[1])
    grad = torch.randn(4, 4, dtype=torch.double)
    result.backward(grad)
    torch.testing.assert_close(inputs[0].grad, grad[:2])
    torch.testing.assert_close(inputs[1].grad, grad[2:])
    fn = lambda x, y: cgdp_gather((x, y), [2, 2], dst, None)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs, check_batched_grad=False)
    assert torch.autograd.gradgradcheck(fn, inputs, check_batched_grad=False)

    # difference: a floating 0-dim output (a loss) is combined, not stacked into a vector of G:
    # weighted by the replicas' shares of the samples, or summed (scalar_outputs); integer ones
    # are stacked as in torch
    inputs = (torch.randn((), dtype=torch.double, requires_grad=True),
              torch.randn((), dtype=torch.double, requires_grad=True))
    result = cgdp_gather(inputs, [3, 1], dst, None)
    assert result.size() == torch.Size([])
    torch.testing.assert_close(result, 0.75 * inputs[0] + 0.25 * inputs[1])
    result.backward(torch.tensor(2.0, dtype=torch.double))
    torch.testing.assert_close(inputs[0].grad, torch.tensor(1.5, dtype=torch.double))
    torch.testing.assert_close(inputs[1].grad, torch.tensor(0.5, dtype=torch.double))
    summed = cgdp_gather(inputs, [3, 1], dst, None, sum_scalars=True)
    torch.testing.assert_close(summed, inputs[0] + inputs[1])
    for fn in (lambda x, y: cgdp_gather((x, y), [3, 1], dst, None),
               lambda x, y: cgdp_gather((x, y), [3, 1], dst, None, sum_scalars=True)):
        assert torch.autograd.gradcheck(fn, inputs, check_batched_grad=False)
        assert torch.autograd.gradgradcheck(fn, inputs, check_batched_grad=False)
    stacked = cgdp_gather((torch.tensor(3), torch.tensor(4)), [1, 1], dst, None)
    assert stacked.size() == torch.Size([2]) and stacked.tolist() == [3, 4]


def test_gather_cpu():
    _test_gather()


def test_gather_gpu():
    with simulated_cuda(2):  # adaptation: as test_scatter_gpu
        _test_gather()


def test_gather_different_len_dicts():
    inputs = ({"a": torch.randn(1, 2, requires_grad=True)},
              {"b": torch.randn(1, 2, requires_grad=True), "a": torch.randn(1, 2, requires_grad=True)})
    with pytest.raises(ValueError):
        cgdp_gather(inputs, [1, 1], HOST[0], None)


def test_replicate(devices):
    # adaptation: replicate() is done once, when wrapping; model.replicas are the replicas
    module = nn.Linear(10, 5)
    input = torch.randn(2, 10)
    expected_output = module(input).detach()
    with wrapped(module, devices) as model:
        for replica, dev in zip(model.replicas, inside(model).devices):
            assert all(p.device == dev.torch_device for p in replica.parameters())
            torch.testing.assert_close(replica(input), expected_output)


def test_replicate_buffers(devices):
    net = nn.Module()
    net.bn = nn.BatchNorm2d(10)
    with wrapped(net, devices) as model:
        for replica, dev in zip(model.replicas, inside(model).devices):
            for b in (replica.bn.running_mean, replica.bn.running_var, replica.bn.num_batches_tracked):
                assert b.device == dev.torch_device


def test_zero_grad(devices):
    # difference: torch's replicas are differentiable copies, and zero_grad() inside their forward
    # warns that it has no effect. cgdp's replicas are modules of their own: zero_grad() inside
    # forward does what it does on one device (clears the gradients this backward then fills)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x):
            self.zero_grad()
            return self.lin(x)

    net = Net()
    ref = deepcopy(net)
    x = torch.rand(4, 6)
    with wrapped(net, devices) as dpm:
        for _ in range(2):  # no zero_grad between: forward does it
            dpm(x).pow(2).sum().backward()
            ref(x).pow(2).sum().backward()
            for p, q in zip(net.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)


def test_autocast(devices):
    # adaptation: CPU autocast to bfloat16 (torch: CUDA autocast to float16)
    class Model(nn.Linear):
        def __init__(self):
            super().__init__(8, 8)

        @torch.autocast("cpu", dtype=torch.bfloat16)
        def forward(self, input):
            return super().forward(input)

    with wrapped(Model(), devices) as model:
        assert model(torch.randn(8, 8)).dtype is torch.bfloat16


def test_save_replica_module(devices):
    # adaptation: the replicas are model.replicas, and the model itself (torch gh-37182)
    module = nn.Linear(8, 8)
    with wrapped(module, devices) as model:
        model(torch.randn(4, 8)).sum().backward()
        data = io.BytesIO()
        torch.save(model.replicas, data)
        torch.save(model.module, data)


LAYER_FORMATS = ([torch.contiguous_format] * 4,
                 [torch.channels_last] * 2 + [torch.contiguous_format] * 2,
                 [torch.channels_last] * 4)
LAYER_DTYPES = ([torch.float] * 4, [torch.float] * 2 + [torch.half] * 2, [torch.half] * 4)


class ConvNet(nn.Module):
    def __init__(self, layouts, dtype_list):
        super().__init__()
        self.dtypes = dtype_list
        self.conv0 = nn.Conv2d(8, 16, (2, 2)).to(memory_format=layouts[0], dtype=dtype_list[0])
        self.conv1 = nn.Conv2d(16, 32, (2, 2)).to(memory_format=layouts[1], dtype=dtype_list[1])
        self.conv2 = nn.Conv2d(32, 16, (2, 2)).to(memory_format=layouts[2], dtype=dtype_list[2])
        self.conv3 = nn.Conv2d(16, 8, (2, 2)).to(memory_format=layouts[3], dtype=dtype_list[3])

    def forward(self, x):
        x = x.to(self.dtypes[0])
        x = self.conv0(x).to(self.dtypes[1])
        x = self.conv1(x).to(self.dtypes[2])
        x = self.conv2(x).to(self.dtypes[3])
        return self.conv3(x)


@pytest.mark.parametrize("formats,dtype_list", list(product(LAYER_FORMATS, LAYER_DTYPES)),
                         ids=[f"{a}-{b}" for a, b in product(["contiguous", "mixed_layout", "channels_last"],
                                                             ["float", "float_and_half", "half"])])
def test_strided_grad_layout(devices, formats, dtype_list):
    # adaptation: one (formats, dtypes) combination per test item; 8 samples per device.
    # difference: the three combinations that mix float and half parameters are refused with a
    # clear error (cgdp's flat gradient buffer holds one dtype)
    ndevs = len(devices)
    input = torch.randn(ndevs * 8, 8, 8, 8)
    target = torch.randn(ndevs * 8, 8, 4, 4)
    m = ConvNet(formats, dtype_list)
    if len(set(dtype_list)) > 1:
        with pytest.raises(TypeError, match="one dtype"):
            cgdp.DataParallel(deepcopy(m), devices)
        return
    tol = 1e-3 if dtype_list[0] is torch.half else 1e-5
    with wrapped(deepcopy(m), devices) as m_dp:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt_dp = torch.optim.SGD(m_dp.parameters(), lr=0.1)
        for _ in range(2):  # the first iteration creates the gradients, the second zeroed ones
            F.mse_loss(m(input).float(), target).backward()
            F.mse_loss(m_dp(input).float(), target).backward()
            for i, ((name, m_child), m_dp_child) in enumerate(zip(m.named_children(), m_dp.module.children())):
                assert m_child.weight.grad.is_contiguous(memory_format=formats[i]), name
                assert m_dp_child.weight.grad.is_contiguous(memory_format=formats[i]), name
                for p, p_dp in zip(m_child.parameters(), m_dp_child.parameters()):
                    torch.testing.assert_close(p.grad, p_dp.grad, rtol=tol, atol=tol)
            opt.step()
            opt_dp.step()
            opt.zero_grad()
            opt_dp.zero_grad()


def test_parameter_list_dict_replica(devices):
    # difference: torch's replicas hold differentiable copies of replica 0's parameters (with a
    # grad_fn); cgdp's hold parameters of their own (leaves, stepped by a bound optimizer's mirrors).
    # The values, requires_grad, and what ParameterList / ParameterDict hold are the same
    class MyMod(nn.Module):
        def __init__(self, data, check_fn):
            super().__init__()
            self.data = data
            self.check_fn = check_fn

        def forward(self, inp):
            self.check_fn(self)
            return inp

    p1 = nn.Parameter(torch.rand(10))
    p2 = nn.Parameter(torch.rand(10))
    seen = []

    def check_fn(self_, key0, key1):
        torch.testing.assert_close(p1, self_.data[key0])
        torch.testing.assert_close(p2, self_.data[key1])
        assert self_.data[key0].requires_grad and self_.data[key1].requires_grad
        assert self_.data[key0].grad_fn is None and self_.data[key1].grad_fn is None
        seen.append(self_)

    for data, keys in ((nn.ParameterList([p1, p2]), (0, 1)), (nn.ParameterDict({"0": p1, "1": p2}), ("0", "1"))):
        seen.clear()
        with wrapped(MyMod(data, lambda m, k=keys: check_fn(m, *k)), devices) as model:
            model(torch.randn(8, 8))  # runs check_fn on every replica
        assert len(seen) == len(devices)


# ------------------------------------------------------------------ TestDataParallelDeviceType
# adaptation: torch instantiates these for CUDA only; here on both kinds of device
DTYPES = [torch.float, torch.double, torch.half]


class Net(nn.Module):
    def __init__(self, lin, key=None):
        super().__init__()
        self.l = lin
        self.key = key

    def forward(self, input):
        return self.l(input if self.key is None else input[self.key])


@pytest.mark.parametrize("dtype", DTYPES)
def test_data_parallel_module(devices, dtype):
    lin = nn.Linear(10, 5).to(dtype)
    i = torch.randn(20, 10, dtype=dtype)
    expected_out = lin(i)
    with wrapped(lin, devices) as net:
        out = net(i)
        assert out.device == net.output_device
        torch.testing.assert_close(out, expected_out, atol=PREC[dtype], rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_data_parallel_module_kwargs_only(devices, dtype):
    lin = nn.Linear(10, 5).to(dtype)
    i = torch.randn(20, 10, dtype=dtype)
    expected_out = lin(i)
    with wrapped(Net(lin), devices) as n:
        out = n(input=i)
        assert out.device == n.output_device
        torch.testing.assert_close(out, expected_out, atol=PREC[dtype], rtol=0)


@pytest.mark.parametrize("unused", [[], {}, ()], ids=["empty_list", "empty_dict", "empty_tuple"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_data_parallel_module_kwargs_only_empty(devices, dtype, unused):
    # torch's test_data_parallel_module_kwargs_only_empty_{list,dict,tuple}, one parametrized test
    lin = nn.Linear(10, 5).to(dtype)
    i = torch.randn(20, 10, dtype=dtype)
    expected_out = lin(i)
    with wrapped(Net(lin, "data"), devices) as n:
        out = n(input={"data": i, "unused": unused})
        assert out.device == n.output_device
        torch.testing.assert_close(out, expected_out, atol=PREC[dtype], rtol=0)
