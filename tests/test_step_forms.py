"""``step(batch, loss_fn)``: nested batches, ``(loss_sum, count)`` losses, autocast, the model
trained in place; each against plain single-device autograd."""
import copy
from collections import OrderedDict, namedtuple
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgdp
from cgdp.engine.trainer.batch import split_nested
from cgdp.engine.trainer.losses import backward_weight
from helpers import (TokenLM, assert_params_close, assert_replicas_identical, mlp, reference_step2,
                     token_batches, token_mean, token_sum, train_step2)

SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
Pair = namedtuple("Pair", "a b")


def devs(g):
    return [f"cpu:{i}" for i in range(g)]


class KwNet(nn.Module):
    """Keyword arguments, a non-tensor argument and a tensor that is not per-sample."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = mlp((12, 16, 5))

    def forward(self, x, *, scale: float, offset: torch.Tensor):
        return self.body(x * scale) + offset


def kw_batches(n_steps, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(n, 12, generator=g), "y": torch.randint(0, 5, (n,), generator=g),
             "extra": {"scale": 0.5, "offset": torch.randn(5, generator=g), "tag": "train"}}
            for _ in range(n_steps)]


def kw_loss(m, b):
    assert b["extra"]["tag"] == "train"
    return F.cross_entropy(m(b["x"], scale=b["extra"]["scale"], offset=b["extra"]["offset"]), b["y"])


@pytest.mark.parametrize("g", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["cgdp", "typical"])
def test_nested_batch_with_keyword_arguments_equals_single_device(g, mode):
    model = KwNet()
    data = kw_batches(3, 10)  # 10 samples: uneven across 3 and 4 devices
    ref, ref_losses = reference_step2(model, ADAM, data, kw_loss)
    losses = train_step2(model, ADAM, g, data, kw_loss, mode=mode, chunks=1)
    assert_params_close(model, ref)  # the model passed in was trained in place
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_model_is_replica_zero_and_the_others_are_copies():
    model = mlp()
    with cgdp.Trainer(model, SGD, devs(3)) as tr:
        assert tr.replicas[0] is model
        assert all(r is not model for r in tr.replicas[1:])
        assert not any(p is q for p, q in zip(model.parameters(), tr.replicas[1].parameters()))
        x, y = torch.randn(6, 12), torch.randint(0, 5, (6,))
        before = [p.detach().clone() for p in model.parameters()]
        tr.step(x, y, F.cross_entropy)
        assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_split_keeps_structure_and_splits_only_batch_tensors():
    BatchEncoding = pytest.importorskip("transformers").BatchEncoding
    n, g = 7, 3
    ids = torch.arange(n * 2).reshape(n, 2)
    other = torch.randn(4, 3)
    batch = OrderedDict(enc=BatchEncoding({"input_ids": ids, "attention_mask": ids > 3}),
                        pair=Pair(ids[:, 0], [other, "text", 3]), scalar=torch.tensor(2.0), none=None)
    parts, sizes, whole = split_nested(batch, g)
    assert whole == {id(other), id(batch["scalar"])}
    assert sizes == [3, 2, 2]
    for j, part in enumerate(parts):
        assert type(part) is OrderedDict and type(part["enc"]) is BatchEncoding
        assert type(part["pair"]) is Pair and type(part["pair"].b) is list
        assert torch.equal(part["enc"]["input_ids"], torch.tensor_split(ids, g)[j])
        assert torch.equal(part["enc"]["attention_mask"], torch.tensor_split(ids > 3, g)[j])
        assert part["enc"].input_ids is part["enc"]["input_ids"]  # BatchEncoding attribute access
        assert torch.equal(part["pair"].a, torch.tensor_split(ids[:, 0], g)[j])
        assert part["pair"].b[0] is other and part["pair"].b[1:] == ["text", 3]
        assert part["scalar"] is batch["scalar"] and part["none"] is None
    assert batch["enc"]["input_ids"] is ids  # the caller's batch is left as it was
    t = torch.randn(5, 2)
    parts, sizes, _ = split_nested(t, 2)
    assert sizes == [3, 2] and torch.equal(torch.cat(parts), t)


@pytest.mark.parametrize("batch, match", [
    ({"n": 3, "s": "x"}, "no tensor with a batch dimension"),
    ((torch.tensor(1.0),), "no tensor with a batch dimension"),
    ({"x": torch.randn(8, 2), "w": torch.randn(5)}, "cannot tell the batch dimension"),
    ((torch.randn(0, 3), torch.randn(0)), "got an empty batch"),
    # detection-style targets: per-sample dicts of boxes; the most common length (2) is not the batch
    ((torch.randn(4, 3), [{"boxes": torch.randn(k, 4), "labels": torch.zeros(k)} for k in (2, 2, 1, 3)]),
     "list of 4 per-sample records whose 'boxes' tensors have different first dimensions"),
])
def test_batches_that_cannot_be_split_are_named(batch, match):
    with pytest.raises(ValueError, match=match):
        split_nested(batch, 2)


def test_loss_errors_are_clear_and_the_trainer_stays_usable():
    model = KwNet()
    data = kw_batches(1, 7)[0]
    with cgdp.Trainer(model, SGD, devs(2)) as tr:
        with pytest.raises(TypeError, match="model\\(\\*\\*batch\\).loss"):
            tr.step(data, lambda m, b: {"loss": kw_loss(m, b)})
        with pytest.raises(TypeError, match="same form on every device"):  # parts of 4 and 3
            tr.step(data, lambda m, b: (kw_loss(m, b), 1) if b["x"].shape[0] == 4 else kw_loss(m, b))
        with pytest.raises(ValueError, match="counts sum to 0"):
            tr.step(data, lambda m, b: (kw_loss(m, b) * 0, 0))
        with pytest.raises(ValueError, match="count of -1"):
            tr.step(data, lambda m, b: (kw_loss(m, b), -1))
        with pytest.raises(TypeError, match="second element"):
            tr.step(data, lambda m, b: (kw_loss(m, b), "many"))
        with pytest.raises(TypeError, match="count is a bool tensor.*mask.sum\\(\\)"):
            tr.step(data, lambda m, b: (kw_loss(m, b), torch.tensor(True)))
        with pytest.raises(TypeError, match="callable as loss_fn\\(model, batch\\)"):
            tr.step(data, "cross_entropy")
        with pytest.raises(TypeError, match="takes \\(batch, loss_fn\\)"):
            tr.step(data)
        for torch_loss in (F.cross_entropy, nn.CrossEntropyLoss()):  # targets forgotten
            with pytest.raises(TypeError, match="takes \\(output, target\\).*step\\(inputs, targets, loss_fn\\)"):
                tr.step(data["x"], torch_loss)
        assert tr.step(data, kw_loss) > 0  # none of these broke it
        assert tr.step(data, loss_fn=kw_loss) > 0
        assert_replicas_identical(tr)


@pytest.mark.parametrize("g, mode", [(2, "cgdp"), (3, "cgdp"), (3, "typical"), (1, "single")])
def test_sum_count_loss_is_the_global_token_mean(g, mode):
    model = TokenLM()
    data = token_batches(4, 7)
    ref, ref_losses = reference_step2(model, ADAM, data, token_mean)
    got = copy.deepcopy(model)
    losses = train_step2(got, ADAM, g, data, token_sum, chunks=1, mode=mode)
    assert got.out.weight is got.emb.weight
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(got, ref)
    if g == 1:
        return
    # the per-part token mean, weighted by samples, is not the global token mean, and cgdp says so
    with pytest.warns(UserWarning, match="not the token mean one device computes"):
        train_step2(model, ADAM, g, data, token_mean)
    err = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(model.parameters(), ref.parameters()))
    assert err > 1e-3


def test_nested_batch_with_micro_batches_equals_single_device():
    """Micro-batches split each device's nested part again (the (5,) offset stays whole)."""
    model = KwNet()
    data = kw_batches(2, 15)  # 5 samples per device
    ref, _ = reference_step2(model, ADAM, data, kw_loss)
    train_step2(model, ADAM, 3, data, kw_loss, micro_batches=2)
    assert_params_close(model, ref)


@pytest.mark.parametrize("g, n, k, mode", [(1, 9, 3, "single"), (2, 9, 2, "cgdp"), (3, 10, 3, "cgdp"),
                                           (4, 11, 2, "cgdp"), (3, 10, 2, "typical")])
def test_sum_count_loss_with_micro_batches_is_one_step_on_the_whole_batch(g, n, k, mode):
    """(loss_sum, count) with micro_batches=k: the token mean of the whole batch, as one device
    computes it in one step, for uneven splits (10 samples on 3 devices, micro-batches of 2 and
    1) and very different token counts per micro-batch."""
    model = TokenLM()
    data = token_batches(3, n)
    ref, ref_losses = reference_step2(model, ADAM, data, token_mean)
    got = copy.deepcopy(model)
    losses = train_step2(got, ADAM, g, data, token_sum, chunks=1, mode=mode, micro_batches=k,
                         clip_grad_norm=float("inf"))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(got, ref)


def test_micro_batches_must_return_one_form_and_count_something():
    calls = {"n": 0}

    def mixed(m, b):  # a pair in the first micro-batch, a mean in the next
        calls["n"] += 1
        return token_sum(m, b) if calls["n"] % 2 else token_mean(m, b)

    def nothing(m, b):
        loss, _ = token_sum(m, b)
        return loss * 0, 0
    with cgdp.Trainer(TokenLM(), ADAM, devs(1), mode="single", micro_batches=2) as tr:
        with pytest.raises(TypeError, match="same form on every device"):
            tr.step(token_batches(1, 8)[0], mixed)
        with pytest.raises(ValueError, match="counts sum to 0"):
            tr.step(token_batches(1, 8)[0], nothing)
        tr.step(token_batches(1, 8)[0], token_sum)  # still usable
        assert tr.step_count == 1


@pytest.mark.parametrize("micro", [1, 2])
def test_sum_count_loss_over_ranks_is_the_global_token_mean(micro):
    from test_comm_inproc import on_ranks
    model = TokenLM()
    data = token_batches(3, 9)
    ref, ref_losses = reference_step2(model, SGD, data, token_mean)

    def rank(comm):
        with cgdp.Trainer(copy.deepcopy(model), SGD, devs(2), comm=comm, timeout_s=30,
                          micro_batches=micro) as tr:
            losses = []
            for b in data:
                mine = {k: torch.tensor_split(v, comm.size)[comm.rank] for k, v in b.items()}
                losses.append(tr.step(mine, token_sum))
            return tr.replicas[0], losses

    (m0, l0), (m1, l1) = on_ranks(2, rank, timeout_s=30)
    assert l0 == l1 == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(m0, ref)
    assert all(torch.equal(p, q) for p, q in zip(m0.parameters(), m1.parameters()))


def _nearest(w, dtype):
    """The value of ``dtype`` nearest to ``w``, by search over every positive finite value."""
    bits = torch.arange(0, 0x7F80 if dtype == torch.bfloat16 else 0x7C00, dtype=torch.int32)
    values = bits.to(torch.int16).view(dtype).double().tolist()
    return min(values, key=lambda v: abs(Fraction(v) - Fraction(w)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w", [1 / 3, 2 / 3, 3 / 7, 1 + 2**-8 + 2**-30, 1 / 1000])
def test_backward_weight_is_correctly_rounded(w, dtype):
    t = backward_weight(w, dtype, torch.device("cpu"))
    assert t.dtype == dtype and t.dim() == 0
    assert float(t) == _nearest(w, dtype)


def test_backward_weight_in_float32_and_float64():
    assert backward_weight(1 / 3, torch.float32, torch.device("cpu")).item() == torch.tensor(1 / 3).item()
    assert backward_weight(1 / 3, torch.float64, torch.device("cpu")).item() == 1 / 3


def test_bf16_loss_gets_the_correctly_rounded_weight():
    """A bf16 loss (autocast, no float32 reduction) on 3 devices: each device's backward starts
    from bf16(1/3) = 0.333984375; the gradient is that times the part's gradient."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    x = torch.ones(3, 4)
    with cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=1.0), devs(3), mode="typical") as tr:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tr.step(x, lambda m, b: m(b).sum())  # each part: one sample, loss = 4 in bf16
        # w = bf16(1/3) per device, dL/dweight = 1 per sample: 3 * 0.333984375
        assert model.weight.detach()[0, 0].item() == pytest.approx(1.0 - 3 * 0.333984375, abs=1e-7)


def _amp_loss(seen):
    def loss_fn(m, b):
        out = m(b[0])
        seen.add(out.dtype)
        return F.cross_entropy(out, b[1])
    return loss_fn


def _single_amp(model, data, parts=1, amp=True):
    """One device, ``torch.autocast('cpu', bfloat16)`` around the forward; with ``parts``, the
    loss is the sample-weighted sum over the ``tensor_split`` parts and the autocast weight cache
    is off, so each part's weight gradient reaches float32 on its own, as on separate devices."""
    model = copy.deepcopy(model)
    opt = SGD(model.parameters())
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp, cache_enabled=parts == 1):
            loss = sum(F.cross_entropy(model(a), b) * (a.shape[0] / x.shape[0])
                       for a, b in zip(torch.tensor_split(x, parts), torch.tensor_split(y, parts)))
        loss.backward()
        opt.step()
    return model


@pytest.mark.parametrize("g", [1, 3, 4])
def test_autocast_around_step_applies_on_every_device(g):
    model = mlp((12, 64, 64, 5))
    gen = torch.Generator().manual_seed(4)
    data = [(torch.randn(10, 12, generator=gen), torch.randint(0, 5, (10,), generator=gen))
            for _ in range(3)]
    seen = set()
    got = copy.deepcopy(model)
    with cgdp.Trainer(got, SGD, devs(g)) as tr:
        for b in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                tr.step(b, _amp_loss(seen))
            assert_replicas_identical(tr)
    assert seen == {torch.bfloat16}  # every device's forward ran under autocast
    with cgdp.Trainer(copy.deepcopy(model), SGD, devs(g)) as tr:  # the three-argument form too
        outputs = set()

        def record(out, y):
            outputs.add(out.dtype)
            return F.cross_entropy(out, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tr.step(*data[0], record)
        assert outputs == {torch.bfloat16}
    # exact against one device running the same bf16 computations on the same parts
    assert_params_close(got, _single_amp(model, data, parts=g), rtol=1e-5)

    # against one device on the whole batch: within the rounding of bf16 autocast itself
    def err(a, b):
        return max(((p - q).abs().max() / q.abs().max()).item()
                   for p, q in zip(a.parameters(), b.parameters()))
    whole = _single_amp(model, data)
    bf16_itself = err(whole, _single_amp(model, data, amp=False))
    assert 1e-4 < bf16_itself and err(got, whole) <= 2 * bf16_itself


def test_sum_count_loss_over_the_cuda_backend():
    """The two-argument form through the CUDA backend (simulated runtime): the model is replica 0,
    (loss_sum, count) gives the global token mean."""
    from cgdp.testing import simulated_cuda
    model = TokenLM()
    data = token_batches(3, 7)
    ref, ref_losses = reference_step2(model, SGD, data, token_mean)
    with simulated_cuda(2, seed=3):
        losses = train_step2(model, SGD, ["cuda:0", "cuda:1"], data, token_sum)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(model, ref)



def _pair_loss(count_on, scale=1.0, bf16=False):
    """token_sum with its count ``count_on`` the device (a tensor, kept there) or the host (a
    Python float, read by the loss itself); ``scale``: a fractional count; ``bf16``: the loss in
    bfloat16, so that backward starts from a 16-bit weight."""
    def loss_fn(m, b):
        loss, count = token_sum(m, b)
        count = count * scale
        return (loss.bfloat16() if bf16 else loss), (count if count_on == "device" else float(count))
    return loss_fn


@pytest.mark.parametrize("g, mode, k, scale, bf16", [(3, "cgdp", 1, 1.0, False), (3, "cgdp", 2, 0.3, False),
                                                      (2, "typical", 2, 1.0, True), (3, "cgdp", 1, 0.7, True),
                                                      ("simulated", "cgdp", 2, 0.3, True)])
def test_counts_kept_on_the_devices_train_bitwise_as_counts_read_on_the_host(g, mode, k, scale, bf16):
    """A count returned as a tensor stays on its device: the total, 1 / C, the 16-bit weight and
    the micro-batches' rescale are made there, with the values the host computes from counts it
    read (fractional counts added in the same order): parameters and losses bitwise the same,
    also through the CUDA backend (simulated runtime)."""
    from contextlib import nullcontext
    from cgdp.testing import simulated_cuda
    data = token_batches(2, 10)
    out = {}
    for where in ("host", "device"):
        model = TokenLM()
        with simulated_cuda(2, seed=3) if g == "simulated" else nullcontext():
            out[where] = (train_step2(model, ADAM, ["cuda:0", "cuda:1"] if g == "simulated" else g, data,
                                      _pair_loss(where, scale, bf16), chunks=1, mode=mode, micro_batches=k),
                          {name: v.cpu() for name, v in model.state_dict().items()})
    assert out["host"][0] == out["device"][0]
    assert all(torch.equal(v, out["device"][1][key]) for key, v in out["host"][1].items())


@pytest.mark.parametrize("micro, update", [(1, "devices"), (2, "devices"), (1, "host")])
def test_bad_counts_on_the_devices_reject_the_step_with_nothing_applied(micro, update):
    """Counts on the devices are checked when the step reads its losses (before backward with
    ``update="host"``, whose optimizer steps during backward): the same errors as for counts read
    at once, nothing applied (the next steps train bitwise as if the bad ones never ran)."""
    model = mlp((12, 16, 5))
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)) for _ in range(2)]

    def pair(m, b, f=lambda c: c):
        return F.cross_entropy(m(b[0]), b[1], reduction="sum"), f((b[1] >= 0).sum())
    ref = copy.deepcopy(model)
    train_step2(ref, ADAM, 2, data, pair, micro_batches=micro, update=update)
    with cgdp.Trainer(model, ADAM, devs(2), micro_batches=micro, update=update) as tr:
        tr.step(data[0], pair)
        for f, match in [(lambda c: c * 0, "counts sum to 0"), (lambda c: c - 100, "count of -"),
                         (lambda c: c * float("nan"), "count of nan")]:
            with pytest.raises(ValueError, match=match):
                tr.step(data[1], lambda m, b: pair(m, b, f))
        assert tr.step_count == 1
        tr.step(data[1], pair)
        assert_replicas_identical(tr)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_weights_rounded_once_on_the_device_equal_the_nearest():
    """``rounded_once`` (rounding to odd through float32) against the nearest 16-bit value found
    exactly (fractions) for random weights and ties; the host's weight (a float) the same."""
    from bisect import bisect_left
    from cgdp.engine.trainer.losses import rounded_once
    g = torch.Generator().manual_seed(5)
    scale = 2.0 ** torch.randint(-30, 8, (400,), generator=g)
    w = torch.cat([torch.rand(400, generator=g, dtype=torch.float64) * scale,
                   1.0 / torch.arange(1, 300, dtype=torch.float64),
                   torch.tensor([1 + 2**-8, 1 + 2**-8 + 2**-30, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 2**-11 + 2**-40,
                                 2.0**-24 + 2.0**-26, 2.0**-25, 2.0**-133, 3 * 2.0**-134], dtype=torch.float64)])
    for dtype in (torch.bfloat16, torch.float16):
        top = 0x7F80 if dtype == torch.bfloat16 else 0x7C00
        values = torch.arange(0, top, dtype=torch.int32).to(torch.int16).view(dtype).double().tolist()
        got = rounded_once(w, dtype).double().tolist()
        for x, y in zip(w.tolist(), got):
            i = min(bisect_left(values, x), len(values) - 1)
            near = [(abs(Fraction(values[b]) - Fraction(x)), b & 1, values[b]) for b in (i - 1, i) if b >= 0]
            assert y == min(near)[2], (x, y, min(near))
            assert backward_weight(x, dtype, torch.device("cpu")).item() == y
