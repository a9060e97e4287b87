"""cgdp.DataParallel: the user's own loop on CPU-emulated devices against the same loop on one device."""
import contextlib
import copy
from collections import OrderedDict, UserDict, defaultdict
import re
import pathlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.testing import inside
from helpers import Gated, Tied, WithBN, assert_params_close, assert_replicas_identical, bound, mlp

@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3)  # noqa: E731


def devs(g):
    return [f"cpu:{i}" for i in range(g)]


def batches(n_steps, n, shape=(12,), classes=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(n_steps)]


def assert_grads_identical(model):
    first = [p.grad for p in model.module.parameters()]
    for r in model.replicas[1:]:
        for g0, p in zip(first, r.parameters()):
            assert (g0 is None) == (p.grad is None)
            assert g0 is None or torch.equal(g0, p.grad)


def loop(model, data, make_opt, loss_fn=F.cross_entropy, *, sched=None, clip=None, micro=1,
         use_no_sync=False, zero=True, grads=None):
    """The issue's loop, written once for ``nn.Module`` and ``cgdp.DataParallel`` alike. With
    ``micro`` > 1 each batch is accumulated over micro-batches (inside ``no_sync`` but the last,
    if asked); ``grads`` collects the gradients after each step's backward."""
    opt = bound(model, make_opt(model.parameters()))
    scheduler = sched(opt) if sched else None
    losses, norms = [], []
    dp = isinstance(model, cgdp.DataParallel)
    for x, y in data:
        if zero:
            opt.zero_grad()
        n = x.shape[0]
        parts = list(zip(torch.tensor_split(x, micro), torch.tensor_split(y, micro)))
        for i, (xm, ym) in enumerate(parts):
            quiet = use_no_sync and dp and i < micro - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                loss = loss_fn(model(xm), ym) * (xm.shape[0] / n)
                loss.backward()
            losses.append(loss.item())
        if grads is not None:
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        if dp:
            assert_grads_identical(model)
        if clip:
            norm = model.clip_grad_norm_(clip) if dp else torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm))
        opt.step()
        if scheduler:
            scheduler.step()
        if dp:
            assert_replicas_identical(model)
    return losses, norms


def compare(net, g, data, make_opt, loss_fn=F.cross_entropy, ref_net=None, chunks=1, names=None, **kw):
    ref = copy.deepcopy(net) if ref_net is None else ref_net
    ref_grads, got_grads = [], []
    ref_losses, ref_norms = loop(ref, data, make_opt, loss_fn, grads=ref_grads, **kw)
    with cgdp.DataParallel(net, names or devs(g), chunks=chunks) as model:
        losses, norms = loop(model, data, make_opt, loss_fn, grads=got_grads, **kw)
    for a, b in zip(got_grads, ref_grads):
        for ga, gb in zip(a, b):
            assert (ga is None) == (gb is None)
            if ga is not None:
                torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert_params_close(net, ref)
    return model


@pytest.mark.parametrize("g", [1, 2, 3, 4])
def test_sgd_momentum_equals_single_device(g):
    compare(mlp(), g, batches(4, 10), SGD)  # 10 samples: uneven on 3 and 4 devices


def test_adamw_scheduler_and_param_groups():
    def make_opt(params):
        params = list(params)
        return torch.optim.AdamW([{"params": params[:2], "lr": 3e-3, "weight_decay": 0.0},
                                  {"params": params[2:]}], lr=1e-2, weight_decay=0.05)
    sched = lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)  # noqa: E731
    compare(mlp(), 3, batches(4, 11), make_opt, sched=sched, chunks=2)


@pytest.mark.parametrize("norm", [0.5, 100.0])
def test_clip_grad_norm_on_every_replica(norm):
    """0.5 clips every step, 100 never: the norm is the summed gradient's, from the host."""
    compare(mlp(), 3, batches(4, 10), SGD, clip=norm)


def test_torch_clip_on_replica_0_is_mirrored():
    """``torch.nn.utils.clip_grad_norm_(model.parameters())`` changes replica 0 only: the replicas
    get the same gradients before the step (with a warning), never silently different ones."""
    net, data = mlp(), batches(3, 10)
    ref = copy.deepcopy(net)
    loop(ref, data, SGD, clip=0.3)
    with cgdp.DataParallel(net, devs(2), chunks=1) as model:
        opt = model.bind(SGD(model.parameters()))
        with pytest.warns(UserWarning, match="model.clip_grad_norm_"):
            for x, y in data:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
                opt.step()
                assert_replicas_identical(model)
    assert_params_close(net, ref)


@pytest.mark.parametrize("g", [2, 3])
def test_gradients_edited_through_data_are_found_and_mirrored(g):
    """``p.grad.data.clamp_(-1, 1)`` (PyTorch's DQN tutorial) moves no version counter: the edit
    is found by comparing replica 0's gradients with another replica's before the step, and copied
    to every replica, with a warning that says what to do instead."""
    net, data = mlp(), batches(4, 10)
    ref = copy.deepcopy(net)
    make_opt = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    with cgdp.DataParallel(net, devs(g), chunks=1) as model:
        for m in (model, ref):
            opt = bound(m, make_opt(m.parameters()))
            with pytest.warns(UserWarning, match="through .data") if m is model else contextlib.nullcontext():
                for x, y in data:
                    opt.zero_grad()
                    F.cross_entropy(m(x) * 20, y.to(x.device)).backward()
                    for p in m.parameters():
                        p.grad.data.clamp_(-0.01, 0.01)
                    opt.step()
        assert_replicas_identical(model)
    assert_params_close(net, ref)


@pytest.mark.parametrize("use_no_sync", [True, False])
@pytest.mark.parametrize("zero", [True, False])
def test_gradient_accumulation(use_no_sync, zero):
    """Three micro-batches per step, in ``no_sync`` but the last, or all synced (each backward
    keeps what the last one summed); with or without ``zero_grad`` between steps."""
    compare(mlp(), 3, batches(3, 14), SGD, micro=3, use_no_sync=use_no_sync, zero=zero)


def test_tied_weights():
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 11, (7,), generator=g), torch.randint(0, 11, (7,), generator=g))
            for _ in range(3)]
    model = compare(Tied(), 2, data, SGD)
    assert model.replicas[1].out.weight is model.replicas[1].emb.weight


def test_unused_and_frozen_parameters():
    """``extra`` is used by one sample only (on device 0), ``never`` by nobody, ``frozen`` does not
    train: their ``.grad`` are what single-device training has (tensors, None, None)."""
    data = []
    for s in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(s))
        x[1, 0] = 250.0
        data.append((x, torch.randn(8, 4, generator=torch.Generator().manual_seed(10 + s))))
    data.append((torch.randn(8, 6), torch.randn(8, 4)))  # nobody uses ``extra``
    net = Gated()
    compare(net, 2, data, SGD, loss_fn=F.mse_loss)
    assert net.never.weight.grad is None and net.frozen.weight.grad is None
    assert net.extra.weight.grad is None  # step 4 used it nowhere (steps 1-3: compared in compare)


class Parts(nn.Module):
    """Forward on each ``tensor_split`` part (what data parallelism computes for BatchNorm)."""
    def __init__(self, net, g):
        super().__init__()
        self.net, self.g = net, g

    def forward(self, x):
        return torch.cat([self.net(p) for p in torch.tensor_split(x, self.g)])


def test_batchnorm():
    net = WithBN()
    data = batches(4, 10, shape=(6,), classes=3)
    ref = Parts(copy.deepcopy(net), 3)
    compare(net, 3, data, SGD, ref_net=ref)
    # the running mean is the batch-weighted mean of the replicas' (= the global batch's update)
    fresh = WithBN()
    h = fresh.fc1(data[0][0]).detach()
    with cgdp.DataParallel(fresh, devs(3)) as model:
        model(data[0][0])
        torch.testing.assert_close(fresh.bn.running_mean, 0.1 * h.mean(0), rtol=1e-5, atol=1e-7)
        assert_replicas_identical(model)


def test_eval_and_no_grad_inference():
    net = WithBN()
    ref = copy.deepcopy(net).eval()
    x = torch.randn(9, 6)
    with cgdp.DataParallel(net, devs(3)) as model:
        model.eval()
        assert all(not r.training for r in model.replicas)
        with torch.no_grad():
            out = model(x)
        assert not out.requires_grad
        torch.testing.assert_close(out, ref(x).detach(), rtol=1e-5, atol=1e-6)
        assert all(p.grad is None for r in model.replicas for p in r.parameters())
        model.train()
        assert all(r.training for r in model.replicas)


class Structured(nn.Module):
    """Returns a dict with a tuple, an integer tensor, a constant and its own mean loss."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x, *, target=None, extra=None):
        out = self.fc(x)
        loss = F.cross_entropy(out, target)
        return {"loss": loss, "pair": (out, out.argmax(1)), "scale": 2, "extra": extra["w"] * 1.0}


def test_structured_outputs_and_model_computed_loss():
    """Keyword and nested arguments are split; outputs gathered; a model's own mean loss is
    combined as the per-sample mean, so backward on it equals single-device training."""
    net = Structured()
    ref = copy.deepcopy(net)
    x, y, w = torch.randn(7, 5), torch.randint(0, 3, (7,)), torch.randn(7, 2)
    with cgdp.DataParallel(net, devs(3), chunks=1) as model:
        out = model(x, target=y, extra={"w": w})
        want = ref(x, target=y, extra={"w": w})
        torch.testing.assert_close(out["loss"], want["loss"], rtol=1e-6, atol=0)
        torch.testing.assert_close(out["pair"][0], want["pair"][0])
        assert torch.equal(out["pair"][1], want["pair"][1]) and out["scale"] == 2
        torch.testing.assert_close(out["extra"], w)
        out["loss"].backward()
        want["loss"].backward()
        assert_grads_identical(model)
        torch.testing.assert_close(net.fc.weight.grad, ref.fc.weight.grad, rtol=1e-5, atol=1e-7)


class Keyed(nn.Module):
    """Takes a dict of batches, notes what each replica got, and returns one per key in sorted order: a defaultdict
    (its factory a lambda each replica makes) for a defaultdict, else the argument's own type."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.seen = []

    def forward(self, batch):
        self.seen.append((type(batch), getattr(batch, "default_factory", None), list(batch),
                          [(v.device, v.shape[0]) for v in batch.values()], self.fc.weight.device))
        out = defaultdict(lambda: -1) if isinstance(batch, defaultdict) else type(batch)()
        for k in sorted(batch):
            out[k] = self.fc(batch[k])
        return out


def _zero():
    return 0


@pytest.mark.parametrize("kind", [defaultdict, OrderedDict])
def test_dict_subclasses_are_split_and_gathered_as_themselves(kind):
    """A defaultdict argument reaches every replica as one with the same factory, an OrderedDict in its order, each
    value that replica's part on its device; the same types come back gathered (keys in the replicas' order, a
    defaultdict's factory replica 0's), and backward equals one device's. Was a bare TypeError for a defaultdict."""
    from cgdp.testing import simulated_cuda
    items = {"b": torch.randn(7, 5), "a": torch.randn(7, 5)}
    batch = defaultdict(_zero, items) if kind is defaultdict else OrderedDict(items)
    net = Keyed()
    ref = copy.deepcopy(net)
    with simulated_cuda(3), cgdp.DataParallel(net, [f"cuda:{i}" for i in range(3)], chunks=1) as model:
        out = model(batch)
        want = ref(batch)
        for (got, factory, keys, parts, dev), n in zip([r.seen[0] for r in model.replicas], [3, 2, 2]):
            assert got is kind and factory is getattr(batch, "default_factory", None) and keys == ["b", "a"]
            assert parts == [(dev, n), (dev, n)]
        assert type(out) is type(want) and list(out) == ["a", "b"]
        assert kind is not defaultdict or out["missing"] == -1
        for k in want:
            assert out[k].device == model.output_device
            torch.testing.assert_close(out[k], want[k], rtol=1e-6, atol=0)
        (out["a"] * out["b"]).mean().backward()
        (want["a"] * want["b"]).mean().backward()
        assert_grads_identical(model)
        torch.testing.assert_close(net.fc.weight.grad, ref.fc.weight.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(net.fc.bias.grad, ref.fc.bias.grad, rtol=1e-5, atol=1e-7)


class Pair(dict):
    """A dict whose constructor takes its values, not its items."""
    def __init__(self, x, y):
        super().__init__(x=x, y=y)


class Settings(dict):
    """A dict whose constructor takes a path and drops what it is given."""
    def __init__(self, path=None):
        super().__init__()


class Paired(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x, y=None):
        return Pair(self.fc(x), self.fc(x)) if y is None else self.fc(x["x"])


@pytest.mark.parametrize("cls, made", [(Pair, lambda t: Pair(t, t)), (Settings, None)])
def test_a_dict_that_cannot_be_made_again_from_its_items_is_said(cls, made):
    """As an argument (split) and as an output (gathered): a sentence that names the class and what to do, never
    the constructor's bare TypeError (or a dict that silently lost its items); the model stays usable."""
    said = rf"test_dataparallel\.{cls.__name__}\(items\) does not: pass or return a plain dict \(dict\(x\)\)"
    with cgdp.DataParallel(Paired(), devs(2), chunks=1) as model:
        x = torch.randn(4, 5)
        arg = made(x) if made else Settings()
        if not made:
            arg.update(x=x)
        with pytest.raises(TypeError, match=said):
            model(arg, y=True)
        if made:
            with pytest.raises(TypeError, match=said):
                model(x)
        assert model(dict(arg), y=True).shape == (4, 3)


def test_a_mapping_that_is_not_a_dict_goes_whole_as_in_nn_data_parallel():
    """Not walked (as nn.DataParallel's scatter, documented in docs/migration.md): alone it runs whole on replica 0."""
    net = Keyed()
    with cgdp.DataParallel(net, devs(2), chunks=1) as model:
        out = model(UserDict(a=torch.randn(6, 5)))
        assert net.seen[0][0] is UserDict and net.seen[0][3][0][1] == 6 and model.replicas[1].seen == []
        assert type(out) is UserDict and out["a"].shape == (6, 3)


def test_auto_chunks_tune_while_training_and_change_nothing():
    """chunks="auto" times uniform plans over the first iterations of the loop and switches plans
    between steps (buffers relaid, gradients kept): results equal one device all along."""
    net = mlp(widths=(12, 16, 16, 16, 16, 5))
    ref = copy.deepcopy(net)
    data = batches(20, 10)
    loop(ref, data, SGD)
    with cgdp.DataParallel(net, devs(2)) as model:
        plans = []
        opt = model.bind(SGD(model.parameters()))
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            assert_replicas_identical(model)
            plans.append(model.plan)
        assert len({str(p) for p in plans}) >= 3 and not model.tuning  # tried several, chose
    assert_params_close(net, ref)


def test_bf16_parameters():
    """16-bit parameters: the host sums in float32 and rounds once (the Trainer's precision
    rules); the replicas stay bitwise identical and training follows float32 training closely."""
    net, data = mlp(), batches(3, 10)
    ref = copy.deepcopy(net)
    loop(ref, data, SGD, clip=1.0)
    low = copy.deepcopy(net).to(torch.bfloat16)
    bf16 = [(x.to(torch.bfloat16), y) for x, y in data]
    with cgdp.DataParallel(low, devs(3), chunks=1) as model:
        loop(model, bf16, SGD, clip=1.0)  # checks the replicas after every step
    assert_params_close(low.float(), ref, rtol=3e-2)


@pytest.mark.parametrize("g", [2, 3])
def test_cuda_backend_on_the_simulated_runtime(g):
    """The CUDA backend's own code (events, stream waits, autograd's final callback on whichever
    thread ends backward) against the simulated asynchronous runtime: no_sync accumulation,
    clipping and BatchNorm equal one device."""
    from cgdp.testing import simulated_cuda
    net = WithBN()
    with simulated_cuda(g, seed=g):
        compare(net, g, batches(3, 14, shape=(6,), classes=3), SGD, ref_net=Parts(copy.deepcopy(net), g),
                names=[f"cuda:{i}" for i in range(g)], micro=2, use_no_sync=True, clip=0.5)


def test_batch_smaller_than_devices():
    compare(mlp(), 4, batches(2, 3), SGD)  # 3 samples on 4 devices: the last one idles


def test_optimizer_state_dict_roundtrip():
    """opt.load_state_dict reloads every replica's optimizer: training goes on identically."""
    net, data = mlp(), batches(4, 10)
    ref = copy.deepcopy(net)
    loop(ref, data, lambda p: torch.optim.AdamW(p, lr=1e-2))
    with cgdp.DataParallel(net, devs(2), chunks=1) as model:
        opt = model.bind(torch.optim.AdamW(model.parameters(), lr=1e-2))
        for i, (x, y) in enumerate(data):
            if i == 2:  # a new optimizer from a checkpoint of the old one
                state = copy.deepcopy(opt.state_dict())
                opt = model.bind(torch.optim.AdamW(model.parameters(), lr=0.5))
                opt.load_state_dict(state)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            assert_replicas_identical(model)
    assert_params_close(net, ref)


def test_add_param_group():
    def run(model):
        params = list(model.parameters())
        opt = bound(model, torch.optim.SGD(params[:4], lr=0.05, momentum=0.9))
        for i, (x, y) in enumerate(batches(3, 10)):
            if i == 1:
                opt.add_param_group({"params": params[4:], "lr": 0.01})
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if isinstance(model, cgdp.DataParallel):
                assert_replicas_identical(model)
    net = mlp()
    ref = copy.deepcopy(net)
    run(ref)
    with cgdp.DataParallel(net, devs(2), chunks=1) as model:
        run(model)
    assert_params_close(net, ref)


def test_gpt2_with_padding_through_gathered_logits():
    """A tiny GPT-2 (config in code, no download), right-padded batches with ``labels`` -100 on
    padding. The exact route: the token-mean loss on the gathered logits. The model's own
    ``out.loss`` is each replica's token mean combined per sample (documented, not exact)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(5)
    data = []
    for _ in range(3):
        ids = torch.randint(0, 40, (5, 10), generator=g)
        mask = torch.ones_like(ids)
        for i, n in enumerate([10, 4, 7, 10, 2]):
            mask[i, n:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        data.append(({"input_ids": ids, "attention_mask": mask}, labels))

    def lm_loss(out, labels):
        logits = out.logits[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    def run(model):
        # SGD: Adam would turn the rounding noise of exactly-zero gradients (the key bias of
        # attention) into full-size steps, on one device as on several
        opt = bound(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
        for batch, labels in data:
            opt.zero_grad()
            out = model(**batch, labels=labels)
            loss = lm_loss(out, labels)
            loss.backward()
            if isinstance(model, cgdp.DataParallel):
                model.clip_grad_norm_(1.0)
                parts = torch.tensor_split(labels, len(model.replicas))
                per_part = [model.module(input_ids=i, attention_mask=m, labels=p).loss.item()
                            for i, m, p in zip(torch.tensor_split(batch["input_ids"], 2),
                                               torch.tensor_split(batch["attention_mask"], 2), parts)]
                want = sum(l * p.shape[0] / labels.shape[0] for l, p in zip(per_part, parts))
                assert out.loss.item() == pytest.approx(want, rel=1e-5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if isinstance(model, cgdp.DataParallel):
                assert_replicas_identical(model)

    ref = copy.deepcopy(net)
    run(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in the output is dropped with use_cache=False
        with cgdp.DataParallel(net, devs(2), chunks=2) as model:
            run(model)
    assert_params_close(net, ref)


def test_wrapper_state_dict_and_load_reach_every_replica():
    net = mlp()
    with cgdp.DataParallel(net, devs(2)) as model:
        other = mlp(seed=7)
        model.load_state_dict({f"module.{k}": v for k, v in other.state_dict().items()})
        assert_replicas_identical(model)
        assert_params_close(model.replicas[1], other, rtol=0)


def test_caller_autocast_and_direct_load_reach_replicas():
    net = mlp()
    with cgdp.DataParallel(net, devs(2)) as model:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(torch.randn(4, 12)).dtype == torch.bfloat16
        other = mlp(seed=9)
        model.module.load_state_dict(other.state_dict())
        assert_params_close(model.replicas[1], other, rtol=0)


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return _Boom.apply(self.fc(x))


class _Boom(torch.autograd.Function):
    fail = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _Boom.fail:
            raise RuntimeError("boom")
        return g


def test_failed_backward_leaves_a_usable_model():
    net = Fails()
    ref = copy.deepcopy(net)
    x = torch.randn(6, 4)
    with cgdp.DataParallel(net, devs(2), timeout_s=10) as model:
        with pytest.raises(RuntimeError, match="boom"):
            model(x).sum().backward()
        _Boom.fail = False
        try:
            out = model(x)  # it failed before any gradient: nothing to drop, as on one device
            out.sum().backward()
            ref(x).sum().backward()
        finally:
            _Boom.fail = True
        assert_grads_identical(model)
    torch.testing.assert_close(net.fc.weight.grad, ref.fc.weight.grad)


def test_ranks_average_like_ddp():
    """Two in-process MPI ranks of two emulated devices each, every rank its own half of the
    global batch (7 samples: uneven on its devices), each with a BatchNorm model and its loop:
    the gradient is the mean over ranks (as DDP's), so training equals one device on the global
    batch with the loss averaged over the ranks' halves."""
    from concurrent.futures import ThreadPoolExecutor
    from cgdp.comm.inproc import InProcGroup
    net, data = WithBN(), batches(3, 14, shape=(6,), classes=3)
    ref = copy.deepcopy(net)
    ref_opt = SGD(ref.parameters())
    for x, y in data:
        ref_opt.zero_grad()
        halves = zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2))
        loss = sum(F.cross_entropy(torch.cat([ref(p) for p in torch.tensor_split(xh, 2)]), yh)
                   for xh, yh in halves) / 2
        loss.backward()
        ref_opt.step()

    def rank(comm):
        mine = [(torch.tensor_split(x, 2)[comm.rank], torch.tensor_split(y, 2)[comm.rank]) for x, y in data]
        model = cgdp.DataParallel(copy.deepcopy(net), devs(2), chunks=1, comm=comm, timeout_s=20)
        with model:
            loop(model, mine, SGD, clip=100.0)
            return copy.deepcopy(model.module)

    group = InProcGroup(2, timeout_s=20)
    with ThreadPoolExecutor(2) as pool:
        got = [f.result(timeout=120) for f in [pool.submit(rank, c) for c in group.comms()]]
    for g in got:
        assert_params_close(g, ref)
    assert all(torch.equal(a, b) for a, b in zip(got[0].state_dict().values(), got[1].state_dict().values()))


def test_retained_graph_backward_twice_accumulates():
    net = mlp()
    ref = copy.deepcopy(net)
    x, y = torch.randn(9, 12), torch.randint(0, 5, (9,))
    with cgdp.DataParallel(net, devs(3), chunks=1) as model:
        loss = F.cross_entropy(model(x), y)
        loss.backward(retain_graph=True)
        (2 * loss).backward()
        assert_grads_identical(model)
    loss = F.cross_entropy(ref(x), y)
    loss.backward(retain_graph=True)
    (2 * loss).backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="comm must be"):
        cgdp.DataParallel(mlp(), devs(2), comm="nccl")
    with cgdp.DataParallel(mlp(), devs(2)) as model:
        with pytest.raises(ValueError, match="first dimension"):
            model(torch.randn(4, 12), torch.randn(3, 12))
        with pytest.raises(RuntimeError, match="autograd.grad"):
            torch.autograd.grad(model(torch.randn(4, 12)).sum(), list(model.parameters()))
        opt = model.bind(torch.optim.LBFGS(model.parameters()))
        F.cross_entropy(model(torch.randn(4, 12)), torch.tensor([0, 1, 2, 3])).backward()
        with pytest.raises(NotImplementedError, match="closure"):
            opt.step(lambda: 0.0)
        with pytest.raises(ValueError, match="separate optimizer"):
            model.bind(torch.optim.SGD(list(model.replicas[1].parameters()), lr=0.1))
    with pytest.raises(RuntimeError, match="closed"):
        model(torch.randn(4, 12))


def test_default_devices_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("defaults to the GPUs here")
    with cgdp.DataParallel(mlp()) as model:
        assert model.devices == ["cpu:0", "cpu:1"] and len(model.replicas) == 2


def test_readme_example_runs():
    """README's DataParallel example runs as written (on CPU-emulated devices here)."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "cgdp.DataParallel" in b]
    assert blocks, "README has no cgdp.DataParallel example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_close_frees_the_other_replicas_held_by_the_users_optimizer():
    """The mirror optimizers hold replica j's parameters and optimizer state; after close() the
    user's optimizer (alive, bound until then) must not keep them, nor reload them."""
    import gc
    import weakref
    net = mlp()
    model = cgdp.DataParallel(net, devices=devs(2), chunks=1)
    opt = model.bind(torch.optim.Adam(model.parameters(), lr=1e-3))
    for x, y in batches(2, 8):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    other = [weakref.ref(p) for p in model.replicas[1].parameters()]
    model.close()
    del model
    gc.collect()
    assert all(r() is None for r in other)
    opt.load_state_dict(opt.state_dict())  # no mirror left to reload
    before = [p.detach().clone() for p in net.parameters()]
    F.cross_entropy(net(batches(1, 8)[0][0]), batches(1, 8)[0][1]).backward()
    opt.step()  # replica 0 alone, as any optimizer
    assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters()))


def test_modes_set_on_replica_0_alone_reach_every_replica():
    """net.eval() (or BatchNorm frozen on model.module) without model.eval(): every replica must
    run in replica 0's modes, or inference differs by row and running statistics change."""
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 2))
    with cgdp.DataParallel(net, devices=devs(2)) as model:
        x = torch.randn(6, 8)
        model(x)  # a training forward: the replicas' running statistics move
        net.eval()
        stats = net[1].running_mean.clone()
        with torch.no_grad():
            torch.testing.assert_close(model(x), net(x), rtol=1e-5, atol=1e-6)
        assert torch.equal(net[1].running_mean, stats)
        net.train()
        net[1].eval()  # frozen BatchNorm while the rest trains
        model(x).sum().backward()
        assert [m.training for m in model.replicas[1].modules()] == [m.training for m in net.modules()]
        assert torch.equal(net[1].running_mean, stats)
        assert torch.equal(model.replicas[1][1].running_mean, stats)


def test_freezing_after_wrapping_equals_one_device_and_unfreezing_is_an_error():
    """requires_grad set on model.module after wrapping: a freeze reaches every replica (before,
    the other replicas' gradients still updated the frozen layer); unfreezing a layer frozen at
    wrapping would leave the replicas drifting apart, so it is a clear error."""
    net = mlp()
    first = next(net.children())
    ref = copy.deepcopy(net)
    ref_first = next(ref.children())
    data = batches(4, 8)
    with cgdp.DataParallel(net, devices=devs(2), chunks=1) as model:
        ro, mo = SGD(ref.parameters()), model.bind(SGD(model.parameters()))
        for i, (x, y) in enumerate(data):
            if i == 2:
                for p in list(first.parameters()) + list(ref_first.parameters()):
                    p.requires_grad_(False)
            for o in (ro, mo):
                o.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            F.cross_entropy(model(x), y).backward()
            ro.step()
            mo.step()
            assert_replicas_identical(model)
        assert_params_close(net, ref)
    frozen = mlp()
    for p in next(frozen.children()).parameters():
        p.requires_grad_(False)
    with cgdp.DataParallel(frozen, devices=devs(2)) as model:
        for p in next(frozen.children()).parameters():
            p.requires_grad_(True)
        with pytest.raises(RuntimeError, match="frozen when cgdp.DataParallel was built"):
            model(data[0][0])


class _Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 5)
        self.temp = nn.Parameter(torch.tensor(1.5))  # used by the loss only, not in forward

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("how", ["zero_grad", "accumulate", "no_sync"])
def test_parameter_used_only_in_the_loss(how):
    """Autograd reaches such a parameter (its AccumulateGrad runs first) before the gather's
    backward arms the engine; its gradient was dropped (.grad None, never updated)."""
    net = _Temperature()
    ref = copy.deepcopy(net)
    data = batches(6, 10)
    with cgdp.DataParallel(net, devices=devs(3), chunks=1) as model:
        ro, mo = SGD(ref.parameters()), model.bind(SGD(model.parameters()))
        for i, (x, y) in enumerate(data):
            if how == "zero_grad" or i % 2 == 0:
                ro.zero_grad()
                mo.zero_grad()
            F.cross_entropy(ref(x) / ref.temp, y).backward()
            quiet = model.no_sync() if how == "no_sync" and i % 2 == 0 else contextlib.nullcontext()
            with quiet:
                F.cross_entropy(model(x) / net.temp, y).backward()
            if how == "zero_grad" or i % 2 == 1:
                torch.testing.assert_close(net.temp.grad, ref.temp.grad, rtol=1e-5, atol=1e-7)
                ro.step()
                mo.step()
                assert_replicas_identical(model)
        assert_params_close(net, ref)


def test_parameters_edited_outside_the_optimizer_reach_every_replica():
    """In-place edits of model.module's parameters (weight clipping under no_grad, an init) used
    to reach replica 0 only: the replicas drifted apart silently."""
    net = mlp()
    ref = copy.deepcopy(net)
    with cgdp.DataParallel(net, devices=devs(2), chunks=1) as model:
        ro, mo = SGD(ref.parameters()), model.bind(SGD(model.parameters()))
        for x, y in batches(3, 8):
            for o in (ro, mo):
                o.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                F.cross_entropy(model(x), y).backward()
            ro.step()
            mo.step()
            with torch.no_grad():
                for p in list(ref.parameters()) + list(net.parameters()):
                    p.clamp_(-0.05, 0.05)
        with pytest.warns(UserWarning, match="changed outside optimizer.step"):
            model(batches(1, 8)[0][0])
        assert_replicas_identical(model)
        assert_params_close(net, ref)


def test_dtype_or_device_conversion_of_the_wrapper_is_a_clear_error():
    with cgdp.DataParallel(mlp(), devs(2)) as model:
        for convert in (lambda m: m.to(torch.float64), lambda m: m.half(), lambda m: m.double(),
                        lambda m: m.to("meta")):
            with pytest.raises(RuntimeError, match="before wrapping"):
                convert(model)
        assert model.to("cpu") is model and model.float() is model  # what is in use: a no-op
        for r in model.replicas:
            assert all(p.dtype == torch.float32 for p in r.parameters())
        x, y = batches(1, 6)[0]
        F.cross_entropy(model(x), y).backward()
        assert_grads_identical(model)


def test_no_optimizer_hook_reaches_beyond_the_bound_optimizer():
    """Binding puts its step and hooks on the one optimizer bound; nothing process-wide, and
    close() takes them away."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
    before = (dict(_global_optimizer_pre_hooks), dict(_global_optimizer_post_hooks))
    with cgdp.DataParallel(mlp(), devs(2)) as model:
        opt = SGD(model.parameters())
        hooks = (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_load_state_dict_post_hooks))
        model.bind(opt)
        other = SGD(model.parameters())  # not bound: torch's own object, untouched
        assert "step" in vars(opt) and "step" not in vars(other) and not other._optimizer_step_pre_hooks
        assert (dict(_global_optimizer_pre_hooks), dict(_global_optimizer_post_hooks)) == before
    assert "step" not in vars(opt)
    assert (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_load_state_dict_post_hooks)) == hooks


def test_a_model_dropped_without_close_frees_its_threads():
    import gc
    import threading
    import weakref
    gc.collect()
    before = threading.active_count()
    refs = []
    for i in range(3):
        net = mlp()
        model = cgdp.DataParallel(net, devs(2), chunks=1)
        opt = model.bind(SGD(model.parameters()))  # its binding must not keep the model alive
        x, y = batches(1, 6)[0]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        refs.append(weakref.ref(model))
        del model
    gc.collect()
    assert [r() for r in refs] == [None] * 3
    assert threading.active_count() == before
    assert next(net.parameters()).grad is not None  # replica 0 keeps its gradients
    opt.step()  # the last model's optimizer steps replica 0 alone again


class PerSampleLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y, reduction="none")


def test_failed_second_backward_keeps_the_first_gradient_as_one_device():
    net = PerSampleLoss()
    ref = copy.deepcopy(net)
    data = batches(2, 9)
    with cgdp.DataParallel(net, devs(3), chunks=1) as model:
        for m in (model, ref):
            opt = bound(m, SGD(m.parameters()))
            for x, y in data:
                opt.zero_grad()
                loss = m(x, y).mean()
                loss.backward()
                with pytest.raises(RuntimeError, match="second time"):
                    loss.backward()  # no retain_graph: fails in the replicas' backward
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    opt.step()  # the first backward's gradient, as on one device
        assert_replicas_identical(model)
    assert_params_close(net, ref)


class FailsLate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.fc2(_Boom.apply(self.fc1(x)))


def test_backward_failing_partway_refuses_the_step_until_redone():
    net = FailsLate()
    ref = copy.deepcopy(net)
    x = torch.randn(6, 4)
    with cgdp.DataParallel(net, devs(2), chunks=1) as model:
        opt = model.bind(SGD(model.parameters()))
        with pytest.raises(RuntimeError, match="boom"):
            model(x).sum().backward()  # fc2's gradient arrived, fc1's never will
        with pytest.raises(RuntimeError, match="zero_grad.*redo"), pytest.warns(UserWarning, match="partway"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), ref.parameters()))
        _Boom.fail = False
        try:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            ref_opt = SGD(ref.parameters())
            ref(x).sum().backward()
            ref_opt.step()
        finally:
            _Boom.fail = True
        assert_replicas_identical(model)
    assert_params_close(net, ref)


def test_warnings_point_at_the_users_line():
    import inspect

    def where(call):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_back.f_lineno
            call()
        assert caught, "no warning"
        return [(pathlib.Path(w.filename).name, w.lineno - line) for w in caught]

    x, y = batches(1, 6)[0]
    with cgdp.DataParallel(mlp(), devs(2), chunks=1) as model:
        opt = model.bind(SGD(model.parameters()))
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        assert where(lambda: opt.step()) == [("test_dataparallel.py", 0)]  # the step that copies
        with torch.no_grad():
            next(model.parameters()).clamp_(-0.1, 0.1)
        assert where(lambda: model(x)) == [("test_dataparallel.py", 0)]
    with cgdp.DataParallel(FailsLate(), devs(2), chunks=1) as model:
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(6, 4)).sum().backward()
        assert where(lambda: model(torch.randn(6, 4))) == [("test_dataparallel.py", 0)]


def test_two_optimizers_on_separate_subsets_and_mixed_optimizer_as_documented():
    net = mlp()
    ref = copy.deepcopy(net)
    data = batches(2, 9)
    with cgdp.DataParallel(net, devs(3), chunks=1) as model:
        for m in (model, ref):
            params = list(m.parameters())
            opts = [bound(m, SGD(params[:4])), bound(m, torch.optim.Adam(params[4:], lr=1e-2))]
            for x, y in data:
                for o in opts:
                    o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                for o in opts:
                    o.step()
        assert_replicas_identical(model)
    assert_params_close(net, ref)
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "migration.md").read_text()
    assert "p.data" in doc and "separate" in doc and "refused" in doc


def test_closing_from_a_device_thread_does_not_join_itself():
    # what the garbage collector does when it frees a dropped model on a device thread
    model = cgdp.DataParallel(mlp(), devs(2))
    _, errors = inside(model).threads.run_beside(lambda: None, [model.close])  # close() on device 1's thread
    assert errors == []
    assert model.closed


def test_a_sample_without_batch_dimension_is_said_when_the_forward_fails():
    """A 1-D input of 32 features to Linear(32, 2) is one sample to the layer, but cgdp splits every tensor along its
    first dimension: the replica's error (torch's shape message) comes with what happened and what to do. A 1-D
    batch that a module takes (token ids for an embedding) runs as before."""
    with cgdp.DataParallel(nn.Linear(32, 2), ["cpu:0", "cpu:1"]) as model:
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as err:
            model(torch.randn(32))
        assert any("one sample without a batch dimension" in n and "x.unsqueeze(0)" in n for n in err.value.__notes__)
        assert model(torch.randn(1, 32)).shape == (1, 2)
    with cgdp.DataParallel(nn.Embedding(10, 3), ["cpu:0", "cpu:1"]) as model:
        assert model(torch.arange(6)).shape == (6, 3)


def test_a_forward_that_raises_reports_its_own_error_not_an_earlier_one():
    """Each failing forward raises its own error: the first one's was kept and raised again for the next."""
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            if x.shape[1] != 4:
                raise ValueError(f"wanted 4 features, got {x.shape[1]}")
            return self.fc(x)

    with cgdp.DataParallel(Picky(), ["cpu:0", "cpu:1"]) as model:
        with pytest.raises(ValueError, match="got 3"):
            model(torch.randn(4, 3))
        assert model(torch.randn(4, 4)).shape == (4, 2)
        with pytest.raises(ValueError, match="got 5"):
            model(torch.randn(4, 5))
        with pytest.raises(ValueError, match="got 6"):
            model(torch.randn(4, 6))


def test_the_first_forward_that_draws_counts_batchnorm_once():
    """On emulated devices the first forward that draws random numbers (Dropout) is done again with a stream per
    device: its buffer writes, counters included, are undone first, so BatchNorm's statistics take one update."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    ref = copy.deepcopy(net)
    x = torch.randn(8, 4)
    with cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=1) as model:
        model(x)
        assert model.module[1].num_batches_tracked.item() == 1
        assert all(r[1].num_batches_tracked.item() == 1 for r in model.replicas)
        mean = model.module[1].running_mean.clone()
        model(x)
        assert model.module[1].num_batches_tracked.item() == 2
    halves = [copy.deepcopy(ref[1]) for _ in range(2)]
    with torch.no_grad():
        for bn, part in zip(halves, x.tensor_split(2)):
            bn(ref[0](part))
    torch.testing.assert_close(mean, (halves[0].running_mean + halves[1].running_mean) / 2, rtol=1e-6, atol=1e-7)


class _Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros((), dtype=torch.long))
        self.lin, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)

    def forward(self, x):
        if self.training:
            self.n.add_(1)
        return self.drop(self.lin(x))


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]])
@pytest.mark.parametrize("make, name", [(lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)),
                                         "1.num_batches_tracked"), (_Counts, "n")])
def test_a_later_first_draw_keeps_the_buffer_writes_before_it(devices, make, name):
    """Forwards that draw nothing (Dropout off) and then one that draws: the one done again starts from the buffers
    the earlier forwards wrote (one device, or counters only: nothing averaged, the baseline still moves)."""
    torch.manual_seed(0)
    net = make()
    with cgdp.DataParallel(net, devices, chunks=1) as model:
        drop = next(m for m in model.module.modules() if isinstance(m, nn.Dropout))
        drop.eval()
        for _ in range(3):
            model(torch.randn(8, 4))
        drop.train()
        model(torch.randn(8, 4))
        assert [dict(r.named_buffers())[name].item() for r in model.replicas] == [4] * len(devices)


def test_a_leaf_that_is_a_tensor_on_some_replicas_only_is_none_with_a_warning():
    """Not gathered as a tensor, and not kept as replica 0's own when another replica's equals it as a number."""
    from cgdp.engine.dataparallel.scatter import gather
    with pytest.warns(UserWarning, match="a tensor on some replicas only"):
        out = gather([{"loss": torch.tensor(2.0), "x": torch.ones(2)}, {"loss": 2.0, "x": torch.ones(2)}], [2, 2],
                     torch.device("cpu"), None)
    assert out["loss"] is None and out["x"].shape == (4,)


def test_output_device_is_where_the_outputs_are_and_read_only():
    with cgdp.DataParallel(nn.Linear(4, 2), ["cpu:0", "cpu:1"], chunks=1) as model:
        assert model(torch.randn(4, 4)).device == model.output_device == torch.device("cpu")
        with pytest.raises(AttributeError):
            model.output_device = torch.device("meta")
