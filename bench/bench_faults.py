"""Fault figures for docs/reliability.md: how long a stalled step takes to fail, how soon Ctrl-C
surfaces, and what create/close cycles leave behind (RSS, threads) with the cycle collector off.

    PYTHONPATH=. python bench/bench_faults.py
"""
import _thread, gc, sys, threading, time
import torch, torch.nn.functional as F
from torch import nn
import cgdp
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
from helpers import mlp

ev = threading.Event()
class Stall(nn.Module):
    def __init__(self):
        super().__init__(); self.net = mlp()
    def forward(self, x):
        if threading.current_thread().name == "cgdp-cpu:1" and not ev.is_set():
            ev.wait(60)
        return self.net(x)
X, Y = torch.randn(6, 12), torch.randint(0, 5, (6,))
SGD = lambda p: torch.optim.SGD(p, lr=0.1)
for t in (1.0, 2.0, 5.0):
    ev.clear()
    tr = cgdp.Trainer(Stall(), SGD, ["cpu:0", "cpu:1"], timeout_s=t)
    t0 = time.monotonic()
    try:
        tr.step(X, Y, F.cross_entropy)
    except TimeoutError:
        pass
    took = time.monotonic() - t0
    t1 = time.monotonic(); tr.close(); c = time.monotonic() - t1
    ev.set()
    print(f"timeout_s={t:g}: TimeoutError after {took:.2f} s; close() {c*1e3:.0f} ms")
ev.clear()
tr = cgdp.Trainer(Stall(), SGD, ["cpu:0", "cpu:1"], timeout_s=None)
threading.Timer(0.5, _thread.interrupt_main).start()
t0 = time.monotonic()
try:
    tr.step(X, Y, F.cross_entropy)
except KeyboardInterrupt:
    print(f"Ctrl-C: KeyboardInterrupt {time.monotonic() - t0 - 0.5:.2f} s after the signal")
tr.close(); ev.set()

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
def big():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
x, y = torch.randn(4, 1024), torch.randint(0, 1024, (4,))
for end in ("close", "drop"):
    gc.collect(); gc.disable()
    r0 = rss()
    for i in range(20):
        tr = cgdp.Trainer(big(), SGD, ["cpu:0", "cpu:1"], chunks=2)
        tr.step(x, y, F.cross_entropy)
        if end == "close":
            tr.close()
        del tr
    print(f"20 x ({end}) of a 33.6 MB model, gc off: RSS {r0:.0f} -> {rss():.0f} MB, threads {threading.active_count()}")
    gc.enable()
