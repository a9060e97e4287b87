"""cgdp.DataParallel as a drop-in for nn.DataParallel: what torch's own DataParallel and one device
do with buffers that require grad, sparse gradients, pickling the wrapped model, strided gradient
layouts, frozen models, and losses normalised by a global count. Each against one device."""
import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from helpers import assert_params_close, assert_replicas_identical, bound


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def devs(g):
    return [f"cpu:{i}" for i in range(g)]


def assert_grads_identical(model):
    first = [p.grad for p in model.module.parameters()]
    for r in model.replicas[1:]:
        for g0, p in zip(first, r.parameters()):
            assert (g0 is None) == (p.grad is None)
            if g0 is not None:
                assert g0.layout == p.grad.layout
                a, b = (g0.to_dense(), p.grad.to_dense()) if g0.is_sparse else (g0, p.grad)
                assert torch.equal(a, b)


# ---------------------------------------------------------------- buffers that require grad
class BufferGrad(nn.Module):
    """A learnable scale kept as a buffer (``requires_grad=True``), next to a constant one."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("scale", torch.randn(6, requires_grad=True))
        self.register_buffer("shift", torch.randn(6))

    def forward(self, x):
        return self.lin(x) * self.scale + self.shift


@pytest.mark.parametrize("g", [2, 3])
def test_buffer_requiring_grad_gets_the_whole_gradient(g):
    net = BufferGrad()
    ref = copy.deepcopy(net)
    data = [torch.randn(10, 6) for _ in range(3)]
    with cgdp.DataParallel(net, devs(g)) as model:
        opt, ref_opt = (bound(m, torch.optim.SGD(list(m.parameters()) + [m_scale], lr=0.1))
                        for m, m_scale in ((model, net.scale), (ref, ref.scale)))
        for x in data:
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                (m(x) ** 2).mean().backward()
            torch.testing.assert_close(net.scale.grad, ref.scale.grad, rtol=1e-5, atol=1e-7)
            for m, o in ((model, opt), (ref, ref_opt)):
                o.step()
            assert_replicas_identical(model)
            for r in model.replicas[1:]:  # the buffer every replica reads is replica 0's
                assert torch.equal(r.scale.detach(), net.scale.detach())
    assert_params_close(net, ref)
    torch.testing.assert_close(net.scale, ref.scale, rtol=1e-5, atol=0)


# ---------------------------------------------------------------- sparse gradients
class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def sparse_loop(model, emb, head, data, no_sync=False):
    sparse_opt = bound(model, torch.optim.SparseAdam(list(emb.parameters()), lr=0.05))
    dense_opt = bound(model, torch.optim.SGD(list(head.parameters()), lr=0.1, momentum=0.9))
    grads, losses = [], []
    for idx, y in data:
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        parts = torch.tensor_split(torch.arange(len(y)), 2) if no_sync else [torch.arange(len(y))]
        for i, part in enumerate(parts):
            quiet = no_sync and i < len(parts) - 1 and isinstance(model, cgdp.DataParallel)
            with model.no_sync() if quiet else contextlib.nullcontext():
                loss = F.cross_entropy(model(idx[part]), y[part], reduction="sum") / len(y)
                loss.backward()
            losses.append(loss.item())
        grads.append(emb.weight.grad.coalesce())
        if isinstance(model, cgdp.DataParallel):
            assert emb.weight.grad.is_sparse
            assert_grads_identical(model)
        sparse_opt.step()
        dense_opt.step()
        if isinstance(model, cgdp.DataParallel):
            assert_replicas_identical(model)
    return grads, losses


@pytest.mark.parametrize("g,no_sync", [(2, False), (3, False), (3, True)])
def test_sparse_embedding_gets_a_sparse_gradient_and_sparse_adam_steps(g, no_sync):
    net = SparseBag()
    ref = copy.deepcopy(net)
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 30, (11, 4), generator=gen), torch.randint(0, 3, (11,), generator=gen))
            for _ in range(3)]
    ref_grads, ref_losses = sparse_loop(ref, ref.emb, ref.head, data, no_sync)
    with cgdp.DataParallel(net, devs(g), chunks=1) as model:
        grads, losses = sparse_loop(model, net.emb, net.head, data, no_sync)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a.indices(), b.indices())
        torch.testing.assert_close(a.values(), b.values(), rtol=1e-5, atol=1e-7)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(net, ref)


def test_clip_grad_norm_counts_sparse_gradients_coalesced():
    """torch.nn.utils.clip_grad_norm_ cannot take a sparse gradient on one device; the wrapper's
    norm is that of the whole gradient, duplicate rows summed, and it clips every replica alike."""
    net = SparseBag()
    ref = copy.deepcopy(net)
    idx, y = torch.randint(0, 30, (9, 4)), torch.randint(0, 3, (9,))
    F.cross_entropy(ref(idx), y).backward()
    dense = [p.grad for p in ref.head.parameters()] + [ref.emb.weight.grad.coalesce().values()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in dense]))
    with cgdp.DataParallel(net, devs(3)) as model:
        F.cross_entropy(model(idx), y).backward()
        norm = model.clip_grad_norm_(0.01)
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
        coef = 0.01 / (expected + 1e-6)
        torch.testing.assert_close(net.emb.weight.grad.coalesce().values(),
                                   ref.emb.weight.grad.coalesce().values() * coef, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(net.head.weight.grad, ref.head.weight.grad * coef, rtol=1e-5, atol=1e-9)
        assert_grads_identical(model)


# ---------------------------------------------------------------- constant buffers
class RotaryLike(nn.Module):
    """A constant floating buffer that forward only reads (a rotary frequency table), beside
    BatchNorm statistics that every training forward writes."""
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(16) + 0.5, persistent=False)
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        return self.bn(self.lin(x) * torch.cos(self.inv_freq))


def test_constant_buffers_stay_bitwise_and_written_ones_are_averaged():
    """7 samples on 3 devices: weights 3/7, 2/7, 2/7, whose weighted mean of equal values moves
    about a third of float32 values by a unit in the last place."""
    net = RotaryLike()
    table = net.inv_freq.clone()
    with cgdp.DataParallel(net, devs(3)) as model:
        for _ in range(3):
            model(torch.randn(7, 16)).sum().backward()
        assert torch.equal(net.inv_freq, table)
        assert not torch.equal(net.bn.running_mean, torch.zeros(16))  # the statistics did move
        assert_replicas_identical(model)


# ---------------------------------------------------------------- pickling the wrapped model
def test_torch_save_of_the_wrapped_module_while_wrapped():
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    with cgdp.DataParallel(net, devs(2)) as model:
        model(torch.randn(6, 4)).sum().backward()
        buf = io.BytesIO()
        torch.save(model.module, buf)
        assert b"cgdp" not in buf.getvalue()  # nothing of cgdp goes into the user's file
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        assert not loaded._load_state_dict_post_hooks
        for (k, v), w in zip(net.state_dict().items(), loaded.state_dict().values()):
            assert torch.equal(v, w), k
        copy.deepcopy(model.module).load_state_dict(net.state_dict())  # a copy is the user's own
        pickle.dumps(net)
        # the wrapped model still follows a load into it
        with torch.no_grad():
            loaded[0].weight.add_(1.0)
        net.load_state_dict(loaded.state_dict())
        assert_replicas_identical(model)
        assert torch.equal(model.replicas[1][0].weight, loaded[0].weight)


# ---------------------------------------------------------------- gradient layout
def test_channels_last_parameter_keeps_a_channels_last_grad():
    """Autograd's layout contract: a dense parameter's .grad has the parameter's strides."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    net[2].to(memory_format=torch.contiguous_format)
    ref = copy.deepcopy(net)
    data = [(torch.randn(6, 3, 8, 8), torch.randn(6, 4, 4, 4)) for _ in range(2)]
    with cgdp.DataParallel(net, devs(3)) as model:
        opt, ref_opt = model.bind(torch.optim.SGD(model.parameters(), lr=0.1)), torch.optim.SGD(ref.parameters(), lr=0.1)
        for x, y in data:
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                F.mse_loss(m(x), y).backward()
            for r in model.replicas:
                assert r[0].weight.grad.is_contiguous(memory_format=torch.channels_last)
                assert not r[0].weight.grad.is_contiguous()
                assert r[2].weight.grad.is_contiguous()
            for p, q in zip(net.parameters(), ref.parameters()):
                assert p.grad.stride() == q.grad.stride()
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
            assert_grads_identical(model)
            opt.step()
            ref_opt.step()
    assert_params_close(net, ref)


# ---------------------------------------------------------------- frozen models
@pytest.mark.parametrize("when", ["after wrapping", "before wrapping"])
def test_frozen_model_backward_for_an_input_gradient(when):
    """Saliency maps, adversarial examples: the model does not train, the input's gradient is wanted."""
    net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    ref = copy.deepcopy(net).requires_grad_(False)
    if when == "before wrapping":
        net.requires_grad_(False)
    x = torch.randn(7, 5)
    with cgdp.DataParallel(net, devs(3)) as model:
        if when == "after wrapping":
            model.module.requires_grad_(False)
        for _ in range(2):
            xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
            model(xg).max(1).values.sum().backward()
            ref(xr).max(1).values.sum().backward()
            torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-7)
            assert all(p.grad is None for r in model.replicas for p in r.parameters())
            gx, = torch.autograd.grad(model(xg).max(1).values.sum(), xg)  # the same, through autograd.grad
            torch.testing.assert_close(gx, xr.grad, rtol=1e-5, atol=1e-7)


def test_input_gradient_of_a_trainable_model_leaves_the_parameters_alone():
    """``loss.backward(inputs=[x])`` on a trainable model: x gets its gradient, .grad stays None."""
    net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    ref = copy.deepcopy(net)
    x = torch.randn(7, 5)
    with cgdp.DataParallel(net, devs(2)) as model:
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        model(xg).pow(2).sum().backward(inputs=[xg])
        ref(xr).pow(2).sum().backward(inputs=[xr])
        torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-7)
        assert all(p.grad is None for r in model.replicas for p in r.parameters())
        # and training goes on as usual afterwards
        model(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- global normalisers
class CountNormalised(nn.Module):
    """Returns its loss as a share of a global sum, as Hugging Face models do when the Trainer
    passes ``num_items_in_batch`` (the token count of the whole accumulated batch)."""
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.out = nn.Linear(8, 20)

    def forward(self, ids, labels=None, num_items_in_batch=None):
        logits = self.out(torch.tanh(self.emb(ids) + self.emb(ids).mean(1, keepdim=True)))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        if num_items_in_batch is None:
            return loss / (labels != -100).sum()
        return loss / num_items_in_batch


def token_data(lengths, t=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (len(lengths), t), generator=g)
    labels = torch.where(torch.arange(t) < torch.tensor(lengths)[:, None], ids.roll(1, 1), -100)
    return ids, labels


@pytest.mark.parametrize("as_tensor", [True, False])
@pytest.mark.parametrize("g", [2, 3])
def test_loss_normalised_by_num_items_in_batch_comes_out_as_one_devices(g, as_tensor):
    net = CountNormalised()
    ref = copy.deepcopy(net)
    ids, labels = token_data([6, 1, 5, 2, 6, 3, 1])  # uneven token counts per part
    n = (labels != -100).sum()
    n = n if as_tensor else int(n)
    with cgdp.DataParallel(net, devs(g)) as model:
        loss = model(ids, labels, num_items_in_batch=n)
        ref_loss = ref(ids, labels, num_items_in_batch=n)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        loss.backward()
        ref_loss.backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        # without it the scalar is a per-sample mean of each part: weighted by the parts' sizes
        assert model(ids[:4], labels[:4]).item() == pytest.approx(
            sum(len(p) / 4 * ref(p, q).item() for p, q in zip(torch.tensor_split(ids[:4], g),
                                                              torch.tensor_split(labels[:4], g))), rel=1e-6)


class IgnoresCount(nn.Module):
    """Accepts num_items_in_batch and ignores it, as Hugging Face's sequence classifiers do (their
    forward takes **kwargs): its loss is a per-sample mean whatever the count."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x, y, **kwargs):
        return F.mse_loss(self.lin(x), y)


@pytest.mark.parametrize("count", [torch.tensor(9), 9])
def test_a_count_the_model_ignores_leaves_the_per_sample_mean(count):
    net = IgnoresCount()
    ref = copy.deepcopy(net)
    x, y = torch.randn(7, 5), torch.randn(7, 3)
    with cgdp.DataParallel(net, devs(3)) as model:
        loss = model(x, y, num_items_in_batch=count)
        ref_loss = ref(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        loss.backward()
        ref_loss.backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rule", ["sum", "mean"])
def test_scalar_outputs_rule_can_be_named(rule):
    class Halves(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.w * x.sum()

    x = torch.arange(6.0)
    with cgdp.DataParallel(Halves(), devs(3), scalar_outputs=rule) as model:
        out = model(x)
        assert out.item() == pytest.approx(15.0 if rule == "sum" else 15.0 / 3)
    with pytest.raises(ValueError, match="scalar_outputs"):
        cgdp.DataParallel(Halves(), devs(2), scalar_outputs="avg")


# ---------------------------------------------------------------- token means over micro-batches
def accumulate_token_mean(model, data, micro, how):
    """One optimizer step per batch, over ``micro`` micro-batches (all but the last inside
    ``no_sync``). ``how``: each micro-batch's loss is its token sum divided by the token count of
    the whole batch, counted before the first micro-batch (so the gradient is that of
    Σ sum_i / Σ n_i): computed by the model from ``num_items_in_batch``, or on the gathered
    logits; or ``"naive"``: the mean of the micro-batches' token means (Σ (sum_i / n_i) / k)."""
    dp = isinstance(model, cgdp.DataParallel)
    opt = bound(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    losses = []
    for ids, labels in data:
        opt.zero_grad()
        n = (labels != -100).sum()  # the whole batch's tokens, as Hugging Face's num_items_in_batch
        total = 0.0
        parts = list(zip(torch.tensor_split(ids, micro), torch.tensor_split(labels, micro)))
        for i, (x, y) in enumerate(parts):
            with model.no_sync() if dp and i < micro - 1 else contextlib.nullcontext():
                if how == "num_items_in_batch":
                    loss = model(x, y, num_items_in_batch=n)
                elif how == "gathered":
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum") / n
                else:
                    loss = model(x, y) / micro
                loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
        if dp:
            assert_replicas_identical(model)
    return losses


def uneven_token_batches(steps=3, n=11, t=6, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [token_data(torch.randint(0, t + 1, (n,), generator=g).tolist(), t, seed + s) for s in range(steps)]


@pytest.mark.parametrize("how", ["num_items_in_batch", "gathered"])
@pytest.mark.parametrize("g", [1, 2, 3, 4])
def test_no_sync_accumulation_gives_the_exact_token_mean(g, how):
    """3 micro-batches of 4, 4 and 3 sequences (the last leaves a device idle on 4 devices), 0 to
    6 tokens each: equal to one step on the whole batch with its token mean, on one device."""
    net = CountNormalised()
    ref, naive = copy.deepcopy(net), copy.deepcopy(net)
    data = uneven_token_batches()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    ref_losses = []
    for ids, labels in data:
        ref_opt.zero_grad()
        loss = ref(ids, labels)  # the token mean of the whole batch
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    with cgdp.DataParallel(net, devs(g)) as model:
        losses = accumulate_token_mean(model, data, 3, how)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(net, ref)
    if g == 2 and how == "gathered":  # why the count must be the whole batch's
        with cgdp.DataParallel(naive, devs(g)) as model:
            accumulate_token_mean(model, data, 3, "naive")
        with pytest.raises(AssertionError):
            assert_params_close(naive, ref)
