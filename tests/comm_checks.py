"""Shared by the MPI and gloo scripts: checks of a comm's blocking collectives, the fault trap."""
import os
import signal
import threading
import time

import numpy as np
import torch


def check_small_collectives(comm) -> None:
    """allreduce_small, broadcast_object and check_same (which must name the rank that differs)."""
    rank, size = comm.rank, comm.size
    assert comm.allreduce_small(np.array([rank + 1.0, 5.0])).tolist() == [size * (size + 1) / 2, 5.0 * size]
    assert comm.broadcast_object({"plan": [[1], [0]]} if rank == 0 else None) == {"plan": [[1], [0]]}
    comm.check_same({"layers": "fc1:10;fc2:3", "devices_per_rank": "2"})
    try:
        comm.check_same({"layers": "fc1:10;fc2:3", "devices_per_rank": str(2 + rank)})
        raise AssertionError("check_same accepted different signatures")
    except RuntimeError as exc:
        assert "rank 1" in str(exc) and "devices_per_rank" in str(exc), exc


class Trap(torch.nn.Module):
    """Identity; once ``armed``, its gradient (mid-backward) sends this process ``Trap.mode``'s
    signal: ``"kill"`` (SIGKILL: a crash) or ``"stop"`` (SIGSTOP: a frozen machine)."""
    armed = False
    armed_at = 0.0
    mode = "kill"

    def forward(self, x):
        if Trap.armed and x.requires_grad:
            x.register_hook(Trap.spring)
        return x

    @staticmethod
    def spring(grad):
        print(f"rank 1 trap springs ({Trap.mode}) in {threading.current_thread().name}", flush=True)
        os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[Trap.mode])


def trapped_model() -> torch.nn.Module:
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Trap(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def train_trapped(tr, rank: int, steps: int = 4) -> None:
    """``steps`` steps of 6 samples; the trap is armed on rank 1 for step 2 (``Trap.armed_at``)."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        if step == 2:
            Trap.armed = rank == 1
            Trap.armed_at = time.monotonic()
        tr.step(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g), F.cross_entropy)
        print(f"rank {rank} step {step} done", flush=True)
