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


def test_sync_each_batch_sums_every_backward():
    """``GradientAccumulationPlugin(sync_each_batch=True)``: no ``no_sync`` in ``accumulate()`` (Accelerate honours it
    with several processes only), so between micro-batches ``.grad`` holds the summed gradient, as on one device, and
    the loop equals one device's."""
    from accelerate.utils import GradientAccumulationPlugin

    def plugin():
        return GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    one, net = network(), network()
    train(accelerate.Accelerator(cpu=True, gradient_accumulation_plugin=plugin()), one)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin())
    model = acc.prepare(network())
    ref = network()
    x, y = next(iter(loader()))
    with acc.accumulate(model):  # the first micro-batch of a step: not synced by Accelerate, summed here
        nn.functional.cross_entropy(model(x), y).backward()
    nn.functional.cross_entropy(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    acc.free_memory()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=plugin())
    train(acc, net)
    assert_params(one, net)
    acc.free_memory()


@pytest.mark.parametrize("device_map, words", [({"": "cpu"}, "CPU or disk offload"),
                                               ({"a": 0, "b": "disk"}, "CPU or disk offload"),
                                               ({"a": 0, "b": 1}, "on multiple devices")])
def test_a_quantized_model_offloaded_is_refused_before_wrapping(device_map, words):
    """Accelerate's guard against training a model loaded in 8 or 4 bits with CPU or disk offload, or across devices,
    runs on the user's model (it would see only cgdp's wrapper), before anything is wrapped."""
    net = network()
    net.is_loaded_in_8bit, net.hf_device_map = True, device_map
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError, match=words):
        acc.prepare(net)
    assert not acc._models
