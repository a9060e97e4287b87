"""Lightning's and Accelerate's paths through cgdp on a GPU (``accelerator="gpu"``), each against the same framework
on one device, two replicas on the one GPU (``share_devices``); ``--simulate``: two simulated GPUs.

    python bench/gpu_integrations.py [--simulate]

Prints one line per framework (``[integrations] lightning ok, max |param diff| ...``): a framework not installed
is skipped (said), a difference over 1e-4 or an error fails (exit 1).
"""
import argparse
import contextlib
import sys

import torch
from torch import nn


def data(n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def network():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def furthest(a, b):
    return max((p.detach().cpu() - q.detach().cpu()).abs().max().item() for p, q in zip(a.parameters(),
                                                                                       b.parameters()))


def lightning(devices, accelerator):
    import lightning.pytorch as L

    from cgdp.integrations.lightning import CGDPStrategy

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = network()

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y) + 1e-3 * self.net[0].weight.square().sum()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def fit(model, **kw):
        L.Trainer(max_epochs=2, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                  logger=False, gradient_clip_val=0.5, **kw).fit(model, torch.utils.data.DataLoader(data(), 12))
        return model
    one = fit(Model(), accelerator=accelerator, devices=1)
    two = fit(Model(), accelerator=accelerator, devices=1,
              strategy=CGDPStrategy(devices, share_devices=len(set(devices)) < len(devices)))
    return furthest(one, two)


def accelerate_loop(devices, cpu):
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    from cgdp.integrations.accelerate import Accelerator

    def train(acc):
        net = network()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        model, opt, dl = acc.prepare(net, opt, torch.utils.data.DataLoader(data(), 12))
        for _ in range(2):
            for x, y in dl:
                with acc.accumulate(model):
                    acc.backward(nn.functional.cross_entropy(model(x), y))
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), 0.5)
                    opt.step()
                    opt.zero_grad()
        acc.free_memory()
        return net
    for reset in (lambda: AcceleratorState._reset_state(reset_partial_state=True), GradientState._reset_state):
        reset()
    one = train(accelerate.Accelerator(cpu=cpu, gradient_accumulation_steps=2))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    two = train(Accelerator(devices, cpu=cpu, gradient_accumulation_steps=2,
                            cgdp_options={"share_devices": len(set(devices)) < len(devices)}))
    return furthest(one, two)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulate", action="store_true")
    args = ap.parse_args()
    failed = False
    if args.simulate:
        from cgdp.testing import simulated_cuda
        ctx, devices, accelerator = simulated_cuda(2, max_delay_s=0.0005), ["cuda:0", "cuda:1"], "cpu"
    else:
        ctx, devices, accelerator = contextlib.nullcontext(), ["cuda:0", "cuda:0"], "gpu"
    with ctx:
        for name, run in (("lightning", lambda: lightning(devices, accelerator)),
                          ("accelerate", lambda: accelerate_loop(devices, cpu=args.simulate))):
            if name == "lightning" and args.simulate:  # its accelerator checks for a real GPU
                print("[integrations] lightning skipped: a GPU only (Lightning checks the accelerator itself)")
                continue
            try:
                diff = run()
            except ImportError as exc:
                print(f"[integrations] {name} skipped: {exc}", flush=True)
                continue
            except Exception as exc:  # said, then the next framework
                print(f"[integrations] {name} FAILED: {type(exc).__name__}: {exc}", flush=True)
                failed = True
                continue
            ok = diff <= 1e-4
            failed |= not ok
            print(f"[integrations] {name} {'ok' if ok else 'FAILED'}, max |param diff| from one device {diff:.2e}",
                  flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
