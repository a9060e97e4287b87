"""Each simulated device's backward on a thread of its own, as autograd's engine runs a CUDA device's.

Part of :mod:`cgdp.testing.cuda_sim`. On a GPU, ``backward()`` of a graph on ``cuda:d`` runs its
nodes, and every hook on them, on autograd's device thread for ``d`` (one per GPU, ``pt_autograd_d``),
while the calling thread waits; that thread has its own Python thread-locals and current device,
and each node runs on the stream its forward ran on. :class:`AutogradThreads` does the same for a
graph whose roots live on one simulated device (``backward``, ``Tensor.backward``,
``torch.autograd.grad``): the call runs on the device's thread, with the caller's current stream
of that device, and its result or error comes back to the caller. A backward whose roots span
several devices still runs on the calling thread (CPU autograd has one ready queue per graph: its
nodes cannot be split across threads from outside), see docs/cuda.md.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

import torch

__all__ = ["AutogradThreads", "BACKWARDS"]

BACKWARDS = {torch.autograd.backward, torch.Tensor.backward, torch.autograd.grad}


class AutogradThreads:
    """One worker thread per simulated device, started on its first backward."""

    def __init__(self, sim: Any):
        self.sim = sim
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._mine = threading.local()

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        roots = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        roots = [roots] if isinstance(roots, torch.Tensor) else list(roots or [])
        devs = {self.sim.syncs.device_of(t) for t in roots if isinstance(t, torch.Tensor)}
        if len(devs) != 1 or None in devs or getattr(self._mine, "device", None) is not None:
            return func(*args, **kwargs)  # several devices, the host, or already a device thread
        d = devs.pop()
        fut: Future = Future()
        self._queue(d).put((fut, func, args, kwargs, self.sim.current_stream(d)))
        return fut.result()

    def _queue(self, d: int) -> queue.SimpleQueue:
        with self._lock:
            q = self._queues.get(d)
            if q is None:
                q = self._queues[d] = queue.SimpleQueue()
                t = threading.Thread(target=self._serve, args=(d, q), name=f"pt_autograd_{d}", daemon=True)
                self._threads.append(t)
                t.start()
            return q

    def _serve(self, d: int, q: queue.SimpleQueue) -> None:
        self._mine.device = d
        self.sim._set(d)  # the engine's set_device for its device thread
        while True:
            item = q.get()
            if item is None:
                return
            fut, func, args, kwargs, stream = item
            tls = self.sim._tls()
            tls.streams[d] = stream  # (each node on its forward's stream: the caller's)
            try:
                fut.set_result(func(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            finally:
                tls.streams.pop(d, None)

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)
