"""Models and the single-device autograd reference the engine is compared with."""
from __future__ import annotations

import copy

import torch
from torch import nn
import torch.nn.functional as F


def mlp(widths=(12, 24, 24, 16, 5), seed=0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


class Tied(nn.Module):
    """Embedding tied with the output projection: one parameter used twice."""
    def __init__(self, vocab=11, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mid(self.emb(idx))))


class Gated(nn.Module):
    """``extra`` runs only on samples whose first feature is > 100 (data-dependent use);
    ``never`` is never used; ``frozen`` does not train."""
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(6, 4)
        self.extra = nn.Linear(6, 4)
        self.never = nn.Linear(6, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = self.base(x)
        idx = (x[:, 0] > 100).nonzero().squeeze(1)
        if idx.numel():
            h = h.index_add(0, idx, self.extra(x[idx] / 100))
        return self.frozen(h)


class WithBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class TokenLM(nn.Module):
    """A per-token model: embedding, a layer that mixes the sequence, a tied output."""
    def __init__(self, vocab=13, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.out(torch.tanh(self.mix(h + h.mean(1, keepdim=True))))


def token_batches(n_steps, n, t=6, seed=2):
    """Padded sequences (label -100 on padding) of very different lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        ids = torch.randint(0, 13, (n, t), generator=g)
        lengths = torch.randint(1, t + 1, (n,), generator=g)
        labels = torch.where(torch.arange(t) < lengths[:, None], torch.randint(0, 13, (n, t), generator=g), -100)
        out.append({"ids": ids, "labels": labels})
    return out


def token_sum(m, b):
    logits = m(b["ids"])
    return (F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum"),
            (b["labels"] != -100).sum())


def token_mean(m, b):
    return F.cross_entropy(m(b["ids"]).flatten(0, 1), b["labels"].flatten())  # ignore_index=-100


def reference(model, make_opt, batches, loss_fn, n_parts=None):
    """Plain single-device autograd training. With ``n_parts``, the loss is the batch-weighted sum
    of the losses of the ``tensor_split`` parts (what data parallelism computes for models whose
    forward depends on the batch, such as BatchNorm in training mode)."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        if n_parts is None:
            loss = loss_fn(model(x), y)
        else:
            n = x.shape[0]
            loss = sum(loss_fn(model(xp), yp) * (xp.shape[0] / n)
                       for xp, yp in zip(torch.tensor_split(x, n_parts), torch.tensor_split(y, n_parts)))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def reference_step2(model, make_opt, batches, loss_fn):
    """Plain single-device training with ``loss_fn(model, batch)`` on each whole batch (a pair
    ``(loss_sum, count)`` is trained as ``loss_sum / count``)."""
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(model, b)
        if isinstance(loss, tuple):
            loss = loss[0] / loss[1]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def train_step2(model, make_opt, g, batches, loss_fn, **kw):
    """``model`` trained in place by ``step(batch, loss_fn)`` on g emulated devices (or the
    device list g), replicas checked identical after every step; the losses ``step`` returned."""
    import cgdp
    devices = [f"cpu:{i}" for i in range(g)] if isinstance(g, int) else g
    with cgdp.Trainer(model, make_opt, devices, **kw) as tr:
        assert tr.replicas[0] is model
        losses = []
        for b in batches:
            losses.append(tr.step(b, loss_fn))
            assert_replicas_identical(tr)
        return losses


def assert_params_close(a: nn.Module, b: nn.Module, rtol=1e-5, floor=1e-12):
    """Per parameter, max |a - b| / max |b| <= rtol; ``floor`` bounds the scale from below, for
    parameters that only hold rounding noise (a gradient that is zero in exact arithmetic)."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        scale = q.detach().abs().max().clamp_min(floor)
        err = ((p.detach() - q.detach()).abs().max() / scale).item()
        assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol}"


def assert_replicas_identical(trainer):
    first = trainer.replicas[0].state_dict()
    for r in trainer.replicas[1:]:
        for k, v in r.state_dict().items():
            assert torch.equal(v, first[k]), f"replicas differ in {k}"


def assert_ranks_equal_reference(states, ref: nn.Module, model: nn.Module):
    """Every rank's state_dict bitwise rank 0's, and ``model`` loaded with it close to ``ref``."""
    for sd in states[1:]:
        for k in states[0]:
            assert torch.equal(states[0][k], sd[k]), f"ranks differ in {k}"
    model.load_state_dict(states[0])
    assert_params_close(model, ref)


def bound(model: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` bound to ``model`` when it is a ``cgdp.DataParallel`` (every replica then takes its
    step); as it is for a plain module: the same loop drives both."""
    return model.bind(opt) if getattr(model, "bind", None) is not None else opt


def queued_upload(rt, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy from page-locked host memory (filled with 1.0) into a zeroed tensor of cuda:0, queued
    on its default stream behind 50 ms of device work: (the host buffer, the device tensor)."""
    host = rt.host_alloc(n, torch.float32)
    host.fill_(1.0)
    d = torch.zeros(n, device=rt.torch_device(0))
    rt.cuda._sleep(int(0.05e9))  # the default stream is busy for 50 ms
    rt.copy(d, host)  # on cuda:0's default stream: queued
    return host, d
