"""Per-parameter backward hooks, and the marks they leave: what one backward did, per replica.

One ``register_post_accumulate_grad_hook`` per trainable parameter per replica, run on the thread executing that
device's backward, so a device's marks have one writer and need no lock. A hook marks its parameter touched, counts
down its chunk and, at zero, asks the device to send it (which only enqueues). The hooks hold no state of their own:
they write into the :class:`StepMarks` of the gradients' owner (:mod:`cgdp.engine.core.gradients`), which clears them
at one point, :meth:`StepMarks.reset`.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch


class StepMarks:
    """What one backward's hooks recorded, per replica ``j`` (lists and bytearrays updated in place)."""

    def __init__(self, replicas: int, params: int):
        self._flags = bytearray(2 * replicas * params)  # touched, then replaced: one clear for both
        rows = [memoryview(self._flags)[k * params:(k + 1) * params] for k in range(2 * replicas)]
        self.touched = rows[:replicas]
        """Per parameter: a gradient arrived since the last reset."""
        self.replaced = rows[replicas:]
        """Per parameter: the hook found ``.grad`` replaced and put the view back, overwriting its old contents."""
        self.stolen = [bytearray(params) for _ in range(replicas)]
        """Per parameter: ``.grad`` set None before backward (large); the hook writes ``0.0 + grad`` in its view."""
        self.ready_at: list[list[Any]] = [[0.0] * params for _ in range(replicas)]
        self.pending: list[list[int]] = [[] for _ in range(replicas)]
        """Per chunk: parameters still to come."""
        self.sent = [bytearray() for _ in range(replicas)]
        """Per chunk: complete or flushed (sent; with a ring, ``host_memory``, sent in plan order as slots free)."""
        self.next = [0] * replicas
        """Ring: the next segment to send (plan order)."""
        self._shape, self._size = (replicas, params), replicas * params
        self._rows = list(zip(self.pending, self.sent))
        self._start: tuple = ([], b"", bytes(len(self._flags)), [0] * replicas)

    def set_layout(self, chunk_params: list[int]) -> None:
        self._start = (list(chunk_params), bytes(len(chunk_params)), *self._start[2:])
        self.reset()

    def reset(self) -> None:
        """The one reset point: before a backward, and once a backward was recorded (a hook after it is the next's)."""
        chunk_params, no_chunk, no_flag, zeros = self._start
        for pending, sent in self._rows:
            pending[:] = chunk_params
            sent[:] = no_chunk
        self._flags[:] = no_flag
        self.next[:] = zeros

    def counts(self) -> np.ndarray:
        """Per parameter, on how many replicas it got a gradient."""
        return np.frombuffer(self._flags, np.uint8)[:self._size].reshape(self._shape).sum(0, np.float64)


class DeviceHooks:
    def __init__(self, params: list[torch.nn.Parameter], marks: StepMarks, j: int, send: Callable[[int], None],
                 stamp: Callable[[], Any], note: Callable[[int], None] | None = None):
        """Replica ``j``'s hooks; ``send(c)``: chunk c is complete; ``note(c)``: a gradient of chunk c arrived while
        streaming (CUDA: notes the stream its send waits for)."""
        self._send = send
        self._stamp = stamp
        self._note = note
        self.views: list[torch.Tensor | None] = [None] * len(params)
        """Each parameter's gradient view into the flat buffer (what ``.grad`` must be)."""
        self.param_chunk: list[int] = [0] * len(params)
        self.mode = SimpleNamespace(streaming=False, timing=False)
        """What every hook of this device does this backward (one record, read by every hook): ``streaming``, send
        chunks (mode 'cgdp'; else only mark parameters touched); ``timing``, stamp when each parameter was ready."""
        self._handles = [p.register_post_accumulate_grad_hook(self._make(pid, marks, j))
                         for pid, p in enumerate(params)]

    def set_layout(self, param_chunk: list[int], views: list[torch.Tensor]) -> None:
        self.views[:] = views
        self.param_chunk[:] = param_chunk

    def _make(self, pid: int, marks: StepMarks, j: int):
        views, chunk_of, mode = self.views, self.param_chunk, self.mode
        touched, replaced, stolen, pending, ready_at = (
            marks.touched[j], marks.replaced[j], marks.stolen[j], marks.pending[j], marks.ready_at[j])
        send, stamp, note = self._send, self._stamp, self._note

        def hook(p: torch.Tensor) -> None:
            view, grad = views[pid], p.grad  # read once: another thread may zero_grad
            if grad is not view:
                if grad is not None and stolen[pid]:  # one pass (read, write) where zeroing and adding made three
                    torch.add(grad, 0.0, out=view)
                else:
                    # .grad was replaced (e.g. zero_grad(set_to_none=True) on a replica): autograd then stores a new
                    # tensor instead of adding into the flat buffer. Put it back.
                    if grad is not None:
                        view.copy_(grad)
                    replaced[pid] = 1
                p.grad = view
            touched[pid] = 1
            if mode.timing:
                ready_at[pid] = stamp()
            if mode.streaming:
                c = chunk_of[pid]
                if note is not None:
                    note(c)
                left = pending[c] - 1
                pending[c] = left
                if left == 0:
                    send(c)
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

