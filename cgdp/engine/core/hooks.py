"""Per-parameter backward hooks: mark a layer ready, and send its chunk when the chunk is complete.

One hook per trainable parameter per replica (``register_post_accumulate_grad_hook``). It runs on
the thread that executes backward for that device (the device's own thread on emulated devices,
autograd's device thread on CUDA), so a device's counters are only ever touched by one thread and
need no lock. A hook does three things and returns: marks its parameter touched, counts down its
chunk, and, when the count reaches zero, asks the device to send the chunk (which only enqueues).
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class DeviceHooks:
    def __init__(self, params: list[torch.nn.Parameter], send: Callable[[int], None],
                 stamp: Callable[[], Any]):
        self.params = params
        self._send = send
        self._stamp = stamp
        self.views: list[torch.Tensor] = []
        """Each parameter's gradient view into the flat buffer (what ``.grad`` must be)."""
        self.param_chunk: list[int] = []
        self._template: list[int] = []
        self.pending: list[int] = []
        self.sent: list[bool] = []
        self.touched = bytearray(len(params))
        self.replaced = bytearray(len(params))
        """Per parameter: the hook found ``.grad`` replaced (None before this backward) and put
        the view back, overwriting the view's old contents."""
        self.ready_at: list[Any] = [0.0] * len(params)
        self.streaming = False
        """True in mode 'cgdp': hooks send chunks. Otherwise they only mark parameters touched."""
        self.timing = False
        self.note: Callable[[int], None] | None = None
        """Called with the chunk of each gradient that arrives while streaming (CUDA: notes the
        stream it accumulated on, which the chunk's send must wait for)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._make(pid))
                         for pid, p in enumerate(params)]

    def set_layout(self, param_chunk: list[int], chunk_params: list[int],
                   views: list[torch.Tensor]) -> None:
        self.views = views
        self.param_chunk = list(param_chunk)
        self._template = list(chunk_params)

    def begin_step(self) -> None:
        self.pending = list(self._template)
        self.sent = [False] * len(self._template)
        self.touched[:] = bytes(len(self.touched))

    def _make(self, pid: int):
        def hook(p: torch.Tensor) -> None:
            view, grad = self.views[pid], p.grad  # read once: another thread may zero_grad
            if grad is not view:
                # .grad was replaced (e.g. zero_grad(set_to_none=True) on a replica): autograd
                # then stores a new tensor instead of adding into the flat buffer. Put it back.
                if grad is not None:
                    view.copy_(grad)
                p.grad = view
                self.replaced[pid] = 1
            self.touched[pid] = 1
            if self.timing:
                self.ready_at[pid] = self._stamp()
            if self.streaming:
                c = self.param_chunk[pid]
                if self.note is not None:
                    self.note(c)
                left = self.pending[c] - 1
                self.pending[c] = left
                if left == 0:
                    self._send(c)
        return hook

    def flush(self) -> None:
        """Send the chunks that backward never completed (layers unused this step), in plan order."""
        for c, done in enumerate(self.sent):
            if not done:
                self._send(c)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
