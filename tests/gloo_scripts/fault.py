"""A gloo rank that dies, freezes, or never comes; the others must fail with words, then end.

``python fault.py MODE TIMEOUT ERROR_FILE`` as rank r of 2 (RANK, WORLD_SIZE, MASTER_* set):

* ``kill``: rank 1 sends itself SIGKILL in the middle of backward of step 2;
* ``stop``: rank 1 sends itself SIGSTOP there (a frozen machine).

Rank 0 prints ``CAUGHT <type> after <s> s: <message>`` when its trainer raises, then lets the
error leave the script (as ``python -m cgdp.train`` does): its process must end at once.
"""
import os
import sys
import time

import torch
import torch.distributed

import cgdp
from cgdp.comm.gloo import GlooComm, init_from_env
from comm_checks import Trap, train_trapped, trapped_model

mode, timeout_s, error_file = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rank = int(os.environ["RANK"])
torch.set_num_threads(1)


Trap.mode = mode
model = trapped_model()
try:
    init_from_env(timeout_s)
    # build the kernels once, then line the ranks up: a loaded machine must not make the trainer's
    # start-up check (a collective with the same short timeout) fail instead of the fault
    cgdp.Trainer(trapped_model(), lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"], chunks=1).close()
    torch.distributed.barrier()
    tr = cgdp.Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), ["cpu:0", "cpu:1"], chunks=1,
                      comm=GlooComm(timeout_s=timeout_s, error_file=error_file), timeout_s=timeout_s)
    train_trapped(tr, rank)
except Exception as exc:
    print(f"CAUGHT {type(exc).__name__} after {time.monotonic() - Trap.armed_at:.1f} s: {exc}", flush=True)
    print(f"CAUGHT-AT {time.monotonic():.3f}", flush=True)
    raise
print(f"rank {rank} finished without error", flush=True)
