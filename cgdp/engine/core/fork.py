"""A process forked after cgdp has run: its child computes on one thread.

GNU OpenMP runs Numba's default threading layer (``omp``) and torch's CPU kernels on Linux, and it cannot start a
parallel region in a child forked after the parent ran one: Numba ends such a child with SIGTERM ("fork() called from a
process already using GNU OpenMP, this is unsafe"), and torch's kernels wait for pool threads that do not exist in the
child. A ``multiprocessing.Pool`` (fork is Python 3.11's default start method on Linux) whose worker uses cgdp then
waits forever for a result that never comes; a ``DataLoader`` worker dies.

The remedy, chosen over another Numba threading layer (``workqueue`` is fork-safe but aborts when two threads launch
kernels at once, as two trainers' host accumulators do; ``tbb`` is not a dependency): once cgdp's engine has run in a
process (:func:`engine_started`, called when device threads start or a parallel host kernel first runs), a handler
registered with ``os.register_at_fork`` marks every child forked from then on (:data:`forked_child`). In such a child
the host kernels run their serial versions (:mod:`cgdp.engine.core.accumulate`; the same bits, since their result never
depends on the thread count) and torch computes on one intra-op thread, as PyTorch's ``DataLoader`` sets up its own
workers. Children started with ``spawn`` or ``forkserver`` (or forked before cgdp ran) are untouched and use every core.

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
    """Note that cgdp's engine runs in this process: children forked from now on compute on one thread. Cheap after the
    first call."""
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
