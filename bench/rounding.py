"""How far each face ends from one device: a small transformer LM, SGD, no clipping, 40 steps, 2 emulated devices.

    python bench/rounding.py [--batches 9,10,12,16] [--lr 0.5] [--steps 40]

Per global batch N: the largest parameter difference from one device after the steps, and the step-0 loss
difference, for ``cgdp.Trainer`` (each device's loss on its part, weighted n_j / N) and ``cgdp.DataParallel`` (the loss
once, on the gathered output, as one device computes it). Both are one device's up to float32 rounding; the check:
every difference below 1e-5 (docs/step.md, "Rounding").
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import cgdp

V, D, T = 50, 32, 12


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.block = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(D, V)

    def forward(self, x):
        return self.out(self.block(self.emb(x)))


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def furthest(model, ref):
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def one_device_loop(model, opt, data):
    """The plain loop (one device, or a DataParallel with its bound optimizer): the losses."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def run(n, steps, lr):
    torch.manual_seed(0)
    model = LM()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)) for _ in range(steps)]
    ref = copy.deepcopy(model)
    losses = one_device_loop(ref, torch.optim.SGD(ref.parameters(), lr=lr), data)
    out = {}
    with cgdp.Trainer(copy.deepcopy(model), lambda p: torch.optim.SGD(p, lr=lr), ["cpu:0", "cpu:1"]) as tr:
        first = [tr.step(x, y, loss_fn) for x, y in data][0]
        out["Trainer"] = furthest(tr.replicas[0], ref), abs(first - losses[0])
    with cgdp.DataParallel(copy.deepcopy(model), ["cpu:0", "cpu:1"]) as dp:
        got = one_device_loop(dp, dp.bind(torch.optim.SGD(dp.parameters(), lr=lr)), data)
        out["DataParallel"] = furthest(dp.module, ref), abs(got[0] - losses[0])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="9,10,12,16")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"| N | face | max param diff after {args.steps} steps | step-0 loss diff |\n|---|---|---|---|")
    worst = 0.0
    for n in map(int, args.batches.split(",")):
        for face, (param, loss0) in run(n, args.steps, args.lr).items():
            print(f"| {n} | {face} | {param:.2e} | {loss0:.2e} |", flush=True)
            worst = max(worst, param, loss0)
    assert worst < 1e-5, f"a face ended {worst:.2e} from one device"


if __name__ == "__main__":
    main()
