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
import sys
import time

import torch
from mpi4py import MPI

import cgdp
from cgdp.comm.mpi import MPIComm
from comm_checks import Trap, train_trapped, trapped_model

mode, timeout_s = sys.argv[1], float(sys.argv[2])
after = sys.argv[3] if len(sys.argv) > 3 else "exit"
grace = float(sys.argv[4]) if len(sys.argv) > 4 else 30.0
error_file = sys.argv[5] if len(sys.argv) > 5 else None
torch.set_num_threads(1)
Trap.mode = mode
model = trapped_model()
tr = cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"], chunks=1,
                  comm=MPIComm(timeout_s=timeout_s, abort_grace_s=grace, error_file=error_file), timeout_s=timeout_s)
rank = MPI.COMM_WORLD.rank
try:
    train_trapped(tr, rank)
except Exception as exc:
    print(f"CAUGHT {type(exc).__name__} after {time.monotonic() - Trap.armed_at:.1f} s: {exc}", flush=True)
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
