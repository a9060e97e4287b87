"""A rank that dies or freezes in the middle of backward; the others must fail, not hang.

``mpiexec -n 2 python fault.py MODE TIMEOUT [AFTER GRACE [ERROR_FILE]]``: rank 1 sends itself SIGKILL (``kill``)
or SIGSTOP (``stop``: frozen, as a machine that hangs; no launcher notices) while backward of step 2
runs. Rank 0 prints ``CAUGHT <type>: <message>`` when its step raises, then (AFTER) exits
(``exit``, the default: cgdp aborts the MPI job at exit, which also ends the frozen rank), goes on
sleeping (``linger``: the abort comes ``GRACE`` seconds after the failure), or blocks every Python
thread (``hold-gil``: a C call that keeps the GIL; only the C watchdog can end the process).
ERROR_FILE (with ``{rank}``) is the comm's ``error_file``.
"""
import ctypes
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import cgdp
from cgdp.comm.mpi import MPIComm

mode, timeout_s = sys.argv[1], float(sys.argv[2])
after = sys.argv[3] if len(sys.argv) > 3 else "exit"
grace = float(sys.argv[4]) if len(sys.argv) > 4 else 30.0
error_file = sys.argv[5] if len(sys.argv) > 5 else None
torch.set_num_threads(1)
SIG = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[mode]


class Trap(nn.Module):
    """Identity; on the armed rank, its gradient (mid-backward) freezes or kills the process."""
    armed = False

    def forward(self, x):
        if Trap.armed and x.requires_grad:
            x.register_hook(spring)
        return x


def spring(grad):
    print(f"rank 1 trap springs ({mode}) in {threading.current_thread().name}", flush=True)
    os.kill(os.getpid(), SIG)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Trap(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
tr = cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"], chunks=1,
                  comm=MPIComm(timeout_s=timeout_s, abort_grace_s=grace, error_file=error_file), timeout_s=timeout_s)
rank = MPI.COMM_WORLD.rank
g = torch.Generator().manual_seed(rank)
t0 = None
try:
    for step in range(4):
        if step == 2:
            Trap.armed = rank == 1
            t0 = time.monotonic()
        tr.step(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g), F.cross_entropy)
        print(f"rank {rank} step {step} done", flush=True)
except Exception as exc:
    print(f"CAUGHT {type(exc).__name__} after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
    print(f"CAUGHT-AT {time.time():.3f}", flush=True)
    if exc.__cause__ is not None:
        print(f"CAUSE {type(exc.__cause__).__name__}: {exc.__cause__}", flush=True)
    if after == "linger":
        while True:
            time.sleep(1)
    if after == "hold-gil":
        ctypes.PyDLL(None).sleep(3600)  # PyDLL keeps the GIL during the call
    sys.exit(3)
print(f"rank {rank} finished without error", flush=True)
