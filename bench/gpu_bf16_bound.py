"""The bf16 wire against its rounding bound, step by step (a GPU run's diagnostic).

    python bench/gpu_bf16_bound.py --model resnet152 --batch 12 --replicas 1,2 --steps 2
    python bench/gpu_bf16_bound.py --simulate --model mlp     # anywhere, on the simulated runtime

For each G and each step k, cgdp with ``grad_transfer="bf16"`` and cgdp in float32 (which equals
``typical`` bit for bit) run side by side from one start on one batch. After step 1 (SGD with
momentum: p1 = p0 - lr * g) each element may differ by at most lr * |g| * 2^-7 (the per-replica
rounding to bf16 on the way to the host, the average's rounding on the way back) and two ulp of p; the script prints
the worst ratio of the difference to that bound (<= 1: the wire rounds as documented) and the
relative error after every step (later steps carry the first step's difference through the model).
The bound is checked at G = 1 only: at G > 1 each replica's own |g_i| bounds its rounding, and
those cancel in the mean, which the float32 step shows.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from gpu_all import Dev, batch_for, build  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet152")
    ap.add_argument("--batch", type=int, default=12, help="per replica")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    import cgdp
    dev = Dev(False, args.simulate)
    torch.backends.cudnn.deterministic = True
    results = []
    with dev.runtime():
        model0, shape, classes = build(args.model)
        for g in [int(v) for v in args.replicas.split(",")]:
            x, y = batch_for(args.model, args.batch * g, shape, classes, dev.torch)
            loss_fn = nn.CrossEntropyLoss()
            trs = {}
            for wire in (None, "bf16"):
                torch.manual_seed(2)
                trs[wire] = cgdp.Trainer(copy.deepcopy(model0), lambda p: torch.optim.SGD(p, lr=args.lr, momentum=0.9),
                                         [dev.name] * g, share_devices=g > 1, grad_transfer=wire)
            p0 = [p.detach().clone() for p in trs[None].replicas[0].parameters()]
            try:
                for k in range(1, args.steps + 1):
                    losses = {w: float(tr.step(x, y, loss_fn)) for w, tr in trs.items()}
                    a = [p.detach() for p in trs[None].replicas[0].parameters()]
                    b = [p.detach() for p in trs["bf16"].replicas[0].parameters()]
                    den = max(float(p.abs().max()) for p in a)
                    entry = {"G": g, "step": k, "losses": losses,
                             "rel_err": max(float((u - v).abs().max()) for u, v in zip(a, b)) / den}
                    if k == 1 and g == 1:  # |g| from the float32 run's own first step: (p0 - p1) / lr
                        ratio = 0.0
                        for q0, u, v in zip(p0, a, b):
                            bound = (q0 - u).abs() * 2.0 ** -7 + u.abs() * 2.0 ** -22 + 1e-30  # + 2 ulp of p
                            ratio = max(ratio, float(((u - v).abs() / bound).max()))
                        entry["worst_over_bound"] = ratio
                        entry["max_step"] = max(float((q0 - u).abs().max()) for q0, u in zip(p0, a)) / den
                    results.append(entry)
                    print("[bf16_bound]", json.dumps(entry), flush=True)
            finally:
                for tr in trs.values():
                    tr.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bf16_bound.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
