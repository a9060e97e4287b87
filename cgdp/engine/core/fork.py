"""A process forked after cgdp has run: its child computes on one thread.

GNU OpenMP (Numba's ``omp`` layer, torch's CPU kernels) cannot start a parallel region in a child forked after the
parent ran one: Numba kills it, torch hangs. So once the engine has run (:func:`engine_started`), an
``os.register_at_fork`` handler marks every later child (:data:`forked_child`), which then runs the serial host kernels
(same bits) and one torch intra-op thread, as ``DataLoader`` workers do. (Numba's ``workqueue`` layer aborts when two
threads launch kernels; ``tbb`` is not a dependency.) ``spawn``/``forkserver`` children are untouched.

May import nothing of cgdp.
"""
from __future__ import annotations

import os
import threading

import torch

forked_child = False
"""True in a process forked from one in which cgdp's engine had run."""
_registered = False
_lock = threading.Lock()


def engine_started() -> None:
    """Children forked from now on compute on one thread. Cheap after the first call."""
    global _registered
    if _registered or not hasattr(os, "register_at_fork"):  # no fork on Windows
        return
    with _lock:
        if not _registered:
            os.register_at_fork(after_in_child=_in_child)
            _registered = True


def _in_child() -> None:
    global forked_child
    forked_child = True
    torch.set_num_threads(1)  # what torch's DataLoader does in its (forked) workers
