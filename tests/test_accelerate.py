"""cgdp.integrations.accelerate.Accelerator: the user's Accelerate loop on 2 CPU-emulated devices
equals the same loop with accelerate.Accelerator on one device; save_state/load_state resume
bitwise, dropout included."""
import warnings

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import cgdp  # noqa: E402
from cgdp.integrations.accelerate import RNG_FILE, Accelerator  # noqa: E402

# the integration binds the optimizer: an unbound one would be followed through replica 0, warning
pytestmark = pytest.mark.filterwarnings("error:replica 0's parameters were changed outside")


@pytest.fixture(autouse=True)
def fresh_state():
    """Accelerate keeps its state in process-wide singletons: each Accelerator here starts clean."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def network(dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3))


class PartsBF16(nn.Module):
    """One device computing each of 2 devices' parts in its own autocast region."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        outs = []
        for part in torch.tensor_split(x, 2):
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                outs.append(self.net(part))
        return torch.cat(outs)


def loader(n=70, batch=8):
    g = torch.Generator().manual_seed(1)  # 70 samples, batches of 8: an uneven last batch
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def train(accelerator, net, epochs=2, clip=0.5):  # 2 epochs of 9 batches, the last uneven
    """The documented Accelerate loop, unchanged."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    model, opt, dl, sched = accelerator.prepare(net, opt, loader(), sched)
    losses = []
    for _ in range(epochs):
        for x, y in dl:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    losses.append(accelerator.clip_grad_norm_(model.parameters(), clip).item())
                opt.step()
                sched.step()
                opt.zero_grad()
    return model, losses


def assert_params(a, b, rtol=1e-5, atol=1e-7):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)


def test_loop_equals_one_device(monkeypatch):
    """AdamW, a scheduler, accumulation 2, clipping: the gradient norms and parameters equal one
    device's; accumulate() uses no_sync; unwrap_model and get_state_dict give the user's module."""
    one, net = network(), network()
    quiet = []
    no_sync = cgdp.DataParallel.no_sync
    monkeypatch.setattr(cgdp.DataParallel, "no_sync", lambda self: quiet.append(1) or no_sync(self))
    _, norms1 = train(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2), one)
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, norms2 = train(acc, net)
    assert not [w for w in caught if "cgdp" in str(w.message)]  # the host norm: nothing copied
    assert isinstance(model, cgdp.DataParallel) and acc.device == model.output_device
    assert len(quiet) == 8  # 9 batches an epoch: the 1st, 3rd, 5th and 7th of each accumulate quietly
    assert norms2 == pytest.approx(norms1, rel=1e-5)
    assert_params(one, net)
    assert acc.unwrap_model(model) is net
    assert list(acc.get_state_dict(model)) == list(one.state_dict())
    acc.free_memory()
    assert model.closed


def test_bf16_equals_one_device():
    """mixed_precision="bf16": equal to one device computing the same two parts in bf16; from one
    device on the whole batch in bf16 no farther than that is from float32 (AdamW turns bf16's
    rounding of near-zero gradients into steps of the learning rate)."""
    parts, two, whole, f32 = PartsBF16(network()), network(), network(), network()
    train(accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2), parts, epochs=1)
    AcceleratorState._reset_state(reset_partial_state=True)
    train(Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2), two, epochs=1)
    AcceleratorState._reset_state(reset_partial_state=True)
    train(accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2), whole, epochs=1)
    AcceleratorState._reset_state(reset_partial_state=True)
    train(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2), f32, epochs=1)
    assert_params(parts.net, two)
    for p, q, r in zip(two.parameters(), whole.parameters(), f32.parameters()):
        assert (p - q).abs().max() <= (q - r).abs().max()


def test_save_state_load_state_resume_bitwise(tmp_path):
    """save_state after 3 steps, load_state into a fresh model and optimizer, 3 more steps: bitwise
    the 6 uninterrupted steps, dropout included (the replicas' random streams are in the folder)."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(10, 8, generator=g), torch.randint(0, 3, (10,), generator=g)) for _ in range(6)]

    def steps(acc, model, opt, part):
        for x, y in part:
            acc.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()

    def prepared(acc):
        net = network(dropout=0.4)
        return (net, *acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2)))

    acc = Accelerator(cpu=True)
    whole, model, opt = prepared(acc)
    steps(acc, model, opt, batches[:3])
    acc.save_state(tmp_path)
    assert (tmp_path / RNG_FILE).is_file()
    steps(acc, model, opt, batches[3:])
    acc.free_memory()
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    resumed, model, opt = prepared(acc)
    acc.load_state(tmp_path)
    steps(acc, model, opt, batches[3:])
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    acc.free_memory()


def test_fp16_refused():
    with pytest.raises(ValueError, match="use 'bf16'"):
        Accelerator(cpu=True, mixed_precision="fp16")


def regression_setup(accelerator, batch=16, sched=False):
    """accelerate/test_utils/scripts/test_sync.py's ``get_training_setup``: its model and data, seeded."""
    from accelerate.test_utils import RegressionDataset, RegressionModel
    net = RegressionModel(a=1, b=1)
    dl = torch.utils.data.DataLoader(RegressionDataset(length=80, seed=42), batch_size=batch)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3) if sched else torch.optim.SGD(net.parameters(), lr=0.1,
                                                                                    momentum=0.9)
    if sched:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=lambda epoch: epoch**0.65)
        model, opt, dl, sched = accelerator.prepare(net, opt, dl, sched)
        return net, model, opt, dl, sched
    model, opt, dl = accelerator.prepare(net, opt, dl)
    return net, model, opt, dl


def grads(net):
    return [p.grad.detach().clone() for p in net.parameters()]


def multiple_forwards(accelerator):
    """test_sync.py's ``test_distributed_sync_multiple_fwd``: 3 forwards under ``no_sync``, their
    backwards, the last under ``trigger_sync_in_backward``, then a step. ``.grad`` after each."""
    net, model, opt, dl = regression_setup(accelerator)
    losses, seen = [], []
    for i, batch in zip(range(3), dl):
        with accelerator.no_sync(model):
            out = model(batch["x"])
            losses.append(nn.functional.mse_loss(out, batch["y"].to(out.device)))
    for i, loss in enumerate(losses):
        if i < 2:
            accelerator.backward(loss)
        else:
            with accelerator.trigger_sync_in_backward(model):
                accelerator.backward(loss)
        seen.append(grads(net))
    opt.step()
    return net, model, seen


def test_trigger_sync_in_backward_equals_one_device():
    """Several forwards under no_sync, the last backward under trigger_sync_in_backward: that
    backward sums what every replica accumulated, .grad and the step are one device's (on every
    replica); before it, replica 0 holds its own share (test_sync.py: "not in sync")."""
    one, _, ref = multiple_forwards(accelerate.Accelerator(cpu=True))
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    net, model, seen = multiple_forwards(acc)
    for i in range(2):  # accumulated locally: replica 0's share only
        assert not any(torch.allclose(g, r) for g, r in zip(seen[i], ref[i]))
    for g, r in zip(seen[2], ref[2]):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    for replica in model.replicas:
        assert_params(one, replica)
    acc.free_memory()


def accumulation(accelerator):
    """test_sync.py's ``test_gradient_accumulation_with_opt_and_scheduler``: 5 batches, accumulation
    2, AdamW and a scheduler. ``.grad`` after each micro-batch's backward, the learning rates."""
    net, model, opt, dl, sched = regression_setup(accelerator, sched=True)
    seen, lrs = [], []
    for batch in dl:
        with accelerator.accumulate(model):
            out = model(batch["x"])
            accelerator.backward(nn.functional.mse_loss(out, batch["y"].to(out.device)))
            seen.append(grads(net))
            opt.step()
            sched.step()
            opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
    return net, model, seen, lrs


@pytest.mark.parametrize("sync_each_batch", [True, False])
def test_sync_each_batch_equals_one_device(monkeypatch, sync_each_batch):
    """GradientAccumulationPlugin(sync_each_batch=True): no no_sync, every backward sums, .grad after
    each micro-batch is one device's (test_sync.py: "syncs at each grad_accum interval or if
    sync_each_batch"); False: replica 0's share between steps, one device's at each step."""
    from accelerate.utils import GradientAccumulationPlugin

    def plugin():
        return GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    one, _, ref, lrs1 = accumulation(accelerate.Accelerator(cpu=True, gradient_accumulation_plugin=plugin()))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    quiet = []
    no_sync = cgdp.DataParallel.no_sync
    monkeypatch.setattr(cgdp.DataParallel, "no_sync", lambda self: quiet.append(1) or no_sync(self))
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin())
    net, model, seen, lrs2 = accumulation(acc)
    assert lrs2 == lrs1
    for i, (g, r) in enumerate(zip(seen, ref)):
        if sync_each_batch or i % 2 == 1 or i == len(ref) - 1:
            for a, b in zip(g, r):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        else:
            assert not any(torch.allclose(a, b) for a, b in zip(g, r))
    assert len(quiet) == (0 if sync_each_batch else 2)  # 5 batches: the 1st and 3rd accumulate
    for replica in model.replicas:
        assert_params(one, replica)
    acc.free_memory()


def loaded(device_map, bits=8):
    """A module as transformers leaves a quantized or dispatched model: the attributes
    accelerate's ``prepare_model`` reads."""
    net = network()
    if bits:
        setattr(net, f"is_loaded_in_{bits}bit", True)
    net.hf_device_map = device_map
    return net


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_with_cpu_offload_refused_as_by_accelerate(bits):
    """An 8/4-bit model with CPU offload: accelerate's own ValueError, before anything is wrapped."""
    with pytest.raises(ValueError) as plain:
        accelerate.Accelerator(cpu=True).prepare(loaded({"": "cpu"}, bits))
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError) as ours:
        acc.prepare(loaded({"": "cpu"}, bits))
    assert str(ours.value) == str(plain.value) and "CPU or disk offload" in str(ours.value)
    assert acc._models == []  # nothing wrapped: no replicas, no threads


def test_device_map_of_several_entries_refused():
    """Dispatched over a device map of several entries (quantized or not): its hooks tie layers to
    devices; accelerate refuses it in a distributed mode, and cgdp's devices are one."""
    for net in (loaded({"0": "cpu", "3": "cpu"}, bits=None), loaded({"0": "cpu", "3": "cpu"}, bits=4)):
        acc = Accelerator(cpu=True)
        with pytest.raises(ValueError, match=r"dispatched by a device_map of several entries.*without a device_map"):
            acc.prepare(net)
        assert acc._models == []
        AcceleratorState._reset_state(reset_partial_state=True)


def test_one_sample_without_batch_dimension_is_said():
    """A 1-D tensor of 32 features into Linear(32, 2): one device computes it as is; cgdp splits it
    as a batch of 32 scalars, and the replica's error carries a note saying so and what to do
    (a 1-D tensor can be a batch, so it is not refused: RegressionModel's 1-D inputs train above).
    Done as the note says, the output is one device's."""
    torch.manual_seed(0)
    one = nn.Linear(32, 2)
    net = nn.Linear(32, 2)
    net.load_state_dict(one.state_dict())
    x = torch.randn(32)
    expected = accelerate.Accelerator(cpu=True).prepare(one)(x)
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True)
    model, batched = acc.prepare(net, nn.Linear(32, 2))
    with pytest.raises(RuntimeError, match="mat1 and mat2") as err:  # a batched input: no such note
        batched(torch.randn(4, 16))
    assert "1-D" not in "\n".join(getattr(err.value, "__notes__", []))
    with pytest.raises(RuntimeError, match="mat1 and mat2") as err:
        model(x)
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "split the 1-D tensor input of shape (32,) along its only dimension" in notes
    assert "16 + 16" in notes and "model(x.unsqueeze(0))" in notes
    torch.testing.assert_close(model(x.unsqueeze(0)).squeeze(0), expected)
    acc.free_memory()


def test_prepared_model_reads_the_modules_attributes():
    """accelerate/tests/test_state_checkpointing.py reads ``model.a`` on the prepared model, which on one
    device is the user's module: through cgdp an attribute the wrapper lacks is read on the module (replica 0),
    trained values included; the wrapper's own names and those with an underscore stay its."""
    acc = Accelerator(cpu=True)
    net, model, opt, dl = regression_setup(acc)
    net.config, net.labels, net.enable_feature = {"vocab": 7}, 7, lambda: None
    assert model is not net and model.labels == 7 and model.a is net.a
    with pytest.raises(AttributeError, match=r"'config' of your module is a dict, .* accelerator.unwrap_model\(model\)"
                                             r".config, and make changes .* before accelerator.prepare"):
        model.config  # a change through it would reach replica 0 alone
    with pytest.raises(AttributeError, match="is a function"):
        model.enable_feature
    batch = next(iter(dl))
    acc.backward(nn.functional.mse_loss(model(batch["x"]), batch["y"]))
    opt.step()
    assert model.a.item() == net.a.item() != 1.0 and model.module is net and model.devices == acc.devices
    with pytest.raises(AttributeError):
        model._no_such_name
    acc.free_memory()
